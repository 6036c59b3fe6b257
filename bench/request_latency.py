"""One request through the public API (KVWorker.read -> poll finished) vs a plain socket.

    .venv/bin/python bench/request_latency.py [--mib 4] [--requests 200]

A producer process holds ``--requests`` requests of ``--mib`` MiB each (``KVWorker.hold``);
the consumer pulls them one at a time over tcp, polling every 0.2 ms as a serving loop would,
and times ``read()`` to finished: handshake once, then per request the read intent, the READ,
and the validate-after-read verdict. The baseline, in the same run, is a plain-socket request
of the same bytes (one ``recv_into`` stream, no framing: bench/tcp_vs_socket.py). Writes
bench/results/request_latency.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
from _common import write_result
from tcp_vs_socket import socket_rounds

from kvlink.demo import data
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=2, kv_heads=8, head_dim=128, block_size=16)  # 128 KiB blocks


def producer(q: Any, stop: Any, nblocks: int, requests: int) -> None:
    _buf, layers = data.allocate(GEO, nblocks, 1, 0)
    data.fill(GEO, layers, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="lat-p"))
    w.register(data.spec_of(GEO, layers, 1, 0))
    for i in range(requests):
        w.hold(f"r{i}", list(range(nblocks)))
    q.put(w.side_port)
    while not stop.is_set():
        w.released()
        time.sleep(0.01)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nblocks = args.mib * 2**20 // GEO.block_bytes(1)
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=producer, args=(q, stop, nblocks, args.requests + 1))
    proc.start()
    port = q.get(timeout=120)
    _buf, layers = data.allocate(GEO, nblocks, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="lat-d", serve=False))
    w.register(data.spec_of(GEO, layers, 1, 0))
    remote = RemoteEngine("lat-p", "127.0.0.1", port)
    ids = list(range(nblocks))
    times, failed = [], 0
    for i in range(args.requests + 1):  # r0 pays the handshake: not counted
        t0 = time.perf_counter()
        w.read(f"r{i}", remote, ids, ids)
        while True:
            done, bad = w.poll()
            if done or bad:
                break
            time.sleep(0.0002)
        if bad:
            failed += 1
        elif i:
            times.append(time.perf_counter() - t0)
    arr = np.asarray(ids, dtype=np.int64)
    bad_bytes = data.verify(GEO, layers, 1, 0, arr, arr)
    w.close()
    stop.set()
    proc.join(30)
    base = socket_rounds(args.mib * 2**20, 1 << 20, min(args.requests, 100))
    api, sock = statistics.median(times), statistics.median(base)
    print(f"{args.mib} MiB request: KVWorker {api * 1e3:.2f} ms, plain socket "
          f"{sock * 1e3:.2f} ms ({sock / api:.2f}x of the socket), failed {failed}")
    write_result("request_latency", {
        "mib": args.mib, "requests": len(times), "failed": failed, "mismatches": bad_bytes,
        "kvworker_median_s": api, "kvworker_p90_s": sorted(times)[int(0.9 * len(times))],
        "socket_median_s": sock, "ratio_socket_over_kvworker": sock / api}, args.out)


if __name__ == "__main__":
    main()
