"""The lane's copy kernel alone, on a vLLM-shaped cache with one registered region per layer.

    python bench/gpu_lane_probe.py [--reps 60] [--out FILE]     (a CUDA machine)

What a cuda_ipc READ through a route costs below the worker, for the 70B TP8-rank request
(80 layers, K/V planes of ``(blocks, 16, 1, 128)`` bf16, 4 KiB a block and plane, 256
blocks, decode ids in shuffled runs of 1-8), one process:

- ``translated``: the lane as bound today: each segment's base translated through its
  layer's region once, at bind; the kernel looks no region up;
- ``lookup``: the same lane made to keep both maps (kvlink.gpu.lane.Lane before the
  translation: a binary search over 80 regions per side before each unit moves);
- ``device_copy``: one ``copy_`` of the same number of bytes, the baseline;

each as GPU time (CUDA events around the launch) and the host time of the launch call, in
interleaved rounds. Then the host time of a translated lane's launch for 8 to 1000 blocks
(the launch's parameter size class grows with the ids), and the host time of an empty
launch (no units) by the bytes of parameters the driver copies. Every lane variant's bytes
are checked against torch's own gather once. Writes bench/results/gpu_lane_probe.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from _lane_cache import plane_bases, region_map, shuffled_ids

LAYERS, SRC_BLOCKS, DST_BLOCKS, TOKENS, HEADS, DIM, BLOCKS = 80, 2048, 2176, 16, 1, 128, 256


class _Lookup:
    """A region map that never translates a lane's bases (the kernel then looks each unit
    up): the lane as it was bound before the translation, for the comparison."""

    def __init__(self, inner: Any) -> None:
        self.ptr, self.kernel_count = inner.ptr, inner.kernel_count

    def through(self, bases: Any, span: int) -> None:
        return None


def main() -> None:
    import torch

    from kvlink.gpu.copy import BatchCopier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    src = [torch.randn(2, SRC_BLOCKS, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device=dev)
           for _ in range(LAYERS)]
    dst = [torch.zeros(2, DST_BLOCKS, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device=dev)
           for _ in range(LAYERS)]
    unit = TOKENS * HEADS * DIM * 2

    smap, dmap = region_map(src, dev), region_map(dst, dev)
    copier = BatchCopier(dev)
    assert copier.computes_addresses, "the CUDA C kernel did not build"
    sb, db = plane_bases(src, SRC_BLOCKS, unit), plane_bases(dst, DST_BLOCKS, unit)
    lanes = {"translated": copier.lane(sb, db, unit, (SRC_BLOCKS, DST_BLOCKS), smap, dmap),
             "lookup": copier.lane(sb, db, unit, (SRC_BLOCKS, DST_BLOCKS), _Lookup(smap),
                                   _Lookup(dmap))}
    assert lanes["translated"] is not None and lanes["lookup"] is not None
    assert lanes["translated"].translated and not lanes["lookup"].translated
    stream = torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)
    sids, dids = shuffled_ids(rng, BLOCKS)
    verified = {}
    for name, lane in lanes.items():
        for x in dst:
            x.zero_()
        torch.cuda.synchronize(dev)  # (the lane's stream is not ordered after the zeroing)
        p = copier.copy_lane(lane, sids, dids, stream, None)
        p.wait()
        si, di = torch.from_numpy(sids).to(dev), torch.from_numpy(dids).to(dev)
        verified[name] = (not p.failed()) and all(
            torch.equal(d[:, di], s[:, si]) for s, d in zip(src, dst))
    flat_src = torch.empty(BLOCKS * 2 * LAYERS * unit, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    kinds = ("translated", "lookup", "device_copy")
    gpu: dict[str, list[float]] = {k: [] for k in kinds}
    host: dict[str, list[float]] = {k: [] for k in kinds[:2]}
    for i in range(args.reps + 10):
        for kind in rng.permutation(kinds).tolist():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.synchronize()
            a.record(stream)
            t0 = time.perf_counter()
            if kind == "device_copy":
                with torch.cuda.stream(stream):
                    flat_dst.copy_(flat_src)
                p = None
            else:
                p = copier.copy_lane(lanes[kind], sids, dids, stream, None)
            dt = time.perf_counter() - t0
            b.record(stream)
            b.synchronize()
            if p is not None:
                p.wait()
                assert not p.failed(), kind
            if i >= 10:
                gpu[kind].append(a.elapsed_time(b) * 1e3)
                if kind in host:
                    host[kind].append(dt * 1e6)
    sizes: dict[str, dict[str, float]] = {}
    lane = lanes["translated"]
    for n in (8, 64, 256, 1000):
        s, d = shuffled_ids(np.random.default_rng(n), n)
        if not lane.fits(n):
            continue
        times = []
        for i in range(args.reps + 10):
            stream.synchronize()
            t0 = time.perf_counter()
            p = copier.copy_lane(lane, s, d, stream, None)
            dt = time.perf_counter() - t0
            p.wait()
            if i >= 10:
                times.append(dt * 1e6)
        words = 2 * lane.segments + 2 * n
        sizes[str(n)] = {"table_words": words,
                         "param_class_words": copier._cuda.table_class(words),
                         "host_launch_median_us": statistics.median(times)}
    # the driver's launch alone by the size of the parameters it copies: an empty launch
    # (no units) of kv_move_runs compiled for tables of each size, interleaved
    from kvlink.gpu import move

    raw = stream.cuda_stream
    launches = {w: move.TableLaunch(dev, move.SMALL_SHAPE, "kv_move_runs", w,
                                    move.NARGS + move.IDS_NARGS[0], ids=True)
                for w in (128, 256, 480, 512, 1024, 1536, 4000)}
    empty: dict[int, list[float]] = {w: [] for w in launches}
    lib = copier._cuda.lib
    for i in range(args.reps * 4 + 20):
        for w in rng.permutation(list(launches)).tolist():
            launch = launches[w]
            launch.vals[0] = launch.vals[1] = 0  # S = R = 0: every thread returns at once
            t0 = time.perf_counter()
            rc = launch.launch(lib, 1, raw)
            dt = time.perf_counter() - t0
            assert rc == 0, rc
            stream.synchronize()
            if i >= 20:
                empty[w].append(dt * 1e6)
    med = {k: statistics.median(v) for k, v in gpu.items()}
    out = {
        "device_name": torch.cuda.get_device_name(dev),
        "shape": {"layers": LAYERS, "planes": 2, "blocks": BLOCKS, "unit_bytes": unit,
                  "regions_per_side": LAYERS, "bytes": BLOCKS * 2 * LAYERS * unit},
        "verified": verified,
        "gpu_median_us": med,
        "host_launch_median_us": {k: statistics.median(v) for k, v in host.items()},
        "ratio_device_copy_over_translated": med["device_copy"] / med["translated"],
        "ratio_device_copy_over_lookup": med["device_copy"] / med["lookup"],
        "ratio_lookup_over_translated": med["lookup"] / med["translated"],
        "host_launch_by_blocks": sizes,
        "empty_launch_host_us_by_param_bytes": {
            str(8 * w + 8 * (move.NARGS + move.IDS_NARGS[0] - 1)): statistics.median(v)
            for w, v in empty.items()},
        "reps": args.reps,
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    write_result("gpu_lane_probe", out, args.out)
    sys.exit(0 if all(verified.values()) else 1)


if __name__ == "__main__":
    main()
