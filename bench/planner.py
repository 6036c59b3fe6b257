"""Planner benchmarks: how long plan_transfer takes for realistic requests (no memory touched).

    .venv/bin/python bench/planner.py [--runs 300] [--out bench/results/planner.json]

(a) one 4096-token request of a Llama-3-70B-sized rank (80 layers, 8 kv heads, head_dim 128,
    bf16, block 16): 256 blocks x 80 layers = 20480 (layer, block) pairs, K/V split.
    a1: random non-contiguous decode ids, contiguous prefill ids; a2: both contiguous.
    Goal: median <= 2 ms.
(b) TP8 prefill -> TP2 decode, same model: one decode rank (4 kv heads) plans every HeadRead that
    map_heads gives it (4 reads of 1 head from 4 prefill ranks), NHD and HND. Goal: <= 5 ms.

Specs are built directly with fake addresses (KVCacheSpec fields), so nothing large is allocated.
The baseline, measured in the same run, is a straightforward Python loop over (layer, kv, block)
that builds the same uncoalesced extents (what the vectorised planner replaces).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import write_result

from kvlink.headmap import map_heads
from kvlink.layout import KVCacheSpec, Layout
from kvlink.plan import plan_transfer
from kvlink.transport import Region

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE, BLOCK = 80, 8, 128, 2, 16
TOKENS = 4096
NBLK = TOKENS // BLOCK  # 256 blocks per request
GOAL_A_MS, GOAL_B_MS = 2.0, 5.0


def fake_spec(num_blocks: int, heads: int, layout: Layout, base: int, *, tp: int = 1,
              rank: int = 0) -> KVCacheSpec:
    """FlashAttention-style K/V split cache at a fake address: planes back to back."""
    page = BLOCK * heads * HEAD_DIM * ITEMSIZE
    plane = num_blocks * page
    idx = np.arange(LAYERS * 2, dtype=np.uint64).reshape(LAYERS, 2)
    return KVCacheSpec(
        num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=heads,
        head_dim=HEAD_DIM, dtype="bfloat16", itemsize=ITEMSIZE, layout=layout, mla=False,
        regions=(Region(base, LAYERS * 2 * plane, "cuda:0"),),
        plane_base=np.uint64(base) + idx * np.uint64(plane),
        block_stride=np.full((LAYERS, 2), page, dtype=np.uint64),
        total_kv_heads=KV_HEADS, tp_size=tp, tp_rank=rank,
    )


def timed(fn: Callable[[], Any], runs: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float], goal: float, **extra: Any) -> dict[str, Any]:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 10 else [min(ms), max(ms)]
    return {
        "median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1], "min_ms": min(ms),
        "goal_ms": goal, "meets_goal": statistics.median(ms) <= goal, "runs": len(ms),
        **extra, "raw_ms": [round(x, 4) for x in ms],
    }


def python_loop_plan(local: KVCacheSpec, remote: KVCacheSpec, lids: np.ndarray,
                     rids: np.ndarray) -> list[tuple[int, int, int]]:
    """Baseline: one Python iteration per (layer, kv, block), no coalescing."""
    out = []
    page = local.page_bytes
    lb, ls = local.plane_base.tolist(), local.block_stride.tolist()
    rb, rs = remote.plane_base.tolist(), remote.block_stride.tolist()
    for layer in range(local.num_layers):
        for kv in range(local.num_kv):
            for li, ri in zip(lids.tolist(), rids.tolist()):
                out.append((lb[layer][kv] + li * ls[layer][kv],
                            rb[layer][kv] + ri * rs[layer][kv], page))
    return out


def run_cases(runs: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}

    # (a) homogeneous TP: whole pages
    decode = fake_spec(8192, KV_HEADS, Layout.NHD, 0x7F00_0000_0000)
    prefill = fake_spec(4096, KV_HEADS, Layout.NHD, 0x7E00_0000_0000)
    random_ids = rng.choice(decode.num_blocks, NBLK, replace=False).astype(np.int64)
    cases = {
        "a1_random_decode_contiguous_prefill": (random_ids, np.arange(1000, 1000 + NBLK)),
        "a2_both_contiguous": (np.arange(3000, 3000 + NBLK), np.arange(1000, 1000 + NBLK)),
    }
    for name, (lids, rids) in cases.items():
        plan = plan_transfer(decode, prefill, lids, rids)
        ms = timed(functools.partial(plan_transfer, decode, prefill, lids, rids), runs)
        base = timed(functools.partial(python_loop_plan, decode, prefill, lids, rids),
                     max(3, runs // 50), warmup=1)
        results[name] = summary(
            ms, GOAL_A_MS, layer_block_pairs=LAYERS * NBLK, raw_descriptors=plan.raw_descriptors,
            descriptors=plan.descriptors, bytes=plan.nbytes,
            baseline_python_loop_median_ms=statistics.median(base),
            speedup_vs_python_loop=statistics.median(base) / statistics.median(ms),
        )
        print(f"  {name}: median {results[name]['median_ms']:.3f} ms (goal {GOAL_A_MS} ms), "
              f"{plan.descriptors} descriptors from {plan.raw_descriptors}; python loop "
              f"{statistics.median(base):.1f} ms")

    # (b) TP8 -> TP2, one decode rank, every HeadRead
    reads = map_heads(2, 0, 8, KV_HEADS)
    for layout in (Layout.HND, Layout.NHD):
        local = fake_spec(8192, KV_HEADS // 2, layout, 0x7F00_0000_0000, tp=2, rank=0)
        remotes = {r: fake_spec(4096, 1, layout, 0x7000_0000_0000 + (r << 36), tp=8, rank=r)
                   for r in range(8)}
        lids, rids = random_ids, np.arange(1000, 1000 + NBLK)

        def plan_all(local: KVCacheSpec = local, remotes: dict[int, KVCacheSpec] = remotes,
                     lids: np.ndarray = lids, rids: np.ndarray = rids) -> list[Any]:
            return [plan_transfer(local, remotes[rd.remote_rank], lids, rids, rd)
                    for rd in reads]

        plans = plan_all()
        ms = timed(plan_all, max(20, runs // 3))
        name = f"b_tp8_to_tp2_{layout.value}"
        results[name] = summary(
            ms, GOAL_B_MS, head_reads=[
                {"remote_rank": r.remote_rank, "local_start": r.local_start,
                 "remote_start": r.remote_start, "count": r.count} for r in reads],
            raw_descriptors=sum(p.raw_descriptors for p in plans),
            descriptors=sum(p.descriptors for p in plans), bytes=sum(p.nbytes for p in plans),
        )
        print(f"  {name}: median {results[name]['median_ms']:.3f} ms (goal {GOAL_B_MS} ms), "
              f"{len(reads)} reads, {results[name]['descriptors']} descriptors")
    return results


def keep_freed_memory() -> bool:
    """glibc: stop returning freed arrays to the kernel (no mmap/munmap + page zeroing per call)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print("default allocator:")
    results = run_cases(args.runs)
    payload: dict[str, Any] = {
        "what": "kvlink.plan.plan_transfer wall time per request (CPU only, fake addresses)",
        "model": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "itemsize": ITEMSIZE, "block_size": BLOCK, "tokens": TOKENS,
                  "blocks": NBLK},
        "numpy": np.__version__,
        "results": results,
    }
    # Second pass: the same cases with glibc keeping freed memory, which shows how much of the
    # default figures is first-touch page faults on the freshly allocated extent arrays.
    if keep_freed_memory():
        print("glibc mallopt(M_MMAP_THRESHOLD=1 GiB, M_TRIM_THRESHOLD=2 GiB):")
        payload["results_malloc_keep_freed"] = run_cases(args.runs)
    write_result("planner", payload, args.out)


if __name__ == "__main__":
    main()
