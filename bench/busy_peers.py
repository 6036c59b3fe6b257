"""A tcp READ through KVWorker while the decode's or the prefill's own Python is busy.

    .venv/bin/python bench/busy_peers.py [--requests 30] [--slice-ms 2] [--prefill-loop word]
                                         [--decode-loop python] [--out PATH]

Two processes on 127.0.0.1: a prefill holding 16-block requests (the 70B TP8-rank geometry of
bench/e2e_request.py: 80 layers, 1 KV head, 10 MiB) and this process, the decode, which
``read(..., generation)``\\ s one and polls until it is reported finished. Three modes, request
by request in turn: ``idle`` (both processes wait between steps: the decode sleeps 0.2 ms
between polls, the prefill waits on its queue) — the baseline; ``decode_busy`` (between polls
the decode runs ``--slice-ms`` of Python: a serving loop's forward); ``prefill_busy`` (the
prefill's main thread runs Python while the READ is served, giving the GIL up nowhere). tcp's
threads are Python threads, so each time one comes back from a socket call it waits for the
GIL, up to a switch interval (5 ms) where its process's own Python is busy. Reports the
median read -> reported time of each mode and its ratio to ``idle``, and the p90 and longest.

``--prefill-loop queue``: the busy prefill looks at its command queue between slices instead
of a shared word — ``Queue.empty()`` gives the GIL up and takes it back each time, the shape
of a loop of many short calls that release it (torch ops do): a thread waiting for the GIL
can starve there for seconds (a convoy, bench/results/tcp_busy_peers/README.md).
``--decode-loop queue``: the same for the decode, between its slices of Python.

``--op push``: the decode asks the prefill to push each request (``expect_push``) and polls
until it is reported; the prefill takes push requests and posts their WRITEs between its
slices (a prefill's step loop). The decode's tcp thread takes the bytes and the notification
that ends the push — so ``decode_busy`` is where a busy process's own Python meets tcp's
serving thread here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time
from typing import Any

import numpy as np
from _common import write_result

from kvlink.demo import data
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=80, kv_heads=1, head_dim=128, block_size=16)
BLOCKS, NB = 16, 64


def _rank(engine: str, seed: int, **config: Any) -> tuple[KVWorker, Any]:
    buf, layers = data.allocate(GEO, NB, 1, 0)
    buf[:] = np.random.default_rng(seed).integers(1, 2**16, buf.shape, dtype=np.uint16)
    w = KVWorker(WorkerConfig(engine_id=engine, transports=["tcp"], **config))
    w.register(data.spec_of(GEO, layers, 1, 0))
    return w, (buf, layers)


def _push_asked(w: KVWorker) -> None:
    """Post a WRITE for every push asked of us (of the request's first BLOCKS blocks)."""
    for msg in w.push_requests():
        w.push(msg, list(range(BLOCKS)))
    w.poll()


def _prefill(q: Any, cmd: Any, busy: Any, slice_s: float, loop: str, push: bool) -> None:
    """Hold each asked request (``push``: push each one asked for); while ``busy`` (a shared
    word the decode sets) run Python in ``slice_s`` slices, looking between them at the word
    — a read of shared memory, which gives the GIL up nowhere — and (``loop`` "queue") at the
    command queue, which gives it up and takes it back (``push``: and posting pushes asked)."""
    w, keep = _rank("p", 1, serve_pushes=push)
    q.put(("port", w.side_port, np.asarray(keep[1][0])[:, :BLOCKS].tobytes()))
    while True:
        while busy.value:
            end = time.perf_counter() + slice_s
            while time.perf_counter() < end:
                pass  # a forward's Python
            if loop == "queue":
                cmd.empty()
            if push:
                _push_asked(w)
        if push:
            _push_asked(w)
        try:
            c = cmd.get(timeout=0.0002 if push else 0.001)
        except queue.Empty:
            continue
        if c is None:
            break
        q.put(("held", w.hold(c, list(range(BLOCKS))),
               np.asarray(keep[1][0])[:, :BLOCKS].tobytes()))
        w.released()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--slice-ms", type=float, default=2.0)
    ap.add_argument("--prefill-loop", choices=("word", "queue"), default="word",
                    help="what the busy prefill looks at between slices (queue: a GIL convoy)")
    ap.add_argument("--decode-loop", choices=("python", "queue"), default="python",
                    help="what the busy decode does between slices besides polling (queue: "
                         "looks at a queue, a GIL convoy)")
    ap.add_argument("--op", choices=("read", "push"), default="read",
                    help="read: the decode READs each request; push: the prefill WRITEs it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    push = args.op == "push"
    slice_s = args.slice_ms / 1000
    ctx = mp.get_context("spawn")
    q, cmd, busy = ctx.Queue(), ctx.Queue(), ctx.RawValue("i", 0)
    child = ctx.Process(target=_prefill, args=(q, cmd, busy, slice_s, args.prefill_loop,
                                               push), daemon=True)
    child.start()
    _, port, pushed = q.get(timeout=60)
    far = RemoteEngine("p", "127.0.0.1", port)
    w, keep = _rank("d", 2)
    rng = np.random.default_rng(0)
    modes = ("idle", "decode_busy", "prefill_busy")
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for i in range(args.requests + 2):  # (the first two: the connection, the route)
            for mode in modes:
                rid = f"{mode}-{i}"
                if not push:
                    cmd.put(rid)
                    _, gen, want = q.get(timeout=60)
                busy.value = mode == "prefill_busy"
                if busy.value:
                    time.sleep(0.002)  # (its loop under way: the request lands in it)
                ours = rng.permutation(NB)[:BLOCKS]
                t0 = time.perf_counter()
                if push:
                    want = pushed
                    w.expect_push(rid, far, ours, timeout=30)
                else:
                    w.read(rid, far, ours, list(range(BLOCKS)), generation=gen)
                while True:
                    done, failed = w.poll()
                    if rid in done or rid in failed:
                        break
                    if mode == "decode_busy":
                        end = time.perf_counter() + slice_s
                        while time.perf_counter() < end:
                            pass  # the decode's own Python between two polls
                        if args.decode_loop == "queue":
                            q.empty()
                    else:
                        time.sleep(0.0002)
                took = time.perf_counter() - t0
                busy.value = 0
                assert rid in done, failed
                got = np.asarray(keep[1][0])[:, ours].tobytes()
                assert got == want, f"{rid}: wrong bytes in layer 0"
                if i >= 2:
                    times[mode].append(took)
    finally:
        cmd.put(None)
        child.join(10)
        w.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    p90 = {m: float(np.percentile(v, 90)) for m, v in times.items()}
    for m in modes:
        print(f"{m:>13}: {med[m] * 1e3:7.2f} ms (median of {len(times[m])}), "
              f"{med[m] / med['idle']:.2f}x idle; p90 {p90[m] * 1e3:.2f} ms, longest "
              f"{max(times[m]) * 1e3:.2f} ms", flush=True)
    write_result("busy_peers", {
        "op": args.op, "requests": args.requests, "slice_ms": args.slice_ms,
        "prefill_loop": args.prefill_loop,
        "decode_loop": args.decode_loop,
        "bytes": BLOCKS * GEO.layers * 2 * GEO.block_size * GEO.head_dim * 2, "median_s": med,
        "p90_s": p90, "max_s": {m: max(v) for m, v in times.items()},
        "over_idle": {m: med[m] / med["idle"] for m in modes}, "samples_s": times}, args.out)


if __name__ == "__main__":
    main()
