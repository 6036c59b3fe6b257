"""The lane's copy kernel by launch shape, for the e2e cases' block sizes (a CUDA machine).

    python bench/gpu_lane_shapes.py [--reps 40] [--out FILE]

Why: a lane copies whole blocks of one size a request (bench/e2e_request.py's cases: the 70B
TP8-rank request's 4 KiB pages, the 8B TP1 request's 32 KiB), and which launch shape moves
them fastest was measured for 4 MiB and 8 KiB extents only (kvlink.gpu.move's SMALL_SHAPE and
LARGE_SHAPE). Here each case's lane (a vLLM-shaped cache, a region per layer, 256 blocks,
decode ids in shuffled runs of 1-8, one process) is launched with each candidate shape —
(threads a block, threads per extent part, 16-byte vectors in flight a thread) and parts per
block — interleaved with a device copy of the same bytes in random order every round; GPU
time from CUDA events around each launch. Every shape's bytes are checked against torch's
own gather once. Writes bench/results/gpu_lane_shapes.json: the median per shape, and the
device copy's median over it (the fraction of a device copy's speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from _lane_cache import plane_bases, region_map, shuffled_ids

#: (layers, KV heads) of each case; 16 tokens a block, head size 128, bf16, 256 blocks
CASES = {"70b-tp8": (80, 1), "8b-tp1": (32, 8)}
TOKENS, DIM, BLOCKS = 16, 128, 256
#: (threads a block, threads per part, vectors a thread), parts per block (0: as the lane
#: works it out)
SHAPES = [((256, 64, 4), 0), ((256, 32, 4), 0), ((256, 128, 4), 0), ((256, 256, 4), 0),
          ((512, 128, 4), 0), ((512, 512, 4), 0), ((1024, 1024, 2), 0), ((256, 64, 8), 0),
          ((256, 128, 8), 0), ((256, 64, 4), 2), ((256, 128, 4), 2), ((256, 256, 2), 0)]


def _case(torch: Any, name: str, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    from kvlink.gpu.copy import BatchCopier

    layers, heads = CASES[name]
    dev = torch.device("cuda:0")
    sblocks, dblocks = BLOCKS + 8, BLOCKS + 64
    src = [torch.randn(2, sblocks, TOKENS, heads, DIM, dtype=torch.bfloat16, device=dev)
           for _ in range(layers)]
    dst = [torch.zeros(2, dblocks, TOKENS, heads, DIM, dtype=torch.bfloat16, device=dev)
           for _ in range(layers)]
    unit = TOKENS * heads * DIM * 2

    copier = BatchCopier(dev)
    assert copier.computes_addresses, "the CUDA C kernel did not build"
    smap, dmap = region_map(src, dev), region_map(dst, dev)
    sids, dids = shuffled_ids(rng, BLOCKS)
    si, di = torch.from_numpy(sids).to(dev), torch.from_numpy(dids).to(dev)
    lanes, verified, parts = {}, {}, {}
    stream = torch.cuda.Stream(dev)
    for shape, g in SHAPES:
        lane = copier.lane(plane_bases(src, sblocks, unit), plane_bases(dst, dblocks, unit),
                           unit, (sblocks, dblocks), smap, dmap)
        assert lane is not None
        lane._shape = shape  # (read once, at the first launch's build: fits() below)
        assert lane.fits(BLOCKS)
        if g:
            launch, _, _ = lane.launches[BLOCKS]
            units = lane.segments * BLOCKS
            lane.launches[BLOCKS] = (launch, -(-units * g // launch.groups), g)
        key = f"{shape[0]}x{shape[1]}x{shape[2]}" + (f"/g{g}" if g else "")
        parts[key] = lane.launches[BLOCKS][2]
        for x in dst:
            x.zero_()
        torch.cuda.synchronize(dev)  # (the lane's stream is not ordered after the zeroing)
        first = copier.copy_lane(lane, sids, dids, stream, None)
        first.wait()
        verified[key] = (not first.failed()) and all(torch.equal(d[:, di], s[:, si])
                                                 for s, d in zip(src, dst))
        lanes[key] = lane
    nbytes = BLOCKS * 2 * layers * unit
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    kinds = [*lanes, "device_copy"]
    gpu: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(reps + 5):
        for kind in rng.permutation(kinds).tolist():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.synchronize()
            a.record(stream)
            p: Any = None
            if kind == "device_copy":
                with torch.cuda.stream(stream):
                    flat_dst.copy_(flat_src)
            else:
                p = copier.copy_lane(lanes[kind], sids, dids, stream, None)
            b.record(stream)
            b.synchronize()
            if p is not None:
                p.wait()
                assert not p.failed(), kind
            if i >= 5:
                gpu[kind].append(a.elapsed_time(b) * 1e3)
    med = {k: statistics.median(v) for k, v in gpu.items()}
    base = med["device_copy"]
    ratios = {k: base / v for k, v in med.items() if k != "device_copy"}
    out = {"layers": layers, "kv_heads": heads, "unit_bytes": unit, "blocks": BLOCKS,
           "bytes": nbytes, "verified": verified, "parts_per_block": parts,
           "gpu_median_us": med, "ratio_device_copy_over_shape": ratios}
    best = max(ratios.items(), key=lambda kv: kv[1])
    print(f"[{name}] device copy {base:.1f} us; best {best[0]} {base / best[1]:.1f} us "
          f"({best[1]:.3f}x)")
    for k in lanes:
        print(f"  {k:16s} {med[k]:8.1f} us  {base / med[k]:.3f}x  verified={verified[k]}")
    del src, dst, flat_src, flat_dst
    torch.cuda.empty_cache()
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(0), "reps": args.reps,
                           "cases": {}}
    for name in args.cases.split(","):
        out["cases"][name] = _case(torch, name, args.reps, rng)
    write_result("gpu_lane_shapes", out, args.out)
    ok = all(all(c["verified"].values()) for c in out["cases"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
