"""GPU check of host-buffer staging: VRAM -> pinned host -> tcp -> pinned host -> VRAM.

    python scripts/gpu_staging_check.py [--out DIR] [--gib 1]
    python scripts/gpu_staging_check.py --stream-order [--modes order no-order] [--out DIR]

Two processes, each with a VRAM cache and a host buffer registered with the tcp transport (which
stages VRAM through its bounded pinned pool). Measured in the same run: the staged READ end to end
(bytes verified), pinned D2H and H2D of the same bytes, the tcp transport alone host -> host on
the same extents, and the three stages back to back (what no pipelining would cost).

``--stream-order``: the staged copies run after the caller's current stream at post
(kvlink/staging.py "Stream order"), checked as scripts/gpu_stream_order_check.py checks cuda_ipc
and with its cases and helpers: two processes on one GPU through ``KVWorker`` with transports
``["tcp"]`` and device caches (so tcp stages through pinned memory), the prefill holding its
requests with ``worker.hold`` and draining ``worker.released()``. Each case queues
``torch.cuda._sleep`` and then a write of the blocks involved on the caller's current stream,
then asks for the transfer; after poll() says finished the wrong elements are counted (must be
0): ``read_default_stream`` (destination filled with a sentinel on the default stream),
``read_side_stream`` (the same on a user stream set as current), ``write_source`` (the source
still being written when ``write`` posts; the prefill's blocks read back). Mode ``no-order``
runs them with tcp option ``stream_order=False`` (the behaviour before the wait). ``post_us``:
host time of a one-page post with and without the mark, the caller's stream idle or busy.
Results: bench/results/gpu_staging_stream_order.json.
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


STREAM_OPTS = {"timeout_s": 60}


def _staged_decode_class() -> Any:
    import gpu_stream_order_check as so

    class StagedDecode(so.Decode):  # type: ignore[misc]
        """gpu_stream_order_check's decode with transports ["tcp"] (staged through pinned
        memory); read() and write() are its cases."""

        def __init__(self, mode: str, port: int, remote_base: int, cycles: int,
                     timeout: float) -> None:
            import torch

            from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

            self.torch, self.mode, self.cycles, self.timeout = torch, mode, cycles, timeout
            self.cache, layers = so._cache(so.DECODE_BLOCKS)
            self.i16 = self.cache.view(torch.int16)
            opts = {"tcp": {**STREAM_OPTS, "stream_order": mode == "order"}}
            self.worker = KVWorker(WorkerConfig(engine_id=f"decode-{mode}", transports=["tcp"],
                                                transport_options=opts, serve=False))
            self.worker.register(so._spec(layers))
            self.transport = self.worker.transports["tcp"]
            assert self.transport._copier is not None, "tcp is not staging the device cache"
            self.remote = RemoteEngine("prefill", "127.0.0.1", port)
            self.remote_base = remote_base
            rng = np.random.default_rng(7)
            self.lids = rng.permutation(so.N).astype(np.int64)
            self.rids = rng.permutation(so.N).astype(np.int64)
            pat = so._pattern(so.LAYERS * 2 * so.PREFILL_BLOCKS * so.BS * so.HEADS * so.DIM)
            self.prefill_i16 = pat.view(so.LAYERS, 2, so.PREFILL_BLOCKS, so.BS, so.HEADS,
                                        so.DIM)
            dev = self.cache.device
            self.lidx = torch.from_numpy(self.lids).to(dev)
            self.ridx = torch.from_numpy(self.rids).to(dev)
            self.expected = self.prefill_i16[:, :, self.ridx]
            torch.cuda.synchronize()
            self.worker.read(f"{mode}-warmup", self.remote, self.lids, self.rids)
            self.warmup = self.wait(f"{mode}-warmup")
            torch.cuda.synchronize()
            if not self.warmup["finished"]:
                raise RuntimeError(f"warm-up READ failed: {self.warmup}")

        def post_us(self, reps: int = 200) -> dict[str, float]:
            """Host time (median, us) of a one-page staged READ post with and without the
            mark, the caller's stream idle (one stream query) or with a tiny kernel pending
            (query + event record)."""
            from kvlink.transport import make_extents

            page = so.BS * so.HEADS * so.DIM * 2
            return so.post_host_us(self.torch, self.transport,
                                   self.worker.connected_peers()[0],
                                   make_extents(self.cache.data_ptr(), page),
                                   make_extents(self.remote_base, page), reps, self.timeout)

    return StagedDecode


def stream_order_main(args: Any) -> None:
    import gpu_stream_order_check as so
    import torch

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=so.prefill, args=(q, stop, args.modes, "tcp", STREAM_OPTS))
    p.start()
    cases = ("read_default_stream", "read_side_stream", "write_source")
    results: dict[str, Any] = {
        "transport": "tcp (device caches staged through pinned host memory)",
        "elements_per_transfer": so.LAYERS * 2 * so.N * so.BS * so.HEADS * so.DIM,
        "sleep_cycles": args.sleep_cycles, "options": STREAM_OPTS, "modes": {}}
    decode_cls = _staged_decode_class()
    try:
        port, remote_base = q.get(timeout=300)
        torch.cuda.set_device(0)
        results["sleep_s"] = so.sleep_seconds(torch, args.sleep_cycles)
        for mode in args.modes:
            d = decode_cls(mode, port, remote_base, args.sleep_cycles, args.timeout)
            row: dict[str, Any] = {"stream_order": d.transport.stream_order,
                                   "copier": type(d.transport._copier).__name__,
                                   "warmup": d.warmup}
            try:
                row["read_default_stream"] = d.read("read_default_stream")
                row["read_side_stream"] = d.read("read_side_stream", torch.cuda.Stream())
                row["write_source"] = d.write()
                if mode == "order":
                    row["post_us"] = d.post_us()
                    row["events_created"] = d.transport._copier.marks.created
            finally:
                d.close()
            results["modes"][mode] = row
            for case in cases:
                r = row[case]
                print(f"{mode:9s} {case:20s} wrong {r['wrong']:>11,} of {r['elements']:,}",
                      {k: v for k, v in r.items() if k not in ("wrong", "elements")},
                      flush=True)
            if "post_us" in row:
                print(f"{mode:9s} post_us", row["post_us"], flush=True)
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()
    for mode, row in results["modes"].items():
        results[f"{mode}_wrong"] = {c: row[c]["wrong"] for c in cases}
    order = results["modes"].get("order")
    if order is not None:
        results["ordered_all_zero"] = all(order[c]["wrong"] == 0 for c in cases)
    _gpu_common.write(args.out, "gpu_staging_stream_order.json", results)


def main() -> None:
    import torch

    from kvlink.transport import Op, TransportContext, XferStatus, make_extents
    from kvlink_transports.tcp import TcpTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream-order", action="store_true",
                    help="check stream order through KVWorker instead of measuring throughput")
    ap.add_argument("--modes", nargs="+", choices=("order", "no-order"),
                    default=["order", "no-order"])
    ap.add_argument("--sleep-cycles", type=int, default=1_000_000_000,
                    help="torch.cuda._sleep length queued before each case's write (~0.5 s)")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    if args.stream_order:
        stream_order_main(args)
        return
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
