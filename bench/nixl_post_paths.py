"""kvlink's NIXL READ path vs NixlConnector's, outside vLLM, on the same agent pair.

Run:  .venv/bin/python bench/nixl_post_paths.py [--reads 60] [--out FILE]

A target process registers a KV-cache-like region (4 layer planes x 256 blocks x 32 KiB, the
vllm_pd tiny model's LBHNC pages) and serves it; this process READs requests of 2-16 consecutive
blocks into its own (touched) region, alternating per request between

* ``kvlink``: ``NixlTransport.post`` (kvlink's coalesced extents, dlists prepped per request,
  ``make_prepped_xfer``) and ``poll`` until DONE, without a NIXL notification: kvlink's worker
  sends a READ's "done" over its side channel once the READ is DONE;
* ``baseline``: NixlConnector's way, one descriptor per (layer, block) prepped ONCE for the
  whole region on both sides, then ``make_prepped_xfer`` with index lists + ``transfer`` and
  ``check_xfer_state`` until DONE;

the baseline with its notification attached, each on its own NIXL agent in this process (so the
same UCX configuration). Reported per
path: wall time post to DONE, time in the post call, and NIXL's telemetry ``xferDuration`` /
``postDuration`` (what ``vllm:nixl_xfer_time_seconds`` shows); ratios kvlink / baseline. Bytes
are verified for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _common import write_result  # noqa: E402

LAYERS, BLOCKS, PAGE = 4, 256, 32768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=60, help="READs per path")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from test_nixl_transport import OPTS, Peer  # the target process of the transport tests

    from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
    from kvlink_transports.nixl import NixlTransport

    nbytes = LAYERS * BLOCKS * PAGE
    peer = Peer(f"peer-{uuid.uuid4().hex[:6]}", nbytes, seed=3)
    t = NixlTransport(TransportContext(agent_name=f"bench-{uuid.uuid4().hex[:6]}"),
                      {**OPTS, "telemetry": True})
    # the baseline on its own agent in this process (the same UCX configuration), so neither
    # path's requests share NIXL state with the other's
    tb = NixlTransport(TransportContext(agent_name=f"base-{uuid.uuid4().hex[:6]}"),
                       {**OPTS, "telemetry": True})
    buf = np.ones(nbytes, dtype=np.uint8)
    res: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        res.setdefault(key, []).append(v)

    def offsets(blocks: list[int]) -> np.ndarray:
        return np.array([lay * BLOCKS * PAGE + b * PAGE for lay in range(LAYERS) for b in blocks],
                        dtype=np.uint64)

    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(peer.name, peer.descriptor)
        tb.register([Region(buf.ctypes.data, buf.nbytes)])
        tb.connect(peer.name, peer.descriptor)
        # NIXL agents are not safe to drive from two threads: take the lock the transport's
        # own progress thread takes (without it, READs here hung for good now and then)
        agent: Any = tb._agent
        lock = tb._lock
        every = [(lay, b) for lay in range(LAYERS) for b in range(BLOCKS)]
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(
            [[buf.ctypes.data + lay * BLOCKS * PAGE + b * PAGE, PAGE, 0] for lay, b in every],
            dtype=np.uint64), "DRAM")
        rh = agent.prep_xfer_dlist(peer.name, np.array(
            [[peer.addr + lay * BLOCKS * PAGE + b * PAGE, PAGE, 0] for lay, b in every],
            dtype=np.uint64), "DRAM")
        ref = peer.reference()
        rng = np.random.default_rng(0)
        for _ in range(args.reads):
            n = int(rng.integers(2, 17))
            start = int(rng.integers(0, BLOCKS - n))
            lb = list(range(start, start + n))
            rb = list(range(BLOCKS - start - n, BLOCKS - start))
            # kvlink
            t0 = time.perf_counter()
            h = t.post(Op.READ, peer.name, make_extents(buf.ctypes.data + offsets(lb), PAGE),
                       make_extents(peer.addr + offsets(rb), PAGE))
            t1 = time.perf_counter()
            if t.wait(h, 30).status is not XferStatus.DONE:
                raise TimeoutError("kvlink READ not DONE within 30 s")
            t2 = time.perf_counter()
            tel = t.xfer_telemetry(h)
            t.release(h)
            add("kvlink_wall_s", t2 - t0)
            add("kvlink_post_call_s", t1 - t0)
            add("kvlink_nixl_xfer_s", sum(e["xfer_us"] for e in tel) / 1e6)
            add("kvlink_nixl_post_s", sum(e["post_us"] for e in tel) / 1e6)
            assert np.array_equal(buf[offsets(lb)[0]:offsets(lb)[0] + n * PAGE],
                                  ref[offsets(rb)[0]:offsets(rb)[0] + n * PAGE])
            buf[:] = 1
            # NixlConnector's way
            il = np.array([lay * BLOCKS + b for lay in range(LAYERS) for b in lb], dtype=np.int32)
            ir = np.array([lay * BLOCKS + b for lay in range(LAYERS) for b in rb], dtype=np.int32)
            t0 = time.perf_counter()
            with lock:
                req = agent.make_prepped_xfer("READ", lh, il, rh, ir, notif_msg=b"b")
                agent.transfer(req)
            t1 = time.perf_counter()
            deadline = time.monotonic() + 30
            while True:
                with lock:
                    if agent.check_xfer_state(req) != "PROC":
                        break
                if time.monotonic() > deadline:
                    done = len(res.get("baseline_wall_s", []))
                    raise TimeoutError(f"baseline READ {done} not DONE within 30 s")
            t2 = time.perf_counter()
            with lock:
                tl = agent.get_xfer_telemetry(req)
                agent.release_xfer_handle(req)
            add("baseline_wall_s", t2 - t0)
            add("baseline_post_call_s", t1 - t0)
            add("baseline_nixl_xfer_s", tl.xferDuration / 1e6)
            add("baseline_nixl_post_s", tl.postDuration / 1e6)
            assert np.array_equal(buf[offsets(lb)[0]:offsets(lb)[0] + n * PAGE],
                                  ref[offsets(rb)[0]:offsets(rb)[0] + n * PAGE])
            buf[:] = 1
        lh.release()
        rh.release()
    finally:
        peer.stop()
        t.close()
        tb.close()

    for path in ("kvlink", "baseline"):  # NIXL saw the request complete inside the post call
        inline = [x == p for x, p in zip(res[f"{path}_nixl_xfer_s"], res[f"{path}_nixl_post_s"])]
        res[f"{path}_done_at_post"] = [float(sum(inline) / len(inline))]
    med = {k: statistics.median(v) for k, v in res.items()}
    ratios = {f"{k}_kvlink_over_baseline": med[f"kvlink_{k}_s"] / med[f"baseline_{k}_s"]
              for k in ("wall", "nixl_xfer")}
    for k, v in sorted(med.items()):
        print(f"{k:24s} {v:7.3f} (fraction)" if k.endswith("done_at_post")
              else f"{k:24s} p50 {v * 1e3:7.3f} ms")
    print(ratios)
    write_result("nixl_post_paths", {
        "description": __doc__.split("\n\n")[0],
        "layout": {"layers": LAYERS, "blocks": BLOCKS, "page_bytes": PAGE,
                   "blocks_per_read": "2-16"},
        "p50_s": med, "ratios": ratios, "raw_s": res,
    }, args.out)


if __name__ == "__main__":
    main()
