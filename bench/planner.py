"""Planner benchmarks: how long planning a realistic request takes (no memory touched).

    .venv/bin/python bench/planner.py [--runs 300] [--out bench/results/planner.json]

Every case is timed these ways in the same run: ``table_plan`` (PlanTable.plan on a table
built beforehand: what a worker does per request), ``plan_transfer`` (the table from
PlanTable.for_peer's cache, then plan), ``build_then_plan`` (a fresh table every call: a pair's
first request), ``general_path`` (PlanTable.plan_general: the whole [layer, kv, block, piece]
grid then coalesced — the planner before PlanTable), ``build_table`` alone; plus a Python loop
over (layer, kv, block) building the uncoalesced extents.

(a) one 4096-token request of a Llama-3-70B-sized rank (80 layers, 8 kv heads, head_dim 128,
    bf16, block 16): 256 blocks x 80 layers = 20480 (layer, block) pairs, K/V split.
    a1: random non-contiguous decode ids, contiguous prefill ids; a2: both contiguous.
    Goal: plan_transfer median <= 2 ms.
(b) TP8 prefill -> TP2 decode, same model: one decode rank (4 kv heads) plans every HeadRead that
    map_heads gives it (4 reads of 1 head from 4 prefill ranks), NHD and HND. Goal: <= 5 ms.
(c) vLLM FlashAttention layout, (2, num_blocks, 16, heads, 128) bf16 per layer, 4096 tokens =
    256 blocks; decode ids in shuffled runs of 1-8 blocks, prefill ids contiguous.
    c1: a Llama-3-70B TP8 rank (80 layers, 1 kv head). Goal: table_plan median <= 0.1 ms.
    c2: Llama-3-8B TP1 (32 layers, 8 kv heads). Goal: table_plan median <= 0.1 ms.
(d) one block of the (a) specs: the smallest request, where building a table costs the most.

Specs are built directly with fake addresses (KVCacheSpec fields), so nothing large is allocated.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import write_result

from kvlink.headmap import map_heads
from kvlink.layout import KVCacheSpec, Layout
from kvlink.plan import PlanTable, plan_transfer
from kvlink.transport import Region

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE, BLOCK = 80, 8, 128, 2, 16
TOKENS = 4096
NBLK = TOKENS // BLOCK  # 256 blocks per request
GOAL_A_MS, GOAL_B_MS, GOAL_C_MS = 2.0, 5.0, 0.1


def fake_spec(num_blocks: int, heads: int, layout: Layout, base: int, *, tp: int = 1,
              rank: int = 0, layers: int = LAYERS, total_heads: int = KV_HEADS) -> KVCacheSpec:
    """FlashAttention-style K/V split cache at a fake address: planes back to back."""
    page = BLOCK * heads * HEAD_DIM * ITEMSIZE
    plane = num_blocks * page
    idx = np.arange(layers * 2, dtype=np.uint64).reshape(layers, 2)
    return KVCacheSpec(
        num_layers=layers, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=heads,
        head_dim=HEAD_DIM, dtype="bfloat16", itemsize=ITEMSIZE, layout=layout, mla=False,
        regions=(Region(base, layers * 2 * plane, "cuda:0"),),
        plane_base=np.uint64(base) + idx * np.uint64(plane),
        block_stride=np.full((layers, 2), page, dtype=np.uint64),
        total_kv_heads=total_heads, tp_size=tp, tp_rank=rank,
    )


def shuffled_runs(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    """n distinct block ids: the pool cut into runs of 1-8 blocks, shuffled, the first n taken
    (a decode instance's free list after a while)."""
    cuts = np.cumsum(rng.integers(1, 9, num_blocks))
    runs = np.split(np.arange(num_blocks), cuts[cuts < num_blocks])
    order = rng.permutation(len(runs))
    ids: np.ndarray = np.concatenate([runs[i] for i in order])[:n].astype(np.int64)
    return ids


def timed(fn: Callable[[], Any], runs: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float], goal: float | None, **extra: Any) -> dict[str, Any]:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 10 else [min(ms), max(ms)]
    return {
        "median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1], "min_ms": min(ms),
        "goal_ms": goal, "meets_goal": None if goal is None else statistics.median(ms) <= goal,
        "runs": len(ms),
        **extra, "raw_ms": [round(x, 4) for x in ms],
    }


