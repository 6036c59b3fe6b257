"""What each host step of a pulled request costs cold (as a request meets it) and hot, on CPU.

    .venv/bin/python bench/host_steps.py [--reps 300] [--out bench/results/host_steps.json]

Why: through the public API a request's host work on the GPU machine measured several times
what the same calls cost back to back (docs/e2e.md: the cuda_ipc post 148-186 us inside a
request, the 70B request's ``copy_runs`` 16 us hot), and integrity's steps add ~55 us to a
READ whose kernel adds ~0 (docs/integrity.md, ``bench/results/gpu_checks_e6d9130/``). Between
two requests a serving process does other work — here, as in ``bench/e2e_request.py``'s
verification, a sweep over 32 MiB and a burst of Python — which evicts the caches a step's
code and data were in. Each step below is timed right after such a sweep ("cold") and then
back to back ("hot", the same-run baseline); the ratio says how much of a step's cost inside
a request is its cold start rather than its work. Steps: the plan of a 70B TP8-rank request
(80 layers, 256 shuffled blocks: ids checked, the runs), the board-validated READ's own (its
grant ticket, the block ids' fingerprint), and what integrity adds to it: through a peer's
digest lane (every READ after the peer's first, since 733be9d), nothing — the kernel picks
the blocks and finds their rows on the board; on the general path, the hold's digests
located on a real hold board — slot, head, the rows copied — the job, the transport's
fusability check, its larger launch table. CPU only: no device, the same Python a GPU host
runs. Writes bench/results/host_steps.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import sweep, write_result
from planner import NBLK, fake_spec, shuffled_runs

from kvlink import integrity
from kvlink.grants import read_ticket
from kvlink.holdboard import BoardView, HoldBoard, fingerprint
from kvlink.layout import Layout
from kvlink.plan import PlanTable
from kvlink.transport import DigestJob, Op
from kvlink_transports.cuda_ipc import CudaIpcTransport


def timed(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    cold, hot = [], []
    for _ in range(reps):
        sweep()
        t0 = time.perf_counter()
        fn()
        cold.append(time.perf_counter() - t0)
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        hot.append(time.perf_counter() - t0)
    c, h = statistics.median(cold) * 1e6, statistics.median(hot) * 1e6
    return {"cold_us": round(c, 2), "hot_us": round(h, 2), "cold_over_hot": round(c / h, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rng = np.random.default_rng(1)
    ours = fake_spec(2 * NBLK + 128, 1, Layout.NHD, 1 << 40)
    theirs = fake_spec(2 * NBLK, 1, Layout.NHD, 1 << 41)
    lids = shuffled_runs(rng, ours.num_blocks, NBLK)
    rids = np.arange(NBLK, dtype=np.int64)
    table = PlanTable.for_peer(ours, theirs)
    runs = table.runs(lids, rids, coalesce=False)
    assert runs is not None

    board = HoldBoard()
    view = BoardView.open(board.name, board.token)
    assert view is not None
    gen = (7 << 20) | 7
    mask = integrity.checked(integrity.Level.SAMPLE, "r-1", rids)
    rows = np.where(mask, np.cumsum(mask) - 1, -1).astype(np.int64)
    per = 2 * ours.num_layers  # digest words a row: planes x heads
    blob = integrity.pack((rids[mask].tolist(), bytes(8 * per * int(mask.sum())), False), rows)
    assert board.publish(gen, rids, blob)
    at = view.digest_area(gen, None)
    on_board = integrity.board_rows(view, gen)
    assert at is not None and on_board is not None
    job = DigestJob(1, 2, per, 1, ours.page_bytes, NBLK, on_board.count, on_board.rows,
                    on_board.address, on_board.region)

    steps: dict[str, Callable[[], Any]] = {
        # every READ
        "read: local ids checked": lambda: ours.check_block_ids(lids),
        "plan: runs (remote ids checked, one run per block)": lambda: table.runs(
            lids, rids, local_checked=True, coalesce=False),
        "read: grant ticket": lambda: read_ticket("70b-tp8-spin-12", gen),
        "read: block ids' fingerprint": lambda: fingerprint(rids),
        "post: launch table (plain copy)": lambda: np.concatenate(
            [runs.remote_base, runs.local_base, runs.remote_at, runs.local_at, runs.lens]),
        # what integrity adds on the general path (a peer's first READ, or one no lane
        # takes); through a digest lane, nothing (since 733be9d the kernel picks the blocks
        # and finds their rows on the board)
        "integrity: slot read": lambda: view.digest_area(gen, None),
        "integrity: digest head read": lambda: view.words(at[0], 4),
        "integrity: rows copied": lambda: view.int64s(at[0] + 32, NBLK),
        "integrity: board_rows (the three above)": lambda: integrity.board_rows(view, gen),
        "integrity: the job": lambda: DigestJob(1, 2, per, 1, ours.page_bytes, NBLK,
                                                on_board.count, on_board.rows,
                                                on_board.address, on_board.region),
        "integrity: transport's fusability check": lambda: CudaIpcTransport._fusable(
            Op.READ, runs, job),
        "integrity: launch table (fused)": lambda: np.concatenate(
            [runs.remote_base, runs.local_base, runs.remote_at, runs.local_at,
             job.rows.view(np.uint64)]),
    }
    try:
        got = {name: timed(fn, args.reps) for name, fn in steps.items()}
    finally:
        board.close()
    for name, r in got.items():
        print(f"  {name:52s} cold {r['cold_us']:7.1f} us  hot {r['hot_us']:6.1f} us  "
              f"{r['cold_over_hot']:5.1f}x")
    added = [n for n in got if n.startswith("integrity:") and "(the three above)" not in n
             and "launch table" not in n]

    total = {k: round(sum(got[n][k] for n in added), 1) for k in ("cold_us", "hot_us")}
    print(f"  integrity's own steps on the general path (not the table's extra words): cold "
          f"{total['cold_us']} us, hot {total['hot_us']} us (through a digest lane: none)")
    write_result("host_steps", {
        "what": "median per call after a 32 MiB + Python sweep (cold) and back to back (hot)",
        "reps": args.reps, "request": "70B TP8 rank: 80 layers, 1 KV head, 256 blocks",
        "steps": got, "integrity_steps": added, "integrity_steps_total": total,

    }, args.out)


if __name__ == "__main__":
    main()
