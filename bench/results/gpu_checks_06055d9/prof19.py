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
    out = os.environ.get("KVPROF_OUT")
    if out:
        import json
        calls = {k: {"n": len(v), "p50_us": float(np.median(v) * 1e6),
                     "p90_us": float(np.percentile(v, 90) * 1e6), "mean_us": float(np.mean(v) * 1e6)}
                 for k, v in T.items()}
        t0 = TL[0][0] if TL else 0.0
        line = [{"start_us": round(1e6 * (t - t0), 1), "dur_us": round(1e6 * d, 1), "call": k}
                for t, d, k in sorted(TL)]
        json.dump({"command": " ".join(sys.argv), "tree": root, "what": "inclusive wall time per "
                   "call of every method of the decode's request path (a wrapper each, its own "
                   "cost included), and the timeline of the requests named by TLREQ",
                   "calls": calls, "timeline": line}, open(out, "w"), indent=1)
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
EV = collections.defaultdict(list)
if os.environ.get("KVEV"):
    import torch
    def evwrap(cls, name, stream_arg):
        raw = cls.__dict__[name]
        def g(self, *a, **k):
            st = a[stream_arg] if stream_arg < len(a) else k["stream"]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(torch.cuda.ExternalStream(st)); r = raw(self, *a, **k); e1.record(torch.cuda.ExternalStream(st))
            EV[name].append((e0, e1))
            return r
        setattr(cls, name, g)
    evwrap(gmove.CudaMove, "launch_with_table", 5)
    evwrap(gmove.CudaMove, "launch_digest", 2)
    evwrap(gmove.CudaMove, "launch", 3)
    @atexit.register
    def evshow():
        torch.cuda.synchronize()
        for k, v in EV.items():
            us = np.array([a.elapsed_time(b) * 1e3 for a, b in v[5:]])
            if len(us):
                print(f"  device {k:24s} n={len(us)} p50={np.median(us):.1f}us p10={np.percentile(us,10):.1f} p90={np.percentile(us,90):.1f}")
script = os.environ.get("KVBENCH", "bench/e2e_request.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(os.path.join(os.getcwd(), script), run_name="__main__")
