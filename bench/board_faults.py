"""A READ's after-check on the hold board, cold, as a serving pair meets it: page faults and time.

    .venv/bin/python bench/board_faults.py [--holds 400] [--out PATH]

(default PATH: bench/results/board_faults/board_faults.json)

Why: a hold's slot on the producer's board is picked by its generation's low bits, so each
new hold lands on a page the producer may be writing for the first time. The reader's mapping
then has no entry for that page, and its after-check — on the poll that sees a READ DONE —
takes a minor page fault. Board and view now map the header and every slot when they are made
(``kvlink.holdboard._fault_in``).

This bench publishes holds one at a time on a fresh board, each followed by the reader's
after-check. Before each check it sweeps the caches (``_common.sweep``, as a request meets
the check after the serving process's other work) and times the check. It counts the
calling thread's minor faults (``RUSAGE_THREAD``).

Two series, interleaved hold by hold:
- ``view``: a view opened as kvlink opens it;
- ``unmapped``: a view of the same board mapped without the fault-in (the reader before
  this change), the same-run baseline.

The producer's board is made as kvlink makes it, so ``unmapped`` faults only where the
producer's fault-in does not reach the reader. Linux only. Writes
bench/results/board_faults/board_faults.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import sweep, write_result

from kvlink import shmfile
from kvlink.holdboard import KIND, SLOTS, BoardView, HoldBoard


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holds", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                         / "board_faults" / "board_faults.json"))
    args = ap.parse_args()
    board = HoldBoard()
    view = BoardView.open(board.name, board.token)
    opened = shmfile.open_board(KIND, board.name, board.token, writable=False, what="bench")
    assert view is not None and opened is not None
    unmapped = BoardView(*opened)  # (no fault-in: the reader's mapping before this change)
    rng = np.random.default_rng(args.seed)
    ids = np.arange(256, dtype=np.int64)  # a 70B TP8-rank request's blocks
    series: dict[str, dict[str, list[float]]] = {k: {"us": [], "faults": []}
                                                for k in ("view", "unmapped")}
    try:
        for slot in rng.permutation(SLOTS)[:args.holds].tolist():
            for name in rng.permutation(list(series)).tolist():  # a fresh order every hold
                gen = (int(rng.integers(1, 1 << 40)) << 16) | slot
                assert board.publish(gen, ids)
                check = (view if name == "view" else unmapped).after_check(gen, ids)
                sweep()
                f0 = _faults()
                t0 = time.perf_counter()
                ok = check()
                dt = time.perf_counter() - t0
                series[name]["faults"].append(float(_faults() - f0))
                series[name]["us"].append(dt * 1e6)
                assert ok
                board.withdraw(gen)
    finally:
        unmapped.close()
        view.close()
        board.close()
    out = {}
    for name, s in series.items():
        us, faults = np.array(s["us"]), np.array(s["faults"])
        out[name] = {
            "checks": len(us),
            "checks_that_faulted": int((faults > 0).sum()),
            "median_us": round(float(np.median(us)), 2),
            "p90_us": round(float(np.percentile(us, 90)), 2),
            "median_us_of_checks_that_faulted": (round(float(np.median(us[faults > 0])), 2)
                                                 if (faults > 0).any() else None),
        }
        print(f"  {name:9s} {out[name]['checks_that_faulted']:4d} of {len(us)} checks "
              f"faulted; median {out[name]['median_us']:.1f} us, p90 "
              f"{out[name]['p90_us']:.1f} us")
    ratio = statistics.median(series["view"]["us"]) / statistics.median(series["unmapped"]["us"])
    print(f"  view / unmapped, median: {ratio:.2f}")
    write_result("board_faults", {
        "what": "a READ's after-check on the hold board right after its hold was published on "
                "a random slot, cold (after a cache sweep): time and the thread's minor faults",
        "holds": args.holds, "series": out, "median_view_over_unmapped": round(ratio, 3),
    }, args.out)


if __name__ == "__main__":
    main()