def build_then_plan(local: KVCacheSpec, remote: KVCacheSpec, lids: np.ndarray,
                    rids: np.ndarray) -> Any:
    """A pair's first request: the table built, then used once."""
    return PlanTable.build(local, remote).plan(lids, rids)


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
    specs: dict[str, tuple[KVCacheSpec, KVCacheSpec, float | None, str]] = {
        name: (decode, prefill, GOAL_A_MS, "plan_transfer") for name in cases}
    # (d) the smallest request: is a table (first request of a pair: built) ever slower?
    cases["d_one_block"] = (random_ids[:1], np.arange(1000, 1001))
    specs["d_one_block"] = (decode, prefill, None, "plan_transfer")
    # (c) vLLM FlashAttention per layer, decode ids in shuffled runs
    for name, layers, heads in (("c1_llama70b_tp8_rank_runs", LAYERS, 1),
                                ("c2_llama8b_tp1_runs", 32, 8)):
        d = fake_spec(8192, heads, Layout.NHD, 0x7F00_0000_0000, layers=layers,
                      total_heads=heads)
        p = fake_spec(4096, heads, Layout.NHD, 0x7E00_0000_0000, layers=layers,
                      total_heads=heads)
        cases[name] = (shuffled_runs(rng, d.num_blocks, NBLK), np.arange(1000, 1000 + NBLK))
        specs[name] = (d, p, GOAL_C_MS, "table_plan")
    for name, (lids, rids) in cases.items():
        local, remote, goal, goal_of = specs[name]
        table = PlanTable.build(local, remote)
        plan = table.plan(lids, rids)
        general = table.plan_general(lids, rids)
        assert np.array_equal(plan.local, general.local)
        assert np.array_equal(plan.remote, general.remote)
        fns: dict[str, Callable[[], Any]] = {
            "table_plan": functools.partial(table.plan, lids, rids),
            "plan_transfer": functools.partial(plan_transfer, local, remote, lids, rids),
            "build_then_plan": functools.partial(build_then_plan, local, remote, lids, rids),
            "general_path": functools.partial(table.plan_general, lids, rids),
            "build_table": functools.partial(PlanTable.build, local, remote),
        }
        timings = {k: timed(fn, runs) for k, fn in fns.items()}
        base = timed(functools.partial(python_loop_plan, local, remote, lids, rids),
                     max(3, runs // 50), warmup=1)
        med = {k: statistics.median(v) for k, v in timings.items()}
        results[name] = {
            "path": table.path.value, "layers": local.num_layers,
            "kv_heads": local.num_kv_heads, "layer_block_pairs": local.num_layers * NBLK,
            "raw_descriptors": plan.raw_descriptors, "descriptors": plan.descriptors,
            "bytes": plan.nbytes, "goal_of": goal_of,
            **{k: summary(v, goal if k == goal_of else None) for k, v in timings.items()},
            "baseline_python_loop_median_ms": statistics.median(base),
            "speedup_table_plan_vs_general_path": med["general_path"] / med["table_plan"],
            "speedup_plan_transfer_vs_general_path": (med["general_path"]
                                                      / med["plan_transfer"]),
            "speedup_table_plan_vs_python_loop": statistics.median(base) / med["table_plan"],
        }
        print(f"  {name} ({table.path.value}): table_plan {med['table_plan'] * 1e3:.1f} us, "
              f"plan_transfer {med['plan_transfer'] * 1e3:.1f} us, build + plan "
              f"{med['build_then_plan'] * 1e3:.1f} us, general path "
              f"{med['general_path'] * 1e3:.1f} us, build {med['build_table'] * 1e3:.1f} us "
              f"(goal {goal_of} <= {goal} ms); {plan.descriptors} descriptors from "
              f"{plan.raw_descriptors}; python loop {statistics.median(base):.1f} ms")

    # (b) TP8 -> TP2, one decode rank, every HeadRead
    reads = map_heads(2, 0, 8, KV_HEADS)
    for layout in (Layout.HND, Layout.NHD):
        local = fake_spec(8192, KV_HEADS // 2, layout, 0x7F00_0000_0000, tp=2, rank=0)
        remotes = {r: fake_spec(4096, 1, layout, 0x7000_0000_0000 + (r << 36), tp=8, rank=r)
                   for r in range(8)}
        lids, rids = random_ids, np.arange(1000, 1000 + NBLK)

        tables = [PlanTable.build(local, remotes[rd.remote_rank], rd) for rd in reads]

        def plan_all(local: KVCacheSpec = local, remotes: dict[int, KVCacheSpec] = remotes,
                     lids: np.ndarray = lids, rids: np.ndarray = rids) -> list[Any]:
            return [plan_transfer(local, remotes[rd.remote_rank], lids, rids, rd)
                    for rd in reads]

        def table_all(tables: list[PlanTable] = tables, lids: np.ndarray = lids,
                      rids: np.ndarray = rids) -> list[Any]:
            return [t.plan(lids, rids) for t in tables]

        def general_all(tables: list[PlanTable] = tables, lids: np.ndarray = lids,
                        rids: np.ndarray = rids) -> list[Any]:
            return [t.plan_general(lids, rids) for t in tables]

        plans = plan_all()
        n = max(20, runs // 3)
        timings = {"table_plan": timed(table_all, n), "plan_transfer": timed(plan_all, n),
                   "general_path": timed(general_all, n)}
        med = {k: statistics.median(v) for k, v in timings.items()}
        name = f"b_tp8_to_tp2_{layout.value}"
        results[name] = {
            "path": sorted({t.path.value for t in tables}), "head_reads": [
                {"remote_rank": r.remote_rank, "local_start": r.local_start,
                 "remote_start": r.remote_start, "count": r.count} for r in reads],
            "raw_descriptors": sum(p.raw_descriptors for p in plans),
            "descriptors": sum(p.descriptors for p in plans),
            "bytes": sum(p.nbytes for p in plans), "goal_of": "plan_transfer",
            **{k: summary(v, GOAL_B_MS if k == "plan_transfer" else None)
               for k, v in timings.items()},
            "speedup_table_plan_vs_general_path": med["general_path"] / med["table_plan"],
        }
        print(f"  {name} ({results[name]['path']}): table_plan {med['table_plan']:.3f} ms, "
              f"plan_transfer {med['plan_transfer']:.3f} ms, general path "
              f"{med['general_path']:.3f} ms (goal plan_transfer <= {GOAL_B_MS} ms), "
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
    load_before = os.getloadavg()
    print("default allocator:")
    results = run_cases(args.runs)
    payload: dict[str, Any] = {
        "what": ("kvlink.plan wall time per request (CPU only, fake addresses): "
                 "PlanTable.plan on a prebuilt table, plan_transfer (build + plan), the "
                 "general path (the planner before PlanTable), table build, a Python loop"),
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
    # a shared 2-CPU machine: say how busy it was, since other work inflates every figure
    payload["loadavg_1_5_15_before"] = load_before
    payload["loadavg_1_5_15_after"] = os.getloadavg()
    write_result("planner", payload, args.out)


if __name__ == "__main__":
    main()
