"""Does the driver's batched memcpy (cuMemcpyBatchAsync, CUDA >= 12.8) beat the copy kernel for
long extents? One process, the cuda_ipc acceptance shapes, bytes verified.

    python scripts/gpu_memcpy_batch_probe.py [--out DIR]

For each case: a device copy of the same bytes (baseline), BatchCopier.copy with pinned records
(the shipped kernel), and one cuMemcpyBatchAsync call, each timed end to end (call -> event seen
by the polling host, host woken by torch.cuda.synchronize() before each rep), as ratios of the
baseline. Writes gpu_memcpy_batch_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc),
                ("flags", ctypes.c_uint)]


def _header() -> str:
    for path in ("/usr/local/cuda/include/cuda.h", "/usr/include/cuda.h"):
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            hits = [m.group(0) for m in re.finditer(
                r"(?:#define\s+cuMemcpyBatchAsync\s+\w+|CUresult CUDAAPI cuMemcpyBatchAsync\w*"
                r"\([^;]*;)", text)]
            return "\n".join(hits)
    return "no cuda.h"


def main() -> None:
    import torch

    from kvlink.transport import make_extents
    from kvlink_transports._gpucopy import BatchCopier

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    header = _header()
    print(header, flush=True)
    lib = ctypes.CDLL("libcuda.so.1")
    v2 = "cuMemcpyBatchAsync_v2" in header or "failIdx" not in header
    name = "cuMemcpyBatchAsync_v2" if v2 and hasattr(lib, "cuMemcpyBatchAsync_v2") else \
        "cuMemcpyBatchAsync"
    fn = getattr(lib, name)
    p = ctypes.c_void_p
    fn.argtypes = ([p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p]
                   if name.endswith("_v2") else
                   [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p, p])
    fn.restype = ctypes.c_int
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)  # the batch call refuses the legacy default stream
    attrs = _Attrs(1, _Loc(1, 0), _Loc(1, 0), 0)
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    res: dict[str, Any] = {"header": header, "symbol": name, "cases": {}}
    rng = np.random.default_rng(0)
    def run_case(case: str, c: dict[str, int]) -> None:
        k = _gpu_common.make_case(c, rng, dev)
        ext, count, dst, smap, dmap = k.ext, k.count, k.dst, k.smap, k.dmap
        sa, da = k.addresses()
        cp = BatchCopier(dev, kernel="triton")
        ps, pd = cp.host_extents(count), cp.host_extents(count)
        ps[:], pd[:] = make_extents(sa, ext), make_extents(da, ext)
        sizes = np.full(count, ext, dtype=np.uint64)
        a = torch.empty(ext * count // 8, dtype=torch.int64, device=dev).random_()
        b = torch.empty_like(a)
        ev = torch.cuda.Event()

        def batch() -> int:
            args: list[Any] = [da.ctypes.data, sa.ctypes.data, sizes.ctypes.data, count,
                               ctypes.addressof(attrs), ctypes.addressof(idx), 1]
            if not name.endswith("_v2"):
                args.append(ctypes.addressof(fail))
            return int(fn(*args, ctypes.c_void_p(stream.cuda_stream)))

        def kernel() -> None:
            cp.copy(ps, smap, pd, dmap, stream)

        def device_copy() -> None:
            with torch.cuda.stream(stream):
                b.copy_(a)

        row: dict[str, Any] = {"bytes": ext * count, "extents": count}
        for label, fnc in (("device_copy", device_copy), ("kernel", kernel), ("batch", batch)):
            times, calls = [], []
            for _ in range(args.reps + 1):
                dst.zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                rc = fnc()
                t1 = time.perf_counter()
                ev.record(stream)
                while not ev.query():
                    pass
                times.append(time.perf_counter() - t0)
                calls.append(t1 - t0)
                if rc:
                    row[f"{label}_error"] = rc
                    break
            row[f"{label}_s"] = statistics.median(times[1:]) if len(times) > 1 else None
            row[f"{label}_call_s"] = statistics.median(calls[1:]) if len(calls) > 1 else None
            if label != "device_copy":
                row[f"{label}_verified"] = k.verified()
        for label in ("kernel", "batch"):
            if row.get(f"{label}_s"):
                row[f"{label}_ratio_to_device_copy"] = row["device_copy_s"] / row[f"{label}_s"]
        res["cases"][case] = row
        print(case, json.dumps(row), flush=True)
    for case, c in _gpu_common.CASES.items():
        run_case(case, c)
        torch.cuda.empty_cache()
    _gpu_common.write(args.out, "gpu_memcpy_batch_probe.json", res)


if __name__ == "__main__":
    main()
