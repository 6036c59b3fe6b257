"""What the host calls of a cuda_ipc post cost on this machine, hot, one process (GPU only).

    python3 bench/gpu_host_calls.py [--out bench/results/gpu_host_calls.json]

Explains the layer below ``bench/e2e_request.py``: each driver call a post or a poll makes
(through ctypes, as kvlink.gpu.move makes them, and through torch's Event), timed 300 times in
a row after a warm-up, and the 70B TP8-rank request's ``BatchCopier.copy_runs`` (160 segments x
256 runs of 4 KiB, one run per block) — its host time, the time until a tight loop sees its
event complete, and its device time — against a device copy of the same bytes in the same run
(CUDA events on one stream). Hot figures: a request's cold path costs several times these
(docs/e2e.md). Writes gpu_host_calls.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SEGS, RUNS, UNIT = 160, 256, 4096


def _per_call_us(fn: Callable[[], Any], n: int = 300) -> dict[str, float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    us = np.array(xs[20:]) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90))}


def driver_calls(torch: Any, stream: Any) -> dict[str, dict[str, float]]:
    lib = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    for name, args in (("cuStreamQuery", [vp]),
                       ("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
                       ("cuEventRecord", [vp, vp]), ("cuEventQuery", [vp]),
                       ("cuStreamWaitEvent", [vp, vp, ctypes.c_uint]),
                       ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, ctypes.c_size_t, vp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    raw = stream.cuda_stream
    ev = vp()
    lib.cuEventCreate(ctypes.byref(ev), 2)
    host = torch.empty(8192, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(8192, dtype=torch.uint8, device="cuda")
    tev = torch.cuda.Event()
    torch.cuda.synchronize()
    return {
        "cuStreamQuery": _per_call_us(lambda: lib.cuStreamQuery(raw)),
        "cuEventRecord": _per_call_us(lambda: lib.cuEventRecord(ev, raw)),
        "cuEventQuery": _per_call_us(lambda: lib.cuEventQuery(ev)),
        "cuStreamWaitEvent": _per_call_us(lambda: lib.cuStreamWaitEvent(raw, ev, 0)),
        "cuMemcpyHtoDAsync_8KiB": _per_call_us(
            lambda: lib.cuMemcpyHtoDAsync_v2(dev.data_ptr(), host.data_ptr(), 8192, raw)),
        "torch_event_record": _per_call_us(lambda: tev.record(stream)),
        "torch_event_query": _per_call_us(lambda: tev.query()),
    }


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
    args = ap.parse_args()
    import torch
    from _common import write_result

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(0),
                           "driver_calls": driver_calls(torch, stream),
                           "copy_runs_70b": copy_runs(torch, stream)}
    for k, v in out["driver_calls"].items():
        print(f"{k:24s} {v['median_us']:6.1f} us (p90 {v['p90_us']:.1f})")
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in out["copy_runs_70b"].items()})
    write_result("gpu_host_calls", out, args.out)


if __name__ == "__main__":
    main()
