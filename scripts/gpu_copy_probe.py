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
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

CASES = _gpu_common.CASES


def _variant_module() -> Any:
    """_gpukernels without the streaming cache hints, to measure what they are worth."""
    return _gpu_common.kernel_variant(_gpu_common.no_cache_hints, "kvk_nocache")


def main() -> None:
    import torch

    from kvlink.transport import make_extents
    from kvlink_transports._gpucopy import BatchCopier, RegionMap

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pieces", type=int, nargs="*", default=[4096, 2048, 8192, 1 << 30])
    ap.add_argument("--blocks", nargs="*", default=["1024x4", "512x4", "2048x8"])
    ap.add_argument("--chunks", type=int, nargs="*", default=[256 << 10, 1 << 20])
    ap.add_argument("--rows", type=int, nargs="*", default=[8, 4, 16])
    ap.add_argument("--firsts", type=int, nargs="*", default=[2048, 1024, 4096])
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "cases": {}}
    rng = np.random.default_rng(0)
    for name, c in CASES.items():
        case = _gpu_common.make_case(c, rng, dev)
        ext, count, src, dst, smap, dmap = (case.ext, case.count, case.src, case.dst, case.smap,
                                           case.dmap)
        sa, da = case.addresses()
        sext, dext = make_extents(sa, ext), make_extents(da, ext)
        nbytes = ext * count
        a = torch.empty(nbytes // 8, dtype=torch.int64, device=dev).random_()
        b = torch.empty_like(a)
        base = _gpu_common.host_seconds(functools.partial(b.copy_, a), args.reps)
        copy_event_us = _gpu_common.event_us(functools.partial(b.copy_, a), args.reps, inner=1)
        del a, b
        row: dict[str, Any] = {"bytes": nbytes, "extents": count, "device_copy_s": base,
                               "device_copy_kernel_us": copy_event_us,
                               "variants": []}
        for piece, first, blk, chunk, rows in itertools.product(
                args.pieces, args.firsts, args.blocks, args.chunks, args.rows):
            if first != args.firsts[0] and count <= min(args.firsts):
                continue
            if chunk != args.chunks[0] and ext <= args.chunks[0]:
                continue  # chunk size only matters for extents longer than a chunk
            if rows != args.rows[0] and ext > (64 << 10):
                continue  # several rows per program only for small extents
            if piece != args.pieces[0] and count <= min(args.pieces):
                continue
            block, warps = (int(x) for x in blk.split("x"))
            shape = (rows, block, warps) if ext <= (64 << 10) else (1, block, warps)
            cp = BatchCopier(dev, kernel="triton", chunk=chunk, piece=piece, first=first,
                             small=shape, large=shape)
            posts, ends, gpu = [], [], []
            for _ in range(args.reps + 1):
                dst.zero_()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record(stream)
                p = cp.copy(sext, smap, dext, dmap, stream)
                e1.record(stream)
                t1 = time.perf_counter()
                while not p.done():
                    pass
                t2 = time.perf_counter()
                posts.append(t1 - t0)
                ends.append(t2 - t0)
                gpu.append(e0.elapsed_time(e1) / 1e3)
            ok = case.verified()
            e2e = statistics.median(ends[1:])
            v = {"piece": piece, "first": first, "block": block, "warps": warps, "chunk": chunk,
                 "rows": rows,
                 "post_s": statistics.median(posts[1:]), "end_to_end_s": e2e,
                 "gpu_span_s": statistics.median(gpu[1:]), "ratio_to_device_copy": base / e2e,
                 "verified": ok and not p.failed()}
            row["variants"].append(v)
            print(name, json.dumps(v), flush=True)
        # a refused extent: the post fails and the refused piece is not touched
        bad = dext.copy()
        bad["addr"][-1] = np.uint64(dst.data_ptr() + c["cache"])  # one past the region
        cp = BatchCopier(dev, kernel="triton", piece=1 << 30)
        dst.zero_()
        p = cp.copy(sext, smap, bad, dmap, stream)
        p.wait()
        row["refused_extent_failed"] = p.failed()
        print(name, "refused:", row["refused_extent_failed"])
        # the kernel alone: records already in pinned (host) memory or in device memory
        from kvlink_transports._gpucopy import CHUNK, _Kernel, launch_shape

        recs = torch.empty(1 + 4 * count, dtype=torch.int64, pin_memory=True)
        rv = recs.numpy().view(np.uint64)
        rv[0] = 0
        rv[1 : 1 + 2 * count] = np.ascontiguousarray(sext).view(np.uint64)
        rv[1 + 2 * count :] = np.ascontiguousarray(dext).view(np.uint64)
        drecs = recs.to(dev)
        variant = _variant_module()
        for where, buf in (("pinned", recs), ("device", drecs)):
            for rows, warps, block, chunk in (
                    (4, 4, 1024, CHUNK), (2, 4, 1024, CHUNK), (1, 4, 2048, CHUNK),
                    (1, 8, 8192, CHUNK), (1, 16, 8192, CHUNK), (1, 16, 8192, 128 << 10),
                    (1, 16, 8192, 1 << 20), (1, 32, 8192, CHUNK), (1, 16, 4096, CHUNK)):
                if rows > 1 and ext > (64 << 10):
                    continue
                if where == "device" and (rows, warps, block, chunk) != (1, 16, 8192, CHUNK):
                    continue
                g = launch_shape(count, ext, chunk, 528, (rows, block, warps),
                                 (rows, block, warps))[1]
                bp = buf.data_ptr()
                kargs = (bp + 8, bp + 8 + 16 * count, count, smap.ptr, 1, dmap.ptr, 1,
                         recs.data_ptr(), 99, g)
                grid = (-(-count // rows), g)
                kinds = [("", _Kernel("move"))]
                if where == "device":
                    kinds.append(("nocache_", variant))
                for label, kern in kinds:
                    def launch(kern: Any = kern, grid: Any = grid, kargs: Any = kargs,
                               rows: int = rows, block: int = block, warps: int = warps) -> None:
                        if isinstance(kern, _Kernel):
                            kern(grid, stream, kargs, (rows, block), warps, True)
                        else:
                            with torch.cuda.stream(stream):
                                kern.move[grid](*kargs, E=rows, BLOCK=block, num_warps=warps)
                    launch()
                    ts = []
                    for _ in range(args.reps):
                        e0 = torch.cuda.Event(enable_timing=True)
                        e1 = torch.cuda.Event(enable_timing=True)
                        e0.record(stream)
                        for _ in range(5):
                            launch()
                        e1.record(stream)
                        e1.synchronize()
                        ts.append(e0.elapsed_time(e1) / 1e3 / 5)
                    k = f"kernel_{label}{where}_rows{rows}_w{warps}_b{block}_c{chunk >> 10}k_us"
                    row[k] = statistics.median(ts) * 1e6
                    print(name, k, round(row[k], 1), flush=True)
        res["cases"][name] = row
        del src, dst, case
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
        for mode in ("after_sync", "back_to_back"):
            cp = BatchCopier(dev, kernel="triton")
            cp.copy(sext[:n_ext], smap, dext[:n_ext], dmap, stream).wait()
            posts = []
            for _ in range(30):
                if mode == "after_sync":
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                cp.copy(sext[:n_ext], smap, dext[:n_ext], dmap, stream)
                posts.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            res.setdefault("post_us", {})[f"{n_ext}_{mode}"] = statistics.median(posts)
    print("post us", res["post_us"], flush=True)

    class Timed:
        """Wraps the copier's kernel launcher: host timestamps around every launch."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.marks = inner, []

        def direct(self, *a: Any) -> Any:
            launch = self.inner.direct(*a)

            def timed(*b: Any) -> None:
                self.marks.append(("launch", time.perf_counter_ns()))
                launch(*b)
                self.marks.append(("launched", time.perf_counter_ns()))

            return timed if launch is not None else None

        def __call__(self, *a: Any) -> None:
            self.marks.append(("launch", time.perf_counter_ns()))
            self.inner(*a)
            self.marks.append(("launched", time.perf_counter_ns()))

    for first, piece in ((2048, 8192), (4096, 8192), (1 << 30, 1 << 30)):
        cp = BatchCopier(dev, kernel="triton", first=first, piece=piece)
        cp.copy(sext, smap, dext, dmap, stream).wait()
        timed = Timed(cp._move)
        cp._move = timed  # type: ignore[assignment]
        lines = []
        for _ in range(9):
            torch.cuda.synchronize()
            timed.marks = []
            _, t0, t1, t2 = _gpu_common.timed_post(cp, sext, smap, dext, dmap, stream)
            lines.append([round((t - t0) / 1e3, 1) for _, t in timed.marks]
                         + [round((t1 - t0) / 1e3, 1), round((t2 - t0) / 1e3, 1)])
        res.setdefault("timelines_us", {})[f"{first}_{piece}"] = lines
        print("timeline first/piece", first, piece, "(launch, launched)* post_return done:",
              lines[len(lines) // 2], flush=True)
    prof = cProfile.Profile()
    for _ in range(50):
        torch.cuda.synchronize()
        prof.enable()
        p = cp.copy(sext, smap, dext, dmap, stream)
        prof.disable()
        p.wait()
    print("--- cProfile of 50 copy() of 20480 extents", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    recs2 = np.ascontiguousarray(sext).view(np.uint64)
    pv2 = torch.empty(2 * recs2.nbytes, dtype=torch.uint8, pin_memory=True).numpy().view(np.uint64)
    ops = {
        "pinned_empty_327688": lambda: torch.empty(8 + 32 * 20480, dtype=torch.uint8,
                                                   pin_memory=True),
        "device_empty_61440": lambda: torch.empty(3 * 20480, dtype=torch.int64, device=dev),
        "event_new_record": lambda: torch.cuda.Event().record(),
        "event_query": lambda: torch.cuda.Event().query(),
        "stream_ctx": lambda: torch.cuda.stream(stream).__enter__(),
        "records_copy_2x327680": lambda: (np.copyto(pv2[:40960], recs2),
                                          np.copyto(pv2[40960:], recs2)),
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
    # launch overhead: direct compiled launch vs Triton's dispatch (one 16-byte extent)
    from kvlink_transports import _gpukernels
    from kvlink_transports._gpucopy import _Kernel

    buf = torch.zeros(64, dtype=torch.int64, device=dev)
    rec = torch.empty(5, dtype=torch.int64, pin_memory=True)
    rec[:] = torch.tensor([0, buf.data_ptr(), 16, buf.data_ptr() + 64, 16])
    hp = rec.data_ptr()
    whole = RegionMap([buf.data_ptr()], [buf.data_ptr() + 512], [0], dev)
    kargs = (hp + 8, hp + 24, 1, whole.ptr, 1, whole.ptr, 1, hp, 3, 1)
    kern = _Kernel("move")
    kern((1, 1), stream, kargs, (1, 1024), 4, True)
    torch.cuda.synchronize()
    for label, launch in (
        ("jit", lambda: _gpukernels.move[(1, 1)](*kargs, E=1, BLOCK=1024, num_warps=4)),
        ("direct", lambda: kern((1, 1), stream, kargs, (1, 1024), 4, True)),
    ):
        launch()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            launch()
        torch.cuda.synchronize()
        res[f"launch_{label}_us"] = (time.perf_counter() - t) / 1000 * 1e6
    print("launch us: jit", res["launch_jit_us"], "direct", res["launch_direct_us"])
    _gpu_common.write(args.out, "gpu_copy_probe.json", res)


if __name__ == "__main__":
    main()
