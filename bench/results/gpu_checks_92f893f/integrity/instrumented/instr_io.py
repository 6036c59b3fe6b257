"""bench/integrity_overhead.py with per-request timers of read() and poll() by level (experiment)."""
import collections, os, runpy, sys, time, atexit
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
from kvlink.worker import engine
KV = engine.KVWorker
R = collections.defaultdict(lambda: collections.defaultdict(list))
cur = {}
orig_read, orig_poll = KV.read, KV.poll
def read(self, req_id, *a, **k):
    t = time.perf_counter(); r = orig_read(self, req_id, *a, **k); t1 = time.perf_counter()
    cur[req_id] = [str(self.integrity.level.value), t, t1 - t, 0, 0.0, 0.0]
    return r
def poll(self):
    t = time.perf_counter(); done, failed = orig_poll(self); dt = time.perf_counter() - t
    for rec in cur.values():
        rec[3] += 1; rec[4] += dt
    for rid in list(done):
        rec = cur.pop(rid, None)
        if rec is not None and "-warm" not in rid and "fault" not in rid:
            lv = rec[0]; R[lv]["read"].append(rec[2]); R[lv]["polls"].append(rec[3])
            R[lv]["poll_sum"].append(rec[4]); R[lv]["last_poll"].append(dt)
            R[lv]["total_to_last_poll_end"].append(time.perf_counter() - rec[1])
    return done, failed
KV.read, KV.poll = read, poll
@atexit.register
def show():
    import numpy as np
    for lv, d in R.items():
        print(lv, "  ".join(f"{k} {np.median(v)*(1 if k=='polls' else 1e3):.3f}" for k, v in d.items()), "n", len(d["read"]))
sys.argv = ["integrity_overhead.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "bench/integrity_overhead.py"), run_name="__main__")
