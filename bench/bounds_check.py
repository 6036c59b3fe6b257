"""The bounds checks a tcp READ's two sides make before a byte moves, through C and numpy.

    .venv/bin/python bench/bounds_check.py [--reps 2000] [--out FILE]

The 16-block request of bench/e2e_request.py (80 layers, a region per layer, K and V planes of
4 KiB pages, the consumer's ids in runs of 1-8: ~630 extents): the consumer's check of its own
extents (``RegionTable.locate``) and the owner's whole refusal check (``_refusal``: the grant's
window, then the registered regions), each through kvlink's C helper (``inside``) and through
numpy (the path taken where the helper is not built), interleaved in one run, warm (median of
``--reps`` back-to-back calls per round, five rounds). Writes
bench/results/bounds_check.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import write_result

from kvlink import native
from kvlink.transport import Op, Region, TransportContext, make_extents
from kvlink_transports.tcp import TcpTransport

LAYERS, PAGE, BLOCKS, REQUEST = 80, 4096, 128, 16


def _extents(bufs: list[np.ndarray], rng: np.random.Generator) -> Any:
    """A request's extents: per layer and plane, its 16 blocks in runs of 1-8."""
    addrs, lens = [], []
    for b in bufs:
        base = int(b.__array_interface__["data"][0])
        for plane in range(2):
            off = 0
            while off < REQUEST:
                run = min(int(rng.integers(1, 9)), REQUEST - off)
                addrs.append(base + (plane * BLOCKS + off) * PAGE)
                lens.append(run * PAGE)
                off += run
    return make_extents(np.array(addrs, np.uint64), np.array(lens, np.uint64))


def _median_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    helpers = native.load()
    if helpers is None:
        raise SystemExit(f"kvlink's C helpers are not built here: {native.why_not()}")
    bufs = [np.zeros(2 * BLOCKS * PAGE, np.uint8) for _ in range(LAYERS)]
    t = TcpTransport(TransportContext("bench", require_grants=True))
    try:
        t.register([Region(int(b.__array_interface__["data"][0]), b.nbytes) for b in bufs])
        ext = _extents(bufs, np.random.default_rng(0))
        whole = make_extents([int(b.__array_interface__["data"][0]) for b in bufs],
                             [b.nbytes for b in bufs])
        t.grant(b"ticket", Op.READ, whole)
        calls = {"locate": lambda: t._memory.table.locate(ext),
                 "owner_refusal": lambda: t._refusal(Op.READ, b"ticket", ext)}
        got: dict[str, dict[str, list[float]]] = {k: {"c": [], "numpy": []} for k in calls}
        for _ in range(5):
            for path in ("c", "numpy"):
                # numpy's path: the helpers as load() answers where they are not built
                native._loaded["launch"] = helpers if path == "c" else None
                for name, fn in calls.items():
                    got[name][path].append(_median_us(fn, args.reps))
        native._loaded["launch"] = helpers
    finally:
        t.close()
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in got.items()}
    for k, d in med.items():
        print(f"{k:14s} C {d['c']:6.1f} us   numpy {d['numpy']:6.1f} us   "
              f"{d['numpy'] / d['c']:.1f}x")
    write_result("bounds_check", {
        "extents": int(ext.shape[0]), "regions": LAYERS, "reps": args.reps,
        "warm_median_us": med, "rounds_us": got,
        "ratio_numpy_over_c": {k: d["numpy"] / d["c"] for k, d in med.items()},
    }, args.out)


if __name__ == "__main__":
    main()
