"""Can a CUDA C copy kernel (compiled at run time by NVRTC) beat the Triton one on the cuda_ipc
shapes? A sweep of plain extent-copy kernels, timed by CUDA events against a device copy of the
same bytes and the shipped Triton kernel, in the same run.

    python scripts/gpu_cuda_copy_probe.py [--out DIR] [--reps N]

Each variant: T threads a block, TP threads per extent part (T/TP parts a block), U 16-byte
vectors in flight per thread, load/store cache hints, part size, a grid of one block per T/TP
parts or a persistent grid (k blocks per multiprocessor), extent records read from pinned host
memory (as kvlink posts them) or from device memory. Every variant's bytes are verified.
Writes gpu_cuda_copy_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

HINTS = {"cs": ("__ldcs", "__stcs"), "plain": ("", ""), "cg": ("__ldcg", "__stcg"),
         "nc": ("__ldg", "__stcs")}

SRC = r"""
#define T {threads}
#define TP {tp}
#define U {unroll}
#define ORDER {order}
#define WARPC {warpc}
__device__ __forceinline__ int4 ld(const int4* p) {{ return {load}(p); }}
__device__ __forceinline__ void st(int4* p, int4 v) {{ {store_stmt}; }}
extern "C" __global__ void __launch_bounds__(T) kv_copy(
    const long long* __restrict__ sext, const long long* __restrict__ dext,
    long long n, long long part, long long G)
{{
  const long long total = n * G;
  const int slot = threadIdx.x / TP, lane = threadIdx.x % TP;
  const long long step = (long long)gridDim.x * (T / TP);
  for (long long p = (long long)blockIdx.x * (T / TP) + slot; p < total; p += step) {{
#if ORDER
    const long long g = p / n, e = p - g * n;  // part-major: neighbours in time differ in extent
#else
    const long long e = p / G, g = p - e * G;
#endif
    const long long len = sext[2 * e + 1];
    const long long lo = g * part;
    long long hi = lo + part;
    if (hi > len) hi = len;
    if (lo >= hi) continue;
    const int4* s = reinterpret_cast<const int4*>(sext[2 * e] + lo);
    int4* d = reinterpret_cast<int4*>(dext[2 * e] + lo);
    const long long nv = (hi - lo) >> 4;
#if WARPC  // each warp owns 32*U consecutive vectors of a step: one DRAM page per warp
    for (long long i = (lane / 32) * 32 * U + lane % 32; i < nv; i += (long long)TP * U) {{
#define STRIDE 32
#else
    for (long long i = lane; i < nv; i += (long long)TP * U) {{
#define STRIDE TP
#endif
      int4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {{
        const long long j = i + (long long)u * STRIDE;
        if (j < nv) r[u] = ld(s + j);
      }}
#pragma unroll
      for (int u = 0; u < U; ++u) {{
        const long long j = i + (long long)u * STRIDE;
        if (j < nv) st(d + j, r[u]);
      }}
    }}
  }}
}}
"""


class Kernels:
    """NVRTC-compiled variants, launched through the driver with 64-bit arguments."""

    def __init__(self) -> None:
        from kvlink_transports import _cudamove

        self.cache: dict[tuple[Any, ...], Any] = {}
        self.lib = _cudamove._driver()

    def get(self, threads: int, tp: int, unroll: int, hint: str, order: int = 0,
            warpc: int = 0) -> Any:
        key = (threads, tp, unroll, hint, order, warpc)
        if key not in self.cache:
            import torch

            load, store = HINTS[hint]
            store_stmt = f"{store}(p, v)" if store else "*p = v"
            src = SRC.format(threads=threads, tp=tp, unroll=unroll, load=load or "*", order=order,
                             warpc=warpc, store_stmt=store_stmt)
            self.cache[key] = torch.cuda._compile_kernel(src, "kv_copy")
        return self.cache[key]

    def launch(self, k: Any, grid: int, threads: int, args: tuple[int, ...], stream: int) -> None:
        vals = [ctypes.c_longlong(a) for a in args]
        arr = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        rc = self.lib.cuLaunchKernel(k.func, grid, 1, 1, threads, 1, 1, 0, stream, arr, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel failed: {rc}")


def variants(ext: int, quick: bool) -> list[dict[str, Any]]:
    out = []
    if quick:
        big = ext > (64 << 10)
        for t, u, part, warpc, h in itertools.product(
                (256, 512, 1024), (2, 4, 8, 16), (64 << 10, 256 << 10), (0, 1), ("cs", "plain")):
            if not big and (t > 512 or part > (64 << 10)):
                continue
            out.append(dict(threads=t, tp=t if big else 64, unroll=u, hint=h,
                            part=part if big else ext, per_sm=0, rec="dev" if big else "host",
                            warpc=warpc))
        return out
    if ext > (64 << 10):
        for t, u, h, part, per_sm, rec in itertools.product(
                (256, 512, 1024), (1, 2, 4, 8), ("cs", "plain", "cg", "nc"),
                (64 << 10, 256 << 10, 1 << 20), (0, 2, 4), ("host", "dev")):
            if rec == "dev" and (per_sm or h != "cs"):
                continue
            out.append(dict(threads=t, tp=t, unroll=u, hint=h, part=part, per_sm=per_sm, rec=rec))
    else:
        for t, tp, u, h, per_sm in itertools.product(
                (128, 256, 512), (32, 64, 128, 256, 512), (1, 2, 4, 8), ("cs", "plain"),
                (0, 8)):
            if tp > t or tp * u * 16 > ext * 2:
                continue
            out.append(dict(threads=t, tp=tp, unroll=u, hint=h, part=ext, per_sm=per_sm,
                            rec="host"))
    return out


def triton_sweep(case: Any, hs: Any, hd: Any, ds: Any, dd: Any, reps: int
                 ) -> list[dict[str, Any]]:
    """The shipped Triton kernel with other launch settings, records in host or device memory."""
    from kvlink_transports import _gpukernels
    from kvlink_transports._gpucopy import BatchCopier

    cp = BatchCopier(case.src.device, kernel="triton")
    status = cp.host_extents(1)
    out = []
    big = case.ext > (64 << 10)
    plain = _gpu_common.kernel_variant(_gpu_common.no_cache_hints, "kvk_plain")
    for chunk, block, warps, rec, hint in itertools.product(
            (64 << 10, 256 << 10) if big else (case.ext,), (4096, 8192) if big else (1024,),
            (16, 32) if big else (4, 8), ("host", "dev"), ("shipped", "plain")):
        g = max(1, -(-case.ext // chunk))
        rows = 1 if big else 4
        recs = ((int(hs.ctypes.data), int(hd.ctypes.data)) if rec == "host"
                else (ds.data_ptr(), dd.data_ptr()))
        kargs = (*recs, case.count, case.smap.ptr, 1, case.dmap.ptr, 1,
                 int(status.ctypes.data), 99, g)
        mod = plain if hint == "plain" else _gpukernels
        run = functools.partial(mod.move[(-(-case.count // rows), g)], *kargs, E=rows,
                                BLOCK=block, num_warps=warps)
        case.dst.zero_()
        us = _gpu_common.event_us(run, reps)
        out.append(dict(chunk=chunk, block=block, warps=warps, rec=rec, hint=hint, us=us,
                        verified=case.verified()))
        print("  triton", out[-1], flush=True)
    return out


def placement(case: Any, a: Any, b: Any, ks: Kernels, stream: int, reps: int
              ) -> dict[str, float]:
    """Does where the bytes lie change a copy's speed? torch's device copy of the same byte
    count between halves of the case's own buffers, and the CUDA kernel on the baseline's fresh
    pair (a -> b) cut into the case's extents."""
    import torch

    n = case.nbytes // 8
    out: dict[str, float] = {}
    for si, di in itertools.product((0, 1), (0, 1)):
        s = case.src[si * n:(si + 1) * n]
        d = case.dst[di * n:(di + 1) * n]
        if s.numel() == n and d.numel() == n:
            out[f"torch_src{si}_dst{di}_us"] = _gpu_common.event_us(functools.partial(d.copy_, s),
                                                                    reps)
    out["torch_fresh_us"] = _gpu_common.event_us(functools.partial(b.copy_, a), reps)
    k = ks.get(1024, 1024, 4, "cs", 0)
    offs = np.arange(case.count, dtype=np.int64) * case.ext
    for label, (x, y) in {"fresh": (a, b), "src0_dst0": (case.src, case.dst)}.items():
        recs = [torch.from_numpy(np.stack([t.data_ptr() + offs, np.full_like(offs, case.ext)], 1)
                                 .reshape(-1)).to(x.device) for t in (x, y)]
        parts = case.ext // (64 << 10)
        args = (recs[0].data_ptr(), recs[1].data_ptr(), case.count, 64 << 10, parts)
        run = functools.partial(ks.launch, k, case.count * parts, 1024, args, stream)
        y.zero_()
        out[f"cuda_{label}_us"] = _gpu_common.event_us(run, reps)
        out[f"cuda_{label}_verified"] = bool(torch.equal(x[:n], y[:n]))
    print("  placement", out, flush=True)
    return out


def memcpy_graph_us(case: Any, reps: int) -> float:
    """The driver's own copies of the same extents, one cudaMemcpyAsync each, captured in a
    CUDA graph (no launch gaps): what the same scatter costs a copy engine-free memcpy."""
    import torch

    if case.count > 4096:
        return float("nan")
    w = case.ext // 8
    s, d = case.src.view(-1, w), case.dst.view(-1, w)
    pairs = [(int(a), int(b)) for a, b in zip(case.sblk, case.dblk)]
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        for _ in range(2):
            for a, b in pairs:
                d[b].copy_(s[a])
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=st):
            for a, b in pairs:
                d[b].copy_(s[a])
    case.dst.zero_()
    us = _gpu_common.event_us(g.replay, reps)
    print("  memcpy graph", us, case.verified(), flush=True)
    return us


def main() -> None:
    import torch

    from kvlink.transport import make_extents
    from kvlink_transports import _gpukernels
    from kvlink_transports._gpucopy import BatchCopier, launch_shape

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cases", default=",".join(_gpu_common.CASES))
    ap.add_argument("--layout", default="random",
                    choices=["random", "sorted", "identity", "shifted"])
    ap.add_argument("--quick", action="store_true", help="a few CUDA variants, then Triton's "
                    "launch settings with records in device memory and a graph of memcpys")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.current_stream(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ks = Kernels()
    res: dict[str, Any] = {"cases": {}, "sms": sms, "layout": args.layout}
    rng = np.random.default_rng(0)
    for name in args.cases.split(","):
        c = _gpu_common.CASES[name]
        case = _gpu_common.make_case(c, rng, dev)
        if args.layout != "random":  # same buffers, other block ids: does the scatter cost?
            ids = np.arange(case.count, dtype=np.uint64)
            if args.layout == "sorted":
                case.sblk, case.dblk = np.sort(case.sblk), np.sort(case.dblk)
            elif args.layout == "identity":
                case.sblk, case.dblk = ids, ids.copy()
            elif args.layout == "shifted":
                case.sblk, case.dblk = ids, ids + np.uint64(case.count)
        sa, da = case.addresses()
        cp = BatchCopier(dev, kernel="triton")  # its chunk sets the Triton reference's parts
        hs, hd = cp.host_extents(case.count), cp.host_extents(case.count)
        hs[:], hd[:] = make_extents(sa, case.ext), make_extents(da, case.ext)
        ds = torch.from_numpy(hs.view(np.int64).copy()).to(dev)
        dd = torch.from_numpy(hd.view(np.int64).copy()).to(dev)
        a = torch.empty(case.nbytes // 8, dtype=torch.int64, device=dev).random_()
        b = torch.empty_like(a)
        base = functools.partial(b.copy_, a)

        # the shipped Triton kernel, launched as the probe of record does
        shape, g = launch_shape(case.count, case.ext, cp.chunk, cp.min_programs, cp.small,
                                cp.large)
        rows, block, warps = shape
        status = cp.host_extents(1)
        kargs = (int(hs.ctypes.data), int(hd.ctypes.data), case.count, case.smap.ptr, 1,
                 case.dmap.ptr, 1, int(status.ctypes.data), 99, g)

        triton_run = functools.partial(_gpukernels.move[(-(-case.count // rows), g)], *kargs,
                                       E=rows, BLOCK=block, num_warps=warps)

        row: dict[str, Any] = {"bytes": case.nbytes, "extents": case.count,
                               "device_copy_us": [], "variants": []}
        row["device_copy_us"].append(_gpu_common.event_us(base, args.reps))
        case.dst.zero_()
        row["triton_shipped_us"] = _gpu_common.event_us(triton_run, args.reps)
        row["triton_shipped_verified"] = case.verified()
        print(name, "device copy", row["device_copy_us"][-1], "triton",
              row["triton_shipped_us"], flush=True)
        for i, v in enumerate(variants(case.ext, args.quick)):
            k = ks.get(v["threads"], v["tp"], v["unroll"], v["hint"], v.get("order", 0),
                       v.get("warpc", 0))
            parts_per = -(-case.ext // v["part"])
            total = case.count * parts_per
            per_block = v["threads"] // v["tp"]
            grid = v["per_sm"] * sms if v["per_sm"] else -(-total // per_block)
            recs = ((int(hs.ctypes.data), int(hd.ctypes.data)) if v["rec"] == "host"
                    else (ds.data_ptr(), dd.data_ptr()))
            kargs_v = (*recs, case.count, v["part"], parts_per)

            def run(k: Any = k, grid: int = grid, v: dict[str, Any] = v,
                    kargs_v: tuple[int, ...] = kargs_v) -> None:
                ks.launch(k, grid, v["threads"], kargs_v, stream.cuda_stream)

            case.dst.zero_()
            us = _gpu_common.event_us(run, args.reps)
            ok = case.verified()
            row["variants"].append({**v, "us": us, "verified": ok})
            if i % 40 == 39:
                row["device_copy_us"].append(_gpu_common.event_us(base, args.reps))
        if args.quick and case.ext > (64 << 10):
            row["placement"] = placement(case, a, b, ks, stream.cuda_stream, args.reps)
        if args.quick:
            row["triton"] = triton_sweep(case, hs, hd, ds, dd, args.reps)
            row["memcpy_graph_us"] = memcpy_graph_us(case, args.reps)
            row["device_copy_us"].append(_gpu_common.event_us(base, args.reps))
        best = sorted((x for x in row["variants"] if x["verified"]), key=lambda x: x["us"])[:8]
        base_us = float(np.median(row["device_copy_us"]))
        row["device_copy_median_us"] = base_us
        row["triton_ratio_to_device_copy"] = base_us / row["triton_shipped_us"]
        row["best"] = [{**x, "ratio_to_device_copy": base_us / x["us"]} for x in best]
        row["all_verified"] = all(x["verified"] for x in row["variants"])
        print(name, "device copy", row["device_copy_us"], "triton", row["triton_shipped_us"],
              "all verified", row["all_verified"], flush=True)
        for x in row["best"]:
            print("  ", x, flush=True)
        res["cases"][name] = row
        del a, b, case, ds, dd
        torch.cuda.empty_cache()
    _gpu_common.write(args.out, f"gpu_cuda_copy_probe_{args.layout}.json", res)


if __name__ == "__main__":
    main()
