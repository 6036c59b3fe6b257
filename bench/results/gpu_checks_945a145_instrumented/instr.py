"""Run bench/e2e_request.py with timers around the decode's poll pieces (experiment only)."""
import collections, os, runpy, sys, time, atexit
root = os.environ.get("KVROOT", os.getcwd())
sys.path[:0] = [root, os.path.join(os.getcwd(), "bench")]
from kvlink import channel
from kvlink.worker import parts, engine, requests, peering
T = collections.defaultdict(list)
def wrap(cls, name, key):
    if name not in cls.__dict__ and not hasattr(cls, name):
        return
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[key].append(time.perf_counter() - t)
        return r
    if isinstance(cls.__dict__.get(name), staticmethod):
        g = staticmethod(g)
    setattr(cls, name, g)
wrap(channel.Channels, "flush", "chan.flush")
wrap(channel._TcpPipe, "put", "pipe.put")
wrap(parts._Parts, "_board_still_shows", "board_still_shows")
wrap(parts._Parts, "_progress", "_progress")
wrap(parts._Parts, "_post", "_post")
wrap(parts._Parts, "_read_done", "_read_done")
wrap(peering._Peering if hasattr(peering, "_Peering") else parts._Parts, "_tell", "_tell")
wrap(requests._Requests if hasattr(requests, "_Requests") else parts._Parts, "_report", "_report")
wrap(requests._Requests if hasattr(requests, "_Requests") else parts._Parts, "release", "release")
wrap(engine.KVWorker, "poll", "poll")
wrap(engine.KVWorker, "read", "read")
wrap(engine.KVWorker, "write", "write")
if os.environ.get("PYFLOCK"):
    import ctypes
    from kvlink import holdboard
    _fl = ctypes.PyDLL(None).flock
    def alive(self):
        return self._fd >= 0 and _fl(self._fd, 5) != 0  # LOCK_SH|LOCK_NB, GIL held
    holdboard.BoardView.alive = alive
@atexit.register
def show():
    import numpy as np
    import threading
    print("instrumented:", root, "threads:", [t.name for t in threading.enumerate()])
    for k, v in sorted(T.items()):
        v = np.array(v) * 1e6
        print(f"  {k:18s} n={len(v):5d} p50={np.median(v):8.1f}us p90={np.percentile(v,90):8.1f}us sum/n={v.mean():8.1f}")
sys.argv = ["e2e_request.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "bench/e2e_request.py"), run_name="__main__")
