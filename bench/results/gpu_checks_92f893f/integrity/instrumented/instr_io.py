"""bench/integrity_overhead.py with per-request timers of read() and poll() by level (an
experiment; README.md here). Run from the repo root: python3 instr_io.py ARGS..."""

import atexit
import collections
import os
import runpy
import sys
import time
from typing import Any

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
from kvlink.worker import engine  # noqa: E402

KV = engine.KVWorker
Series = dict[str, list[float]]
R: dict[str, Series] = collections.defaultdict(lambda: collections.defaultdict(list))
cur: dict[str, list[Any]] = {}
orig_read, orig_poll = KV.read, KV.poll


def read(self, req_id, *a, **k):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    r = orig_read(self, req_id, *a, **k)
    cur[req_id] = [str(self.integrity.level.value), t, time.perf_counter() - t, 0, 0.0]
    return r


def poll(self):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    done, failed = orig_poll(self)
    dt = time.perf_counter() - t
    for rec in cur.values():
        rec[3] += 1
        rec[4] += dt
    for rid in list(done):
        rec = cur.pop(rid, [])
        if rec and "-warm" not in rid and "fault" not in rid:
            d = R[rec[0]]
            d["read"].append(rec[2])
            d["polls"].append(rec[3])
            d["poll_sum"].append(rec[4])
            d["last_poll"].append(dt)
            d["total_to_last_poll_end"].append(time.perf_counter() - rec[1])
    return done, failed


KV.read, KV.poll = read, poll  # type: ignore[method-assign]


@atexit.register
def show() -> None:
    import numpy as np

    for lv, d in R.items():
        cols = (f"{k} {np.median(v) * (1 if k == 'polls' else 1e3):.3f}" for k, v in d.items())
        print(lv, "  ".join(cols), "n", len(d["read"]))


sys.argv = ["integrity_overhead.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.getcwd(), "bench/integrity_overhead.py"), run_name="__main__")
