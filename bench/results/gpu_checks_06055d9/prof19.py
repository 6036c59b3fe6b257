"""Experiment kept with its results (README.md here): bench/e2e_request.py (or KVBENCH's
script) with a timer around every method of the decode's request path — inclusive wall time,
each wrapper's own cost included — printed per method at exit, with the timelines of the reads
numbered in TLREQ; KVPROF_OUT: also written to that JSON; KVEV=1: CUDA events around the copy
launches (device time, printed). Run from the repo root: python3 prof19.py ARGS... (KVROOT:
the kvlink tree to import)."""

from __future__ import annotations

import atexit
import collections
import inspect
import json
import os
import runpy
import sys
import time
from typing import Any

import numpy as np

root = os.environ.get("KVROOT", os.getcwd())
sys.path[:0] = [root, os.path.join(os.getcwd(), "bench")]
from kvlink import (  # noqa: E402
    channel,
    holdboard,
    layout,
)
from kvlink import plan as kplan  # noqa: E402
from kvlink import wire as kwire  # noqa: E402
from kvlink.worker import engine, parts, peering, requests  # noqa: E402

T: dict[str, list[float]] = collections.defaultdict(list)
TL: list[tuple[float, float, str]] = []  # (start, duration, call) while ON
ON = [False]


def _timed(key: str, fn: Any) -> Any:
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            d = time.perf_counter() - t
            T[key].append(d)
            if ON[0]:
                TL.append((t, d, key))

    return g


def wrap_all(cls: type) -> None:
    for name, raw in list(vars(cls).items()):
        if name == "__init__" or (name.startswith("__") and name != "__call__"):
            continue
        if isinstance(raw, (staticmethod, classmethod, property)) or not callable(raw):
            continue
        setattr(cls, name, _timed(f"{cls.__name__}.{name}", raw))


classes: list[type] = [engine.KVWorker, channel.Channels, holdboard.AfterCheck,
                       holdboard.BoardView, kplan.PlanTable, layout.KVCacheSpec]
for mod in (parts, peering, requests):
    classes += [c for n, c in vars(mod).items() if inspect.isclass(c)
                and c.__module__ == mod.__name__ and n.startswith("_") and not n.startswith("__")]
try:
    from kvlink.gpu import copy as gcopy
    from kvlink.gpu import move as gmove
    from kvlink_transports import cuda_ipc

    classes += [cuda_ipc.CudaIpcTransport, gcopy.BatchCopier, gcopy.Pending, gmove.CudaMove,
                gmove.StreamOrder]
except Exception as exc:  # no GPU stack here
    print("no GPU classes:", exc)
for c in dict.fromkeys(classes):
    wrap_all(c)
for mod in (requests, parts, engine, peering):
    for name in ("map_heads", "fingerprint", "board_rows", "read_ticket", "push_ticket"):
        if hasattr(mod, name):
            setattr(mod, name, _timed(f"{mod.__name__.split('.')[-1]}.{name}",
                                      getattr(mod, name)))
for name in ("check_id", "encode"):
    setattr(kwire, name, _timed(f"wire.{name}", getattr(kwire, name)))

TIMELINE = {int(x) for x in os.environ.get("TLREQ", "45,47").split(",")}
_read, _poll, _count = engine.KVWorker.read, engine.KVWorker.poll, [0]


def read(self: Any, *a: Any, **k: Any) -> Any:
    _count[0] += 1
    ON[0] = _count[0] in TIMELINE
    if ON[0]:
        TL.append((time.perf_counter(), 0.0, "== read start"))
    return _read(self, *a, **k)


def poll(self: Any) -> Any:
    r = _poll(self)
    if ON[0] and r[0]:
        TL.append((time.perf_counter(), 0.0, f"== finished {sorted(r[0])}"))
        ON[0] = False
    return r


engine.KVWorker.read = read  # type: ignore[method-assign]
engine.KVWorker.poll = poll  # type: ignore[method-assign]


@atexit.register
def show() -> None:
    t0 = TL[0][0] if TL else 0.0
    line = [{"start_us": round(1e6 * (t - t0), 1), "dur_us": round(1e6 * d, 1), "call": k}
            for t, d, k in sorted(TL)]
    calls = {k: {"n": len(v), "p50_us": float(np.median(v) * 1e6),
                 "p90_us": float(np.percentile(v, 90) * 1e6), "mean_us": float(np.mean(v) * 1e6)}
             for k, v in T.items()}
    out = os.environ.get("KVPROF_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "tree": root,
                       "what": "inclusive wall time per call of every method of the decode's "
                               "request path (a wrapper each, its own cost included), and the "
                               "timeline of the reads named by TLREQ",
                       "calls": calls, "timeline": line}, f, indent=1)
    print(f"instrumented tree {root}")
    for k, c in sorted(calls.items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["n"])[:70]:
        print(f"  {k:42s} n={c['n']:6d} p50={c['p50_us']:8.1f}us p90={c['p90_us']:8.1f}us "
              f"mean={c['mean_us']:8.1f}")
    print("timeline (start us, dur us, call), nested calls listed at their start:")
    for e in line:
        print(f"  {e['start_us']:9.1f} {e['dur_us']:8.1f} {e['call']}")


if os.environ.get("KVEV"):
    import torch

    EV: dict[str, list[Any]] = collections.defaultdict(list)

    def evwrap(cls: type, name: str, stream_arg: int) -> None:
        raw = vars(cls)[name]

        def g(self: Any, *a: Any, **k: Any) -> Any:
            st = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
                a[stream_arg] if stream_arg < len(a) else k["stream"])
            e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e0.record(st)
            r = raw(self, *a, **k)
            e1.record(st)
            EV[name].append((e0, e1))
            return r

        setattr(cls, name, g)

    evwrap(gmove.CudaMove, "launch_with_table", 5)
    evwrap(gmove.CudaMove, "launch_digest", 2)
    evwrap(gmove.CudaMove, "launch", 3)

    @atexit.register
    def evshow() -> None:
        torch.cuda.synchronize()
        for k, v in EV.items():
            us = np.array([a.elapsed_time(b) * 1e3 for a, b in v[5:]])
            if len(us):
                print(f"  device {k:24s} n={len(us)} p50={np.median(us):.1f}us "
                      f"p10={np.percentile(us, 10):.1f} p90={np.percentile(us, 90):.1f}")

script = os.environ.get("KVBENCH", "bench/e2e_request.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(os.path.join(os.getcwd(), script), run_name="__main__")
