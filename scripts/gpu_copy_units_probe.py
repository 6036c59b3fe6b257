"""Probe: why a request of one 4 KiB run per block copies at a third of a device copy.

    python scripts/gpu_copy_units_probe.py [--out DIR] [--reps N]

The 70B-TP8-rank request (160 segments x 256 blocks of 4 KiB, decode ids in shuffled runs of
1-8: what ``coalesce_runs=false``, the cuda_ipc default, posts) through ``kv_move_runs`` as
shipped, the same bytes as coalesced runs, and candidate kernels over the same table: the
shipped kernel's body in a grid-stride loop (a grid sized to fill the GPU once, each thread
group taking part after part) with several group shapes and 32-bit index arithmetic. Every
variant's destination is compared byte for byte with the shipped kernel's; each is timed by
CUDA events, interleaved with a device copy of the same bytes, same run. Writes
gpu_copy_units_probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runs_check import SEGS, UNIT, N, _runs, _table, buffers

from kvlink.gpu import move
from kvlink.gpu.copy import RegionMap
from kvlink.transport import Runs

CANDIDATE = r"""
extern "C" __global__ void __launch_bounds__(KV_T) kv_probe(
    const i64* __restrict__ t, i64 S, i64 R,
    const i64* __restrict__ smap, i64 ns, const i64* __restrict__ dmap, i64 nd,
    i64* status, i64 seq, i64 G) {
  const int lane = threadIdx.x % KV_TP;
#if KV_I32
  typedef unsigned idx;
#else
  typedef i64 idx;
#endif
  const idx total = (idx)(S * R * G);
  const idx step = (idx)gridDim.x * (KV_T / KV_TP);
  const idx g_ = (idx)G, r_ = (idx)R;
  for (idx p = (idx)blockIdx.x * (KV_T / KV_TP) + threadIdx.x / KV_TP; p < total; p += step) {
    const idx e = p / g_, g = p - e * g_;
    const idx seg = e / r_, r = e - seg * r_;
    const i64 len = t[2 * S + 2 * R + r];
    kv_part(t[seg] + t[2 * S + r], len, t[S + seg] + t[2 * S + R + r], len, smap, ns, dmap, nd,
            status, seq, (i64)G, (i64)g, lane);
  }
}
"""


class Candidate:
    """kv_probe compiled for one (threads, threads a part, vectors, 32-bit index) shape."""

    def __init__(self, dev: torch.device, t: int, tp: int, u: int, i32: bool,
                 waves: int) -> None:
        defines = (f"#define KV_T {t}\n#define KV_TP {tp}\n#define KV_U {u}\n"
                   f"#define KV_DMAX {move.DIGEST_MAX}\n#define KV_I32 {int(i32)}\n")
        with torch.cuda.device(dev):
            self.fn = torch.cuda._compile_kernel(defines + move.SOURCE + CANDIDATE,
                                                 "kv_probe").func
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.t, self.tp = t, tp
        regs = ctypes.c_int()
        self.lib.cuFuncGetAttribute(ctypes.byref(regs), 4, self.fn)
        self.regs = regs.value
        per_sm = ctypes.c_int()
        self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per_sm), self.fn, t, ctypes.c_size_t(0))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.per_sm = per_sm.value
        self.grid_cap = sms * max(1, per_sm.value) * waves  # 0 waves: no cap
        self.waves = waves
        self.vals = (ctypes.c_longlong * 10)()
        base = ctypes.addressof(self.vals)
        self.ptrs = (ctypes.c_void_p * 10)(*[base + 8 * i for i in range(10)])
        self.name = f"gs_T{t}_TP{tp}_U{u}_{'i32' if i32 else 'i64'}_w{waves}"

    def launch(self, table: torch.Tensor, segs: int, runs: int, smap: RegionMap,
               dmap: RegionMap, status: int, stream: torch.cuda.Stream) -> None:
        self.vals[:] = [table.data_ptr(), segs, runs, smap.ptr, smap.count, dmap.ptr,
                        dmap.count, status, 1, 1]
        groups = segs * runs
        grid = -(-groups // (self.t // self.tp))
        if self.waves:
            grid = min(grid, self.grid_cap)
        rc = self.lib.cuLaunchKernel(self.fn, grid, 1, 1, self.t, 1, 1, 0,
                                     ctypes.c_void_p(stream.cuda_stream), self.ptrs, None)
        assert rc == 0, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    src, dst, smap, dmap, copier, stream = buffers(dev)
    sp, dp = src.data_ptr(), dst.data_ptr()
    per_block = _runs(sp, dp, np.random.default_rng(0), coalesce=False)
    coalesced = _runs(sp, dp, np.random.default_rng(0), coalesce=True)
    status = torch.zeros(1, dtype=torch.int64, device=dev)
    tab = torch.from_numpy(_table(per_block).view(np.int64)).to(dev)
    nruns = int(per_block.lens.shape[0])

    pendings = []

    def shipped(r: Runs) -> None:  # checked after the timed window (a wait here syncs)
        pendings.append(copier.copy_runs(_table(r), SEGS, int(r.lens.shape[0]), smap, dmap,
                                         stream))

    def check_shipped() -> None:
        for p in pendings:
            p.wait()
            assert not p.failed()
        pendings.clear()

    shipped(per_block)
    check_shipped()
    torch.cuda.synchronize()
    want = dst.clone()
    res: dict[str, object] = {"segments": SEGS, "blocks": N, "unit_bytes": UNIT,
                              "bytes": per_block.nbytes, "coalesced_runs": int(
                                  coalesced.lens.shape[0])}
    cands = []
    for shape in ((256, 64, 4, False, 0), (256, 64, 4, False, 1), (256, 64, 4, True, 1),
                  (256, 32, 8, True, 1), (512, 32, 8, True, 1), (256, 32, 8, True, 2),
                  (1024, 32, 8, True, 1), (256, 64, 4, True, 2), (128, 32, 8, True, 1)):
        c = Candidate(dev, *shape)
        dst.zero_()
        c.launch(tab, SEGS, nruns, smap, dmap, status.data_ptr(), stream)
        stream.synchronize()
        ok = bool(torch.equal(dst, want)) and int(status.item()) == 0
        cands.append(c)
        res[f"{c.name}_verified"] = ok
        res[f"{c.name}_regs"] = c.regs
        res[f"{c.name}_blocks_per_sm"] = c.per_sm
        print(c.name, "verified" if ok else "WRONG", "regs", c.regs, "blocks/SM", c.per_sm,
              flush=True)
    flat = torch.empty(per_block.nbytes, dtype=torch.uint8, device=dev)
    kinds: dict[str, object] = {
        "device_copy": lambda: flat.copy_(src[:per_block.nbytes]),
        "shipped_per_block": lambda: shipped(per_block),
        "shipped_coalesced": lambda: shipped(coalesced),
        **{c.name: (lambda c=c: c.launch(tab, SEGS, nruns, smap, dmap, status.data_ptr(),
                                         stream)) for c in cands},
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.reps + 5):
        for k, fn in kinds.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.synchronize()
            a.record(stream)
            with torch.cuda.stream(stream):
                fn()  # type: ignore[operator]
            b.record(stream)
            b.synchronize()
            check_shipped()
            if i >= 5:
                times[k].append(a.elapsed_time(b) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    res["median_us"] = med
    res["ratio_device_copy_over"] = {k: med["device_copy"] / v for k, v in med.items()}
    print(json.dumps(res, indent=1), flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _gpu_common import write

    print("wrote", write(args.out, "gpu_copy_units_probe.json", res))


if __name__ == "__main__":
    main()
