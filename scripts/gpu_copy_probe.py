"""Tune and check the batched device copy (kvlink_transports._gpucopy) in one process.

    python scripts/gpu_copy_probe.py [--out DIR]

For the cuda_ipc acceptance shapes — (a) 1 GiB in 4 MiB extents, (b) 20480 blocks of 8 KiB at
random ids, (c) 1 GiB in 64 MiB extents — and a grid of launch settings (extents per piece,
copy block and warps), time a BatchCopier.copy end to end (post -> completion event seen by a
polling host) against a device copy of the same bytes in the same run, and verify every byte.
Also: host cost of the pieces of a post, direct vs Triton-dispatched launch, refused extents.
A copy inside one process moves through the same memory system as one through a CUDA IPC
mapping; the two-process figures come from scripts/gpu_cuda_ipc_check.py.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

GIB = 1 << 30
CASES = {
    "a_1GiB_4MiB": dict(cache=2 * GIB, ext=4 << 20, count=256),
    "b_llama70b_4096tok_8KiB": dict(cache=640 << 20, ext=8 << 10, count=20480),
    "c_1GiB_64MiB": dict(cache=2 * GIB, ext=64 << 20, count=16),
}


def _median_time(fn: Any, reps: int) -> float:
    import torch

    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def main() -> None:
    import torch

    from kvlink.transport import make_extents
    from kvlink_transports._gpucopy import BatchCopier, RegionMap

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pieces", type=int, nargs="*", default=[4096, 1 << 30])
    ap.add_argument("--blocks", nargs="*", default=["512x4", "1024x4", "2048x8"])
    ap.add_argument("--chunks", type=int, nargs="*", default=[256 << 10, 1 << 20])
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "cases": {}}
    rng = np.random.default_rng(0)
    for name, c in CASES.items():
        ext, count = c["ext"], c["count"]
        src = torch.empty(c["cache"] // 8, dtype=torch.int64, device=dev).random_()
        dst = torch.zeros_like(src)
        nblk = c["cache"] // ext
        sblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
        dblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
        sext = make_extents(np.uint64(src.data_ptr()) + sblk * np.uint64(ext), ext)
        dext = make_extents(np.uint64(dst.data_ptr()) + dblk * np.uint64(ext), ext)
        smap = RegionMap([src.data_ptr()], [src.data_ptr() + c["cache"]], [0], dev)
        dmap = RegionMap([dst.data_ptr()], [dst.data_ptr() + c["cache"]], [0], dev)
        nbytes = ext * count
        a = torch.empty(nbytes // 8, dtype=torch.int64, device=dev).random_()
        b = torch.empty_like(a)
        base = _median_time(functools.partial(b.copy_, a), args.reps)
        del a, b
        sidx = torch.from_numpy(sblk.astype(np.int64)).to(dev)
        didx = torch.from_numpy(dblk.astype(np.int64)).to(dev)
        row: dict[str, Any] = {"bytes": nbytes, "extents": count, "device_copy_s": base,
                               "variants": []}
        for piece, blk, chunk in itertools.product(args.pieces, args.blocks, args.chunks):
            if chunk != args.chunks[0] and ext <= args.chunks[0]:
                continue  # chunk size only matters for extents longer than a chunk
            block, warps = (int(x) for x in blk.split("x"))
            cp = BatchCopier(dev, chunk=chunk, piece=piece, copy_block=block, copy_warps=warps)
            posts, ends, gpu = [], [], []
            for _ in range(args.reps + 1):
                dst.zero_()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    e0.record()
                    p = cp.copy(sext, smap, dext, dmap)
                    e1.record()
                t1 = time.perf_counter()
                while not p.done():
                    pass
                t2 = time.perf_counter()
                posts.append(t1 - t0)
                ends.append(t2 - t0)
                gpu.append(e0.elapsed_time(e1) / 1e3)
            ok = bool(torch.equal(dst.view(-1, ext // 8)[didx], src.view(-1, ext // 8)[sidx]))
            e2e = statistics.median(ends[1:])
            v = {"piece": piece, "block": block, "warps": warps, "chunk": chunk,
                 "post_s": statistics.median(posts[1:]), "end_to_end_s": e2e,
                 "gpu_span_s": statistics.median(gpu[1:]), "ratio_to_device_copy": base / e2e,
                 "verified": ok and not p.failed()}
            row["variants"].append(v)
            print(name, json.dumps(v), flush=True)
        # a refused extent: the post fails and the refused piece is not touched
        bad = dext.copy()
        bad["addr"][-1] = np.uint64(dst.data_ptr() + c["cache"])  # one past the region
        cp = BatchCopier(dev, piece=1 << 30)
        dst.zero_()
        with torch.cuda.stream(stream):
            p = cp.copy(sext, smap, bad, dmap)
        p.wait()
        row["refused_extent_failed"] = p.failed()
        row["refused_extent_untouched"] = int(torch.count_nonzero(dst).item()) == 0
        print(name, "refused:", row["refused_extent_failed"], row["refused_extent_untouched"])
        # host cost of the parts of a post
        recs = np.ascontiguousarray(sext).view(np.uint64)
        pinned = torch.empty(recs.nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        pv = pinned.view(np.uint64)
        t = time.perf_counter()
        for _ in range(100):
            pv[:] = recs
        row["host_record_copy_us"] = (time.perf_counter() - t) / 100 * 1e6
        t = time.perf_counter()
        for _ in range(100):
            int(sext["len"].sum())
        row["host_len_sum_us"] = (time.perf_counter() - t) / 100 * 1e6
        res["cases"][name] = row
        del src, dst
        torch.cuda.empty_cache()
    # where a post's host time goes: cProfile of copy() and the candidate operations alone
    import cProfile
    import pstats

    c = CASES["b_llama70b_4096tok_8KiB"]
    src = torch.empty(c["cache"] // 8, dtype=torch.int64, device=dev)
    dst = torch.empty_like(src)
    blk = np.arange(c["count"], dtype=np.uint64) * np.uint64(2)
    sext = make_extents(np.uint64(src.data_ptr()) + blk * np.uint64(c["ext"]), c["ext"])
    dext = make_extents(np.uint64(dst.data_ptr()) + blk * np.uint64(c["ext"]), c["ext"])
    smap = RegionMap([src.data_ptr()], [src.data_ptr() + c["cache"]], [0], dev)
    dmap = RegionMap([dst.data_ptr()], [dst.data_ptr() + c["cache"]], [0], dev)
    for n_ext in (256, 20480):
        cp = BatchCopier(dev, piece=1 << 30)
        cp.copy(sext[:n_ext], smap, dext[:n_ext], dmap).wait()
        prof = cProfile.Profile()
        for _ in range(50):
            torch.cuda.synchronize()
            prof.enable()
            with torch.cuda.stream(stream):
                p = cp.copy(sext[:n_ext], smap, dext[:n_ext], dmap)
            prof.disable()
            p.wait()
        print(f"--- cProfile of 50 copy() of {n_ext} extents", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    ops = {
        "pinned_empty_327688": lambda: torch.empty(8 + 32 * 20480, dtype=torch.uint8,
                                                   pin_memory=True),
        "device_empty_61440": lambda: torch.empty(3 * 20480, dtype=torch.int64, device=dev),
        "event_new_record": lambda: torch.cuda.Event().record(),
        "event_query": lambda: torch.cuda.Event().query(),
        "stream_ctx": lambda: torch.cuda.stream(stream).__enter__(),
        "device_ctx": lambda: torch.cuda.device(0).__enter__(),
    }
    res["host_ops_us"] = {}
    for k, fn in ops.items():
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        res["host_ops_us"][k] = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
    print("host ops us", res["host_ops_us"], flush=True)
    del src, dst
    # launch overhead: direct compiled launch vs Triton's dispatch (a kernel that exits at once)
    from kvlink_transports import _gpukernels

    flag = torch.full((1,), 5, dtype=torch.int64, device=dev)
    tab = torch.zeros(3, dtype=torch.int64, device=dev)
    args_ = (tab.data_ptr(), 1, flag.data_ptr(), 5, 1)
    _gpukernels.copy[(1, 1)](*args_, BLOCK=1024, num_warps=4)
    k = _gpukernels.copy[(1, 1)](*args_, BLOCK=1024, num_warps=4)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(1000):
        _gpukernels.copy[(1, 1)](*args_, BLOCK=1024, num_warps=4)
    torch.cuda.synchronize()
    res["launch_jit_us"] = (time.perf_counter() - t) / 1000 * 1e6
    t = time.perf_counter()
    for _ in range(1000):
        k[(1, 1, 1)](*args_, 1024)
    torch.cuda.synchronize()
    res["launch_direct_us"] = (time.perf_counter() - t) / 1000 * 1e6
    print("launch us: jit", res["launch_jit_us"], "direct", res["launch_direct_us"])
    import triton

    res["machine"] = {"torch": torch.__version__, "triton": triton.__version__}
    res["command"] = " ".join(sys.argv)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_copy_probe.json"), "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
