"""kvlink's mooncake transport vs Mooncake's own ``transfer_engine_bench``, same run, same machine.

Both sides WRITE ``--block-size`` blocks from one process into another over 127.0.0.1, protocol
tcp, metadata P2PHANDSHAKE, ``--batch-size`` entries per engine batch:

* baseline: ``transfer_engine_bench`` (shipped in the mooncake wheel) as target + initiator,
  ``--threads`` submitting threads (default 1), each submitting a batch and spinning until it
  completes, for ``--duration`` seconds; it reports its own throughput.
* kvlink: a spawned process registers its buffer with ``MooncakeTransport`` and hands over the
  descriptor; this process posts WRITEs of ``--per-post`` extents (sub-batched into engine batches
  of ``--batch-size``; at most 1024 entries in flight per peer), keeps ``--depth`` posts
  outstanding for ``--duration`` seconds and counts completed bytes. The target's bytes are checked
  once at the end. It runs twice: as configured by default (up to 1024 entries in flight), and
  with one batch in flight (``max_inflight_per_peer = --batch-size``), the engine bench's
  concurrency with one thread.

The headline ratio divides kvlink's median by the median over rounds of the best engine-bench
thread count in that round (more spinning threads only slow it down on a small machine).

Runs alternate (baseline, kvlink, baseline, ...) to share the machine's noise; medians are compared.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import write_result

_LISTEN = re.compile(r"P2P handshake, listening on ([^\s:]+):(\d+)")
_RATE = re.compile(r"throughput ([0-9.]+) GB/s")


def engine_bench_path() -> str:
    import mooncake

    path = Path(mooncake.__file__).resolve().parent / "transfer_engine_bench"
    if not path.is_file():
        raise SystemExit(f"transfer_engine_bench not found next to {mooncake.__file__}")
    return str(path)


def _pump(stream: Any, lines: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put("")


def engine_bench(block: int, batch: int, threads: int, duration: float) -> float:
    """GB/s reported by transfer_engine_bench (write, tcp, P2PHANDSHAKE, 127.0.0.1)."""
    exe = engine_bench_path()
    env = {**os.environ, "GLOG_minloglevel": "0", "GLOG_logtostderr": "1"}
    size = str(max(block * batch * threads, 64 << 20))
    common = ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--local_server_name=127.0.0.1",
              f"--buffer_size={size}", "--report_unit=GB", "--report_precision=4"]
    target = subprocess.Popen([exe, "--mode=target", *common], env=env, text=True,
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump, args=(target.stderr, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        segment = None
        while segment is None:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line == "":
                raise RuntimeError("transfer_engine_bench target exited before listening")
            m = _LISTEN.search(line)
            if m:
                segment = f"{m.group(1)}:{m.group(2)}"
        out = subprocess.run(
            [exe, "--mode=initiator", *common, f"--segment_id={segment}", "--operation=write",
             f"--block_size={block}", f"--batch_size={batch}", f"--threads={threads}",
             f"--duration={max(round(duration), 1)}"],
            env=env, text=True, capture_output=True, timeout=duration + 120)
        m = _RATE.search(out.stderr + out.stdout)
        if out.returncode != 0 or m is None:
            raise RuntimeError(f"transfer_engine_bench initiator failed ({out.returncode}): "
                               f"{(out.stderr + out.stdout)[-2000:]}")
        return float(m.group(1))
    finally:
        target.terminate()
        target.wait(30)


def _target(conn: Any, nbytes: int) -> None:
    from kvlink.transport import Region, TransportContext
    from kvlink_transports.mooncake import MooncakeTransport

    buf = np.zeros(nbytes, dtype=np.uint8)
    t = MooncakeTransport(TransportContext("bench-target"))
    t.register([Region(buf.ctypes.data, nbytes)])
    conn.send((t.descriptor(), buf.ctypes.data))
    while True:
        cmd = conn.recv()
        if cmd == "bytes":
            conn.send_bytes(buf.tobytes())
        else:
            t.close()
            conn.send("bye")
            return


def kvlink_bench(block: int, batch: int, per_post: int, depth: int, duration: float,
                 max_inflight: int = 1024) -> dict[str, Any]:
    from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
    from kvlink_transports.mooncake import MooncakeTransport

    nbytes = block * per_post
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, nbytes), daemon=True)
    proc.start()
    if not conn.poll(60):
        raise RuntimeError("kvlink target did not start")
    desc, raddr = conn.recv()
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    t = MooncakeTransport(TransportContext("bench-initiator"),
                          {"sub_batch": batch, "max_inflight_per_peer": max_inflight})
    try:
        t.register([Region(src.ctypes.data, nbytes)])
        t.connect("target", desc)
        offs = np.arange(per_post, dtype=np.uint64) * np.uint64(block)
        local = make_extents(src.ctypes.data + offs, block)
        remote = make_extents(raddr + offs, block)

        def finish(h: int) -> None:
            st = t.wait(h, 120)
            t.release(h)
            if st.status is not XferStatus.DONE:
                raise RuntimeError(st.reason)

        finish(t.post(Op.WRITE, "target", local, remote))  # warm-up: opens the segment
        posted = 0
        outstanding: list[int] = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration or outstanding:
            while len(outstanding) < depth and time.perf_counter() - t0 < duration:
                outstanding.append(t.post(Op.WRITE, "target", local, remote))
                posted += 1
            finish(outstanding.pop(0))
        seconds = time.perf_counter() - t0
        conn.send("bytes")
        verified = bool(np.array_equal(np.frombuffer(conn.recv_bytes(), dtype=np.uint8), src))
        return {"gbps": posted * nbytes / seconds / 1e9, "posts": posted, "seconds": seconds,
                "max_inflight_per_peer": max_inflight, "verified": verified}
    finally:
        t.close()
        conn.send("stop")
        conn.poll(30)
        proc.join(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=64 << 10)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--threads", default="1,2",
                    help="transfer_engine_bench thread counts; the baseline of a round is the "
                         "best of them")
    ap.add_argument("--per-post", type=int, default=1024, help="extents per kvlink post")
    ap.add_argument("--depth", type=int, default=2, help="kvlink posts outstanding")
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "1")
    threads = [int(x) for x in args.threads.split(",")]
    block, batch = args.block_size, args.batch_size
    base: dict[int, list[float]] = {th: [] for th in threads}
    best: list[float] = []
    ours: list[dict[str, Any]] = []
    one: list[dict[str, Any]] = []
    for r in range(args.rounds):  # interleave to share the machine's noise between all runs
        for th in threads:
            base[th].append(engine_bench(block, batch, th, args.duration))
        best.append(max(base[th][-1] for th in threads))
        ours.append(kvlink_bench(block, batch, args.per_post, args.depth, args.duration))
        # same concurrency as the engine bench with 1 thread: one batch in flight
        one.append(kvlink_bench(block, batch, args.per_post, args.depth, args.duration,
                                max_inflight=batch))
        print(f"round {r}: transfer_engine_bench "
              + " ".join(f"t{th} {base[th][-1]:.3f}" for th in threads)
              + f" GB/s   kvlink mooncake {ours[-1]['gbps']:.3f} GB/s"
              f" (one batch in flight: {one[-1]['gbps']:.3f})", flush=True)
    b = statistics.median(best)
    k = statistics.median(o["gbps"] for o in ours)
    b1 = statistics.median(base[threads[0]])
    k1 = statistics.median(o["gbps"] for o in one)
    verified = all(o["verified"] for o in ours + one)
    print(f"median: transfer_engine_bench (best of threads {args.threads}) {b:.3f} GB/s   "
          f"kvlink mooncake {k:.3f} GB/s   ratio {k / b:.2f}   verified "
          f"{'yes' if verified else 'NO'}")
    print(f"equal concurrency: transfer_engine_bench t{threads[0]} {b1:.3f} GB/s   kvlink with "
          f"one batch in flight {k1:.3f} GB/s   ratio {k1 / b1:.2f}")
    write_result("mooncake", {
        "protocol": "tcp", "metadata": "P2PHANDSHAKE", "operation": "write",
        "host": "127.0.0.1", "block_bytes": block, "batch_size": batch,
        "engine_bench_threads": threads, "kvlink_extents_per_post": args.per_post,
        "kvlink_posts_outstanding": args.depth, "kvlink_max_inflight_per_peer": 1024,
        "duration_s": args.duration, "rounds": args.rounds,
        "baseline_gbps_by_threads": {str(th): v for th, v in base.items()},
        "baseline_gbps_best_per_round": best,
        "kvlink_gbps": [o["gbps"] for o in ours],
        "kvlink_one_batch_inflight_gbps": [o["gbps"] for o in one],
        "kvlink_runs": ours, "kvlink_one_batch_inflight_runs": one,
        "baseline_gbps_median": b, "kvlink_gbps_median": k, "ratio": k / b,
        "equal_concurrency": {"baseline_threads": threads[0], "baseline_gbps_median": b1,
                              "kvlink_gbps_median": k1, "ratio": k1 / b1},
        "goal": 0.9, "verified": verified,
    }, args.json)


if __name__ == "__main__":
    main()
