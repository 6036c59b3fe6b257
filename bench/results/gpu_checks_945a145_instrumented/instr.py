"""bench/e2e_request.py with timers around the decode's poll pieces (an experiment; README.md
here). Run from the repo root: python3 instr.py ARGS... (KVROOT: the kvlink tree to import)."""

import atexit
import collections
import os
import runpy
import sys
import time

root = os.environ.get("KVROOT", os.getcwd())
sys.path[:0] = [root, os.path.join(os.getcwd(), "bench")]
from kvlink import channel  # noqa: E402
from kvlink.worker import engine, parts, peering, requests  # noqa: E402

T: dict[str, list[float]] = collections.defaultdict(list)


def wrap(cls: type, name: str, key: str) -> None:
    if not hasattr(cls, name):
        return
    f = getattr(cls, name)

    def g(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        r = f(*a, **k)
        T[key].append(time.perf_counter() - t)
        return r

    setattr(cls, name, staticmethod(g) if isinstance(cls.__dict__.get(name), staticmethod) else g)


TIMED = {
    channel.Channels: {"flush": "chan.flush"},
    channel._TcpPipe: {"put": "pipe.put"},
    parts._Parts: {name: name for name in ("_progress", "_post", "_read_done")}
    | {"_board_still_shows": "board_still_shows"},
    peering._Peering: {"_tell": "_tell"},
    requests._Requests: {"_report": "_report", "release": "release"},
    engine.KVWorker: {name: name for name in ("poll", "read", "write")},
}
for cls, names in TIMED.items():
    for name, key in names.items():
        wrap(cls, name, key)


@atexit.register
def show() -> None:
    import threading

    import numpy as np

    print("instrumented:", root, "threads:", [t.name for t in threading.enumerate()])
    for k, v in sorted(T.items()):
        us = np.array(v) * 1e6
        print(f"  {k:18s} n={len(us):5d} p50={np.median(us):8.1f}us "
              f"p90={np.percentile(us, 90):8.1f}us sum/n={us.mean():8.1f}")


sys.argv = ["e2e_request.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.getcwd(), "bench/e2e_request.py"), run_name="__main__")
