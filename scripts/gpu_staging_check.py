"""GPU check of host-buffer staging: VRAM -> pinned host -> tcp -> pinned host -> VRAM.

    python scripts/gpu_staging_check.py [--out DIR] [--gib 1]

Two processes, each with a VRAM cache and a host buffer registered with the tcp transport (which
stages VRAM through its bounded pinned pool). Measured in the same run: the staged READ end to end
(bytes verified), pinned D2H and H2D of the same bytes, the tcp transport alone host -> host on
the same extents, and the three stages back to back (what no pipelining would cost).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

EXT = 4 << 20
OPTS = {"staging_chunk": 8 << 20, "staging_buffers": 8, "timeout_s": 120}


def _regions(dev: Any, host: np.ndarray) -> list[Any]:
    from kvlink.transport import Region

    return [Region(dev.data_ptr(), dev.numel(), "cuda:0"),
            Region(int(host.__array_interface__["data"][0]), host.nbytes, "cpu")]


def producer(q: Any, done: Any, nbytes: int) -> None:
    import torch

    from kvlink.transport import TransportContext
    from kvlink_transports.tcp import TcpTransport

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(7)
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    host = np.ones(nbytes, dtype=np.uint8)
    t = TcpTransport(TransportContext("producer"), OPTS)
    t.register(_regions(dev, host))
    q.put((t.descriptor(), dev.data_ptr(), int(host.__array_interface__["data"][0])))
    done.wait(600)
    t.close()


def main() -> None:
    import torch

    from kvlink.transport import Op, TransportContext, XferStatus, make_extents
    from kvlink_transports.tcp import TcpTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // EXT * EXT
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=(q, done, nbytes))
    p.start()
    desc, rdev, rhost = q.get(timeout=300)
    torch.cuda.set_device(0)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    host = np.zeros(nbytes, dtype=np.uint8)
    t = TcpTransport(TransportContext("consumer"), OPTS)
    t.register(_regions(dev, host))
    t.connect("producer", desc)
    n = nbytes // EXT
    perm = np.random.default_rng(0).permutation(n).astype(np.uint64) * np.uint64(EXT)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(EXT)

    def read(local_base: int, remote_base: int) -> None:
        h = t.post(Op.READ, "producer", make_extents(local_base + offs, EXT),
                   make_extents(remote_base + perm, EXT))
        st = t.wait(h, 300)
        t.release(h)
        if st.status is not XferStatus.DONE:
            raise RuntimeError(st.reason)

    res: dict[str, Any] = {"bytes": nbytes, "extent_bytes": EXT, "options": OPTS}
    res["staged_read_s"] = _gpu_common.host_seconds(lambda: read(dev.data_ptr(), rdev), args.reps)
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    want = src.view(-1, EXT)[torch.from_numpy((perm // np.uint64(EXT)).astype(np.int64)).cuda()]
    res["verified"] = bool(torch.equal(dev.view(-1, EXT), want))
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    timed = _gpu_common.host_seconds
    res["pinned_d2h_s"] = timed(lambda: pinned.copy_(src, non_blocking=True), args.reps)
    res["pinned_h2d_s"] = timed(lambda: src.copy_(pinned, non_blocking=True), args.reps)
    res["tcp_host_only_s"] = timed(
        lambda: read(int(host.__array_interface__["data"][0]), rhost), args.reps)
    slowest = max(res["pinned_d2h_s"], res["pinned_h2d_s"], res["tcp_host_only_s"])
    res["unpipelined_sum_s"] = res["pinned_d2h_s"] + res["pinned_h2d_s"] + res["tcp_host_only_s"]
    res["ratio_to_slowest_stage"] = slowest / res["staged_read_s"]
    res["ratio_to_unpipelined"] = res["unpipelined_sum_s"] / res["staged_read_s"]
    for k in ("staged_read_s", "pinned_d2h_s", "pinned_h2d_s", "tcp_host_only_s",
              "unpipelined_sum_s"):
        res[k.replace("_s", "_gbps")] = nbytes / res[k] / 1e9
    res["pool_high_water"] = t._pool.high_water if t._pool else None
    print(json.dumps(res, indent=1), flush=True)
    done.set()
    p.join(60)
    t.close()
    _gpu_common.write(args.out, "gpu_staging.json", res)


if __name__ == "__main__":
    main()
