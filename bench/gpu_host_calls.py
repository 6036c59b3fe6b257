"""What the host calls of a cuda_ipc post cost on this machine, hot, one process (GPU only).

    python3 bench/gpu_host_calls.py [--out bench/results/gpu_host_calls.json]

Explains the layer below ``bench/e2e_request.py``: each driver call a post or a poll makes
(through ctypes, as kvlink.gpu.move makes them, and through torch's Event), timed 300 times in
a row after a warm-up, and the 70B TP8-rank request's ``BatchCopier.copy_runs`` (160 segments x
256 runs of 4 KiB, one run per block) — its host time, the time until a tight loop sees its
event complete, and its device time — against a device copy of the same bytes in the same run
(CUDA events on one stream). Hot figures, and each driver call again right after a sweep of
the host's caches (``driver_calls_cold``: what a request meets, docs/e2e.md), with the launch
of a kernel that does nothing by its parameters' size (8 bytes, or 12 KiB: a lane's table
class). Writes gpu_host_calls.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import sweep, write_result

SEGS, RUNS, UNIT = 160, 256, 4096


def _per_call_us(fn: Callable[[], Any], n: int = 300, cold: bool = False
                 ) -> dict[str, float]:
    xs = []
    for _ in range(n):
        if cold:  # what a request meets: the call's code and data evicted first
            sweep()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    us = np.array(xs[20:]) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90))}


#: kernels that do nothing, one taking 8 bytes of parameters, one 12 KiB (a lane's launch
#: table travels in such a class, kvlink.gpu.move.PARAM_WORDS): what the parameters' size costs
#: a launch on the host
_NOP = r"""
struct kv_words { long long w[1536]; };
extern "C" __global__ void kv_nop(long long x) {}
extern "C" __global__ void kv_nop_table(const __grid_constant__ kv_words t) {}
"""


def driver_calls(torch: Any, stream: Any, cold: bool = False) -> dict[str, dict[str, float]]:
    lib = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    for name, args in (("cuStreamQuery", [vp]),
                       ("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
                       ("cuEventRecord", [vp, vp]), ("cuEventQuery", [vp]),
                       ("cuStreamWaitEvent", [vp, vp, ctypes.c_uint]),
                       ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, ctypes.c_size_t, vp]),
                       ("cuStreamWriteValue32_v2", [vp, ctypes.c_uint64, ctypes.c_uint,
                                                    ctypes.c_uint]),
                       ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    nop = torch.cuda._compile_kernel(_NOP, "kv_nop").func
    nop_table = torch.cuda._compile_kernel(_NOP, "kv_nop_table").func
    x = ctypes.c_longlong(0)
    words = (ctypes.c_longlong * 1536)()
    small = (vp * 1)(ctypes.cast(ctypes.pointer(x), vp))
    large = (vp * 1)(ctypes.cast(ctypes.pointer(words), vp))
    word = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    raw = stream.cuda_stream
    ev = vp()
    lib.cuEventCreate(ctypes.byref(ev), 2)
    host = torch.empty(8192, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(8192, dtype=torch.uint8, device="cuda")
    tev = torch.cuda.Event()
    torch.cuda.synchronize()
    per = functools.partial(_per_call_us, cold=cold)
    got = {
        "cuStreamQuery": per(lambda: lib.cuStreamQuery(raw)),
        "cuEventRecord": per(lambda: lib.cuEventRecord(ev, raw)),
        "cuEventQuery": per(lambda: lib.cuEventQuery(ev)),
        "cuStreamWaitEvent": per(lambda: lib.cuStreamWaitEvent(raw, ev, 0)),
        "cuMemcpyHtoDAsync_8KiB": per(
            lambda: lib.cuMemcpyHtoDAsync_v2(dev.data_ptr(), host.data_ptr(), 8192, raw)),
        "cuStreamWriteValue32": per(
            lambda: lib.cuStreamWriteValue32_v2(raw, word.data_ptr(), 1, 0)),
        "cuLaunchKernel_8B_params": per(
            lambda: lib.cuLaunchKernel(nop, 1, 1, 1, 32, 1, 1, 0, raw, small, None)),
        "cuLaunchKernel_12KiB_params": per(
            lambda: lib.cuLaunchKernel(nop_table, 1, 1, 1, 32, 1, 1, 0, raw, large, None)),
        "torch_event_record": per(lambda: tev.record(stream)),
        "torch_event_query": per(lambda: tev.query()),
    }
    torch.cuda.synchronize()
    return got


def copy_runs(torch: Any, stream: Any) -> dict[str, Any]:
    from kvlink.gpu.copy import BatchCopier, RegionMap

    nbytes = SEGS * RUNS * UNIT
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    anywhere = RegionMap.anywhere(src.device)
    copier = BatchCopier(src.device)
    seg = np.arange(SEGS, dtype=np.uint64) * np.uint64(RUNS * UNIT)
    runs = np.arange(RUNS, dtype=np.uint64) * np.uint64(UNIT)
    table = np.concatenate([seg + np.uint64(src.data_ptr()), seg + np.uint64(dst.data_ptr()),
                            runs, np.random.default_rng(0).permutation(runs),
                            np.full(RUNS, UNIT, dtype=np.uint64)])
    post, seen, device, copy = [], [], [], []
    for i in range(60):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = copier.copy_runs(table, SEGS, RUNS, anywhere, anywhere, stream, None, UNIT)
        t1 = time.perf_counter()
        while not p.done():
            pass
        t2 = time.perf_counter()
        assert not p.failed()
        if i >= 10:
            post.append((t1 - t0) * 1e6)
            seen.append((t2 - t0) * 1e6)
    for i in range(40):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c, d = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        p = copier.copy_runs(table, SEGS, RUNS, anywhere, anywhere, stream, None, UNIT)
        b.record(stream)
        with torch.cuda.stream(stream):
            c.record(stream)
            dst.copy_(src)
            d.record(stream)
        d.synchronize()
        p.wait()
        if i >= 5:
            device.append(a.elapsed_time(b) * 1e3)
            copy.append(c.elapsed_time(d) * 1e3)
    med = {k: statistics.median(v) for k, v in (("host_post_us", post), ("post_to_seen_done_us",
                                                seen), ("device_us", device),
                                               ("device_copy_us", copy))}
    return {"bytes": nbytes, "extents": SEGS * RUNS, **med,
            "ratio_device_copy_over_copy_runs_device": med["device_copy_us"] / med["device_us"],
            "ratio_device_copy_over_post_to_seen_done": med["device_copy_us"]
            / med["post_to_seen_done_us"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-copy", action="store_true", help="the driver calls only")
    args = ap.parse_args()
    import torch

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(0),
                           "driver_calls": driver_calls(torch, stream),
                           "driver_calls_cold": driver_calls(torch, stream, cold=True)}
    if not args.no_copy:
        out["copy_runs_70b"] = copy_runs(torch, stream)
    for mode in ("driver_calls", "driver_calls_cold"):
        print(mode)
        for k, v in out[mode].items():
            print(f"  {k:28s} {v['median_us']:6.1f} us (p90 {v['p90_us']:.1f})")
    if args.no_copy:
        write_result("gpu_host_calls", out, args.out)
        return
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in out["copy_runs_70b"].items()})
    write_result("gpu_host_calls", out, args.out)


if __name__ == "__main__":
    main()
