"""Soak: many requests of random sizes between two processes, every byte checked, memory tracked.

    .venv/bin/python bench/soak.py [--requests 10000] [--transport tcp]

The producer runs in a child process; the consumer pulls request after request (random block
counts, random non-contiguous ids on both sides), verifies each against the deterministic
pattern, and samples both processes' RSS. Flat memory = RSS growth from 10 % to 100 % of the run
within a few MiB; the baseline is the RSS at 10 %, measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from typing import Any

import numpy as np
from _common import write_result

from kvlink.demo import data
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=2, kv_heads=8, head_dim=128, block_size=16)
BLOCKS = 2048


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def producer(q: Any, holds: Any, stop: Any, transport: str) -> None:
    _buf, layers = data.allocate(GEO, BLOCKS, 1, 0)
    data.fill(GEO, layers, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="soak-p", transports=[transport]))
    w.register(data.spec_of(GEO, layers, 1, 0))
    q.put(w.side_port)
    released = 0
    while not stop.is_set():
        try:  # the requests to hold for the consumer, as a prefill scheduler would
            req_id, ids = holds.get(timeout=0.001)
            w.hold(req_id, ids)
        except queue.Empty:
            pass
        released += len(w.released())  # drained, as a scheduler would
    q.put(released)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--max-blocks", type=int, default=32)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, holds, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=producer, args=(q, holds, stop, args.transport))
    proc.start()
    port = q.get(timeout=120)
    _buf, layers = data.allocate(GEO, BLOCKS, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="soak-d", transports=[args.transport], serve=False))
    w.register(data.spec_of(GEO, layers, 1, 0))
    remote = RemoteEngine("soak-p", "127.0.0.1", port)
    rng = np.random.default_rng(0)
    samples: list[dict[str, float]] = []
    bad = failed = moved = 0
    t0 = time.perf_counter()
    for i in range(args.requests):
        n = int(rng.integers(1, args.max_blocks + 1))
        rids = rng.choice(BLOCKS, n, replace=False)
        lids = rng.choice(BLOCKS, n, replace=False)
        holds.put((f"s{i}", rids))
        w.read(f"s{i}", remote, lids, rids)
        while True:
            done, fails = w.poll()
            if done or fails:
                break
        if fails:
            failed += 1
            continue
        moved += n * GEO.block_bytes(1)
        bad += data.verify(GEO, layers, 1, 0, lids.astype(np.int64), rids.astype(np.int64)) != 0
        if (i + 1) % max(1, args.requests // 20) == 0:
            samples.append({"request": i + 1, "consumer_rss_mib": rss_mib(),
                            "producer_rss_mib": rss_mib(proc.pid or 0),
                            "seconds": time.perf_counter() - t0})
            print(f"  {i + 1}/{args.requests}  rss consumer {samples[-1]['consumer_rss_mib']:.0f}"
                  f" MiB producer {samples[-1]['producer_rss_mib']:.0f} MiB  bad {bad} "
                  f"failed {failed}", flush=True)
    secs = time.perf_counter() - t0
    w.close()
    stop.set()
    notes = q.get(timeout=30)
    proc.join(30)
    ref = samples[max(0, len(samples) // 10 - 1)]
    growth = {k: samples[-1][k] - ref[k] for k in ("consumer_rss_mib", "producer_rss_mib")}
    print(f"{args.requests} requests, {moved / 1e9:.1f} GB, {secs:.0f}s, bad {bad}, failed "
          f"{failed}, released {notes}, RSS growth after 10%: {growth}")
    write_result("soak", {"requests": args.requests, "transport": args.transport,
                          "bytes": moved, "seconds": secs, "mismatched_requests": bad,
                          "failed_requests": failed, "producer_released": notes,
                          "rss_samples": samples, "rss_growth_after_10pct_mib": growth},
                 args.json)
    raise SystemExit(1 if bad or failed else 0)


if __name__ == "__main__":
    main()
