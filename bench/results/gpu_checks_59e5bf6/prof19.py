"""Experiment only: bench/e2e_request.py with a timer around every method of the decode's
request path (inclusive times, a call's own wrapper cost included), printed per method at exit,
plus one request's timeline (spin mode) from read() to the poll that finished it."""
import atexit, collections, inspect, os, runpy, sys, time
root = os.environ.get("KVROOT", os.getcwd())
sys.path[:0] = [root, os.path.join(os.getcwd(), "bench")]
import numpy as np
from kvlink import channel, holdboard, plan as kplan
from kvlink.worker import engine, parts, peering, requests
T = collections.defaultdict(list)
TL = []  # (t, what)
ON = [False]
def wrap(cls, name):
    raw = cls.__dict__[name]
    if isinstance(raw, (staticmethod, classmethod, property)) or not callable(raw):
        return
    key = f"{cls.__name__}.{name}"
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return raw(*a, **k)
        finally:
            d = time.perf_counter() - t
            T[key].append(d)
            if ON[0]:
                TL.append((t, d, key))
    setattr(cls, name, g)
def wrap_all(cls, skip=()):
    for name in list(cls.__dict__):
        if name in skip or (name.startswith("__") and name != "__call__"):
            continue
        wrap(cls, name)
classes = [engine.KVWorker, channel.Channels, holdboard.AfterCheck, holdboard.BoardView]
for mod in (parts, peering, requests):
    for n, c in vars(mod).items():
        if inspect.isclass(c) and c.__module__ == mod.__name__ and n.startswith("_") and not n.startswith("__"):
            classes.append(c)
try:
    from kvlink_transports import cuda_ipc
    from kvlink.gpu import copy as gcopy, move as gmove
    classes += [cuda_ipc.CudaIpcTransport, gcopy.BatchCopier, gcopy.Pending, gmove.CudaMove, gmove.StreamOrder]
except Exception as e:
    print("no gpu classes", e)
classes.append(kplan.PlanTable)
from kvlink import layout, wire as kwire
classes.append(layout.KVCacheSpec)
def wrapf(mod, name):
    f = getattr(mod, name, None)
    if f is None: return
    key = f"{mod.__name__.split('.')[-1]}.{name}"
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally:
            d = time.perf_counter() - t; T[key].append(d)
            if ON[0]: TL.append((t, d, key))
    setattr(mod, name, g)
for mod in (requests, parts, engine, peering):
    for name in ("map_heads", "fingerprint", "board_rows", "read_ticket", "push_ticket"):
        wrapf(mod, name)
    if hasattr(mod, "wire"):
        pass
wrapf(kwire, "check_id"); wrapf(kwire, "encode")
seen = set()
for c in classes:
    if c in seen: continue
    seen.add(c)
    try: wrap_all(c, skip=("__init__",))
    except Exception as e: print("skip", c, e)
# timeline of the 20th spin request: switch on around KVWorker.read calls
orig_read = engine.KVWorker.read
count = [0]
def read(self, *a, **k):
    count[0] += 1
    ON[0] = count[0] in tuple(int(x) for x in os.environ.get("TLREQ", "45,47").split(","))
    if ON[0]: TL.append((time.perf_counter(), 0.0, "== read start"))
    return orig_read(self, *a, **k)
engine.KVWorker.read = read
orig_poll = engine.KVWorker.poll
def poll(self):
    r = orig_poll(self)
    if ON[0] and r[0]:
        TL.append((time.perf_counter(), 0.0, f"== finished {sorted(r[0])}"))
        ON[0] = False
    return r
engine.KVWorker.poll = poll
@atexit.register
def show():
    print(f"instrumented tree {root}")
    rows = sorted(T.items(), key=lambda kv: -np.sum(kv[1]))
    for k, v in rows[:70]:
        us = np.array(v) * 1e6
        print(f"  {k:42s} n={len(us):6d} p50={np.median(us):8.1f}us p90={np.percentile(us, 90):8.1f}us mean={us.mean():8.1f}")
    if TL:
        t0 = TL[0][0]
        print("timeline (start us, dur us, call), nested calls listed at their start:")
        for t, d, k in sorted(TL):
            print(f"  {1e6*(t-t0):9.1f} {1e6*d:8.1f} {k}")
sys.argv = ["e2e_request.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.getcwd(), "bench/e2e_request.py"), run_name="__main__")
