"""Where the batched device copy's end-to-end time goes, and two changes to it, in one process.

    python scripts/gpu_copy_pinned_probe.py [--out DIR] [--reps N]

For the cuda_ipc acceptance shapes, a BatchCopier.copy timed end to end (post -> completion
event seen by a polling host) against a device copy of the same bytes in the same run, with the
extent records (1) in ordinary (pageable) memory, copied to pinned memory in pieces by the post,
and (2) built in pinned memory by the caller (``host_extents``, what the worker's planner does
for cuda_ipc), read in place by one launch. Every byte verified. Also the copy kernel alone
with unrolled inner loops (two or four 16-byte vectors per thread in flight per step), for
long extents, against the same device copy. Writes gpu_copy_pinned_probe.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

_LOOP = (
    "        for i in range(0, full, BLOCK):  # unmasked: plain 16-byte vector loads and stores\n"
    "            o = start + i + tl.arange(0, BLOCK)\n"
    '            tl.store(d + o, tl.load(s + o, cache_modifier=".cg"), cache_modifier=".cs")\n'
)


def _unrolled(k: int) -> str:
    loads = "".join(f"            x{j} = tl.load(s + o + {j} * BLOCK, cache_modifier=\".cg\")\n"
                    for j in range(k))
    stores = "".join(f"            tl.store(d + o + {j} * BLOCK, x{j}, cache_modifier=\".cs\")\n"
                     for j in range(k))
    return (f"        fullk = todo // ({k} * BLOCK) * ({k} * BLOCK)\n"
            f"        for i in range(0, fullk, {k} * BLOCK):\n"
            "            o = start + i + tl.arange(0, BLOCK)\n" + loads + stores +
            "        for i in range(fullk, full, BLOCK):\n"
            "            o = start + i + tl.arange(0, BLOCK)\n"
            "            tl.store(d + o, tl.load(s + o, cache_modifier=\".cg\"), "
            "cache_modifier=\".cs\")\n")


def _variant(k: int) -> Any:
    def edit(src: str) -> str:
        assert _LOOP in src, "kernel loop changed: update the probe"
        return src.replace(_LOOP, _unrolled(k))

    return _gpu_common.kernel_variant(edit, f"kvk_unroll{k}")


def _settle(mode: str) -> None:
    """Wait for the device: "sync" (the thread may sleep) or "spin" on an event (stays hot)."""
    import torch

    if mode == "sync":
        torch.cuda.synchronize()
        return
    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        pass


def _breakdown(cp: Any, pinned: Any, pageable: Any, smap: Any, dmap: Any, stream: Any,
               dst: Any) -> dict[str, list[list[Any]]]:
    """Host timestamps (us from the start of copy()) at the steps of a few posts."""
    import torch

    from kvlink_transports import _gpucopy

    marks: list[Any] = []

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            marks.append((name, time.perf_counter_ns()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((name + "_end", time.perf_counter_ns()))
        return wrapper

    orig = _gpucopy._pinned_address
    _gpucopy._pinned_address = timed("pinned_address", orig)
    for attr in ("_take", "_plan", "_launch", "_enqueue"):
        setattr(cp, attr, timed(attr, getattr(cp, attr)))
    out: dict[str, list[list[Any]]] = {}
    try:
        for kind, (s_e, d_e) in (("pinned", pinned), ("pageable", pageable)):
            lines = []
            for _ in range(5):
                dst.zero_()
                torch.cuda.synchronize()
                marks.clear()
                _, t0, t1, t2 = _gpu_common.timed_post(cp, s_e, smap, d_e, dmap, stream)
                lines.append([[n, round((t - t0) / 1e3, 1)] for n, t in marks]
                             + [["return", round((t1 - t0) / 1e3, 1)],
                                ["done", round((t2 - t0) / 1e3, 1)]])
            out[kind] = lines
    finally:
        _gpucopy._pinned_address = orig
        for attr in ("_take", "_plan", "_launch", "_enqueue"):
            delattr(cp, attr)
    return out


def _host_ops(reps: int) -> dict[str, float]:
    """Host cost of each step of a pinned post, alone (median of ``reps`` loops of 500)."""
    import ctypes

    import torch

    from kvlink_transports import _gpucopy
    from kvlink_transports._gpucopy import BatchCopier, RegionMap

    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    cp = BatchCopier(dev, kernel="triton")
    ext = cp.host_extents(20480)
    buf = torch.empty(1 << 20, dtype=torch.int64, device=dev)
    ext["addr"], ext["len"] = buf.data_ptr(), 64
    one = cp.host_extents(1)
    one[:] = ext[:1]
    anywhere = RegionMap.anywhere(dev)
    root: Any = ext
    while isinstance(root, np.ndarray):
        root = root.base
    ev = torch.cuda.Event()
    ev.record(stream)
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuEventQuery.argtypes = [ctypes.c_void_p]
    evh, sh = ev.cuda_event, stream.cuda_stream

    def take() -> None:
        b = cp._take(8)
        cp._pinned[b.tensor.shape[0]].append(b)

    def copy_one() -> None:
        cp.copy(one, anywhere, one, anywhere, stream)

    ops: dict[str, Any] = {
        "is_pinned": root.is_pinned,
        "pinned_address": lambda: _gpucopy._pinned_address(ext),
        "ctypes_data": lambda: ext.ctypes.data,
        "array_interface": lambda: ext.__array_interface__["data"][0],
        "first_len": lambda: int(ext[0]["len"]),
        "current_device": torch.cuda.current_device,
        "take_status": take,
        "torch_event_record": lambda: ev.record(stream),
        "driver_event_record": lambda: lib.cuEventRecord(evh, sh),
        "torch_event_query": ev.query,
        "driver_event_query": lambda: lib.cuEventQuery(evh),
        "len_sum_20480": lambda: int(ext["len"].sum()),
        "copy_1_pinned": copy_one,
    }
    out = {}
    for name, fn in ops.items():
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            ts.append((time.perf_counter() - t0) / 500 * 1e6)
            torch.cuda.synchronize()
        out[name] = statistics.median(ts)
    return out


def main() -> None:
    import torch

    from kvlink.transport import make_extents
    from kvlink_transports._gpucopy import BatchCopier, launch_shape

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--wait", choices=["spin", "sync"], default="sync")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.current_stream(dev)
    res: dict[str, Any] = {"cases": {}}
    rng = np.random.default_rng(0)
    variants = {k: _variant(k) for k in (2, 4)}
    for name, c in _gpu_common.CASES.items():
        case = _gpu_common.make_case(c, rng, dev)
        ext, count, src, dst, smap, dmap = (case.ext, case.count, case.src, case.dst, case.smap,
                                           case.dmap)
        sa, da = case.addresses()
        sext, dext = make_extents(sa, ext), make_extents(da, ext)
        cp = BatchCopier(dev, kernel="triton")
        psext, pdext = cp.host_extents(count), cp.host_extents(count)
        psext[:], pdext[:] = sext, dext
        nbytes = ext * count
        a = torch.empty(nbytes // 8, dtype=torch.int64, device=dev).random_()
        b = torch.empty_like(a)
        row: dict[str, Any] = {"bytes": nbytes, "extents": count}
        copy_s = []
        for _ in range(args.reps + 1):
            _settle(args.wait)
            t0 = time.perf_counter()
            b.copy_(a)
            _settle(args.wait)
            copy_s.append(time.perf_counter() - t0)
        base = statistics.median(copy_s[1:])
        row["device_copy_s"] = base
        row["device_copy_kernel_us"] = _gpu_common.event_us(functools.partial(b.copy_, a),
                                                            args.reps)
        del a, b
        # end to end, the two record placements alternating so drift hits both alike
        samples: dict[str, dict[str, list[float]]] = {
            k: {"post": [], "e2e": []} for k in ("pageable", "pinned")}
        for rep in range(args.reps + 1):
            for kind, (s_e, d_e) in (("pageable", (sext, dext)), ("pinned", (psext, pdext))):
                dst.zero_()
                _settle(args.wait)
                p, t0, t1, t2 = _gpu_common.timed_post(cp, s_e, smap, d_e, dmap, stream)
                if rep:
                    samples[kind]["post"].append((t1 - t0) / 1e9)
                    samples[kind]["e2e"].append((t2 - t0) / 1e9)
                ok = not p.failed() and case.verified()
                row[f"{kind}_verified"] = row.get(f"{kind}_verified", True) and ok
        for kind, sm in samples.items():
            e2e = statistics.median(sm["e2e"])
            row[f"{kind}_post_s"] = statistics.median(sm["post"])
            row[f"{kind}_end_to_end_s"] = e2e
            row[f"{kind}_end_to_end_all_s"] = sm["e2e"]
            row[f"{kind}_ratio_to_device_copy"] = base / e2e
        # the kernel alone (records pinned), as shipped and with unrolled loops
        shape, g = launch_shape(count, ext, cp.chunk, cp.min_programs, cp.small, cp.large)
        rows, block, warps = shape
        sp, dp = int(psext.ctypes.data), int(pdext.ctypes.data)
        status = cp.host_extents(1)
        kargs = (sp, dp, count, smap.ptr, 1, dmap.ptr, 1, int(status.ctypes.data), 99, g)
        grid = (-(-count // rows), g)
        from kvlink_transports import _gpukernels

        mods = {"shipped": _gpukernels, **{f"unroll{k}": m for k, m in variants.items()}}
        for label, mod in ({} if args.skip_kernels else mods).items():
            for blk, w in ((block, warps), (block // 2, warps)) if ext > (64 << 10) else (
                    (block, warps),):
                def run(mod: Any = mod, blk: int = blk, w: int = w, grid: Any = grid,
                        kargs: Any = kargs, rows: int = rows) -> None:
                    mod.move[grid](*kargs, E=rows, BLOCK=blk, num_warps=w)
                dst.zero_()
                us = _gpu_common.event_us(run, args.reps)
                ok = case.verified()
                key = f"kernel_{label}_b{blk}_w{w}"
                row[key + "_us"] = us
                row[key + "_ratio_to_device_copy"] = row["device_copy_kernel_us"] / us
                row[key + "_verified"] = ok
                print(name, key, round(us, 1), ok, flush=True)
        row["post_breakdown_us"] = _breakdown(cp, (psext, pdext), (sext, dext), smap, dmap,
                                              stream, dst)
        print(name, "post breakdown", row["post_breakdown_us"], flush=True)
        res["cases"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if not k.endswith("all_s")},
                               indent=1), flush=True)
        del src, dst, case
        torch.cuda.empty_cache()
    res["wait"] = args.wait
    res["host_ops_us"] = _host_ops(args.reps)
    print("host ops us", json.dumps(res["host_ops_us"], indent=1), flush=True)
    _gpu_common.write(args.out, "gpu_copy_pinned_probe.json", res)


if __name__ == "__main__":
    main()
