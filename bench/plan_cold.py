"""A request's plan on the RUNS path, warm and cold: kvlink's C planner against numpy's.

    .venv/bin/python bench/plan_cold.py [--reps 200] [--out PATH]

``PlanTable.plan`` of bench/e2e_request.py's requests (vLLM FlashAttention caches, decode ids
in shuffled runs of 1-8, prefill ids contiguous): through the C helper (``plan_runs``, one
call) and through numpy (the same table, the helper looked up as absent), the two
interleaved call by call. ``cold``: :func:`_common.sweep` (what a serving process runs between
two requests: a pass over 32 MiB and a burst of Python objects) before each call; ``warm``:
the same call again right after. The plans are compared record for record once per case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from _common import sweep, write_result
from e2e_producer import BS, CASES, DIM, run_shuffled

from kvlink import native as natives
from kvlink.layout import KVCacheSpec
from kvlink.plan import PlanPath, PlanTable


def spec(case: Any, nblocks: int) -> KVCacheSpec:
    """The e2e bench's cache shape, untouched (torch.empty: no page is ever written)."""
    import torch

    t = torch.empty((case.layers, 2, nblocks, BS, case.heads, DIM), dtype=torch.bfloat16)
    return KVCacheSpec.from_tensors([t[i] for i in range(case.layers)],
                                    total_kv_heads=case.heads, dtype="bfloat16")


def use(helpers: Any) -> None:
    """The C helpers the planner finds (None: the numpy path): kvlink.native's loaded module,
    swapped in its cache."""
    natives._loaded["launch"] = helpers


def timed(table: PlanTable, lids: np.ndarray, rids: np.ndarray, native: Any,
          cold: bool) -> float:
    use(native)
    if cold:
        sweep()
    else:
        table.plan(lids, rids)
    t0 = time.perf_counter()
    table.plan(lids, rids)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="16-blocks,4mib,70b-tp8,8b-tp1")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    native = natives.load()
    if native is None:
        raise SystemExit("kvlink's C helpers are not built here: nothing to compare")
    rows: dict[str, Any] = {}
    for name in args.cases.split(","):
        case = CASES[name]
        nblocks = 4 * case.blocks
        table = PlanTable.build(spec(case, nblocks), spec(case, nblocks))
        assert table.path is PlanPath.RUNS, table.path
        rng = np.random.default_rng(1)
        requests = [(run_shuffled(rng, nblocks)[:case.blocks].astype(np.int64),
                     np.arange(case.blocks, dtype=np.int64)) for _ in range(16)]
        lids, rids = requests[0]
        use(None)
        want = table.plan(lids, rids)
        use(native)
        got = table.plan(lids, rids)
        assert np.array_equal(got.local, want.local) and np.array_equal(got.remote, want.remote)
        times: dict[str, list[float]] = {k: [] for k in ("c_warm", "numpy_warm", "c_cold",
                                                          "numpy_cold")}
        for i in range(args.reps):
            lids, rids = requests[i % len(requests)]
            order = [("c", native), ("numpy", None)]
            if i % 2:
                order.reverse()
            for mode in ("warm", "cold"):
                for label, helpers in order:
                    times[f"{label}_{mode}"].append(timed(table, lids, rids, helpers,
                                                          mode == "cold"))
        use(native)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows[name] = {"extents": got.descriptors, "blocks": case.blocks,
                      "median_us": {k: round(v * 1e6, 2) for k, v in med.items()},
                      "c_over_numpy_warm": med["c_warm"] / med["numpy_warm"],
                      "c_over_numpy_cold": med["c_cold"] / med["numpy_cold"]}
        r = rows[name]["median_us"]
        print(f"{name:>10}: {got.descriptors:5d} extents  warm C {r['c_warm']:7.1f} us, numpy "
              f"{r['numpy_warm']:7.1f} us ({rows[name]['c_over_numpy_warm']:.2f}x)   cold C "
              f"{r['c_cold']:7.1f} us, numpy {r['numpy_cold']:7.1f} us "
              f"({rows[name]['c_over_numpy_cold']:.2f}x)", flush=True)
    write_result("plan_cold", {"reps": args.reps, "cases": rows}, args.out)


if __name__ == "__main__":
    main()
