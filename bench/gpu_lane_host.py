"""A lane post's host time by e2e case: the 70B TP8-rank request against the 8B TP1 one (GPU).

    python bench/gpu_lane_host.py [--reps 200] [--classes 1024,1536,4000] [--out FILE]

Why: through the public API the 8B request's post phase (``read()`` to its launch's return and
the bookkeeping after it) is ~25 us longer than the 70B request's in the same start of the
device machine, warm and cold alike (bench/results/gpu_device_timed/e2e.json: medians 100-105
against 74-78 us one at a time, 45-50 against 30-34 us in flight) — the same 256 block ids,
the same code. This times one layer of that path for both, in one process on a vLLM-shaped
cache (a region per layer, decode ids in shuffled runs of 1-8): ``BatchCopier.copy_lane``
(the copier's work before and after the launch) and, inside it, the C launcher's call (ids
into the launch's parameters, the caller's stream queried, ``cuLaunchKernel``, the end mark),
each post right after a sweep of the host's caches (``cold``, what a request meets) and back
to back (``warm``), the cases interleaved in random order. Every copy is checked to end
unfailed; the first of each case byte for byte. Writes bench/results/gpu_lane_host.json.

``--classes``: each case also with its launch's table in each of these size classes (words,
kvlink.gpu.move.PARAM_WORDS; a class it does not fit is left out), ``<case>@<words>``: what
the driver's copy of a launch's parameters costs by their size — the launcher's call, and
the post until a loop sees its end word (``done``), the same copy whatever the class.
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

from _common import sweep, write_result
from _lane_cache import plane_bases, region_map, shuffled_ids

#: (layers, KV heads) of each case (bench/e2e_request.py's); 16 tokens, head size 128, bf16
CASES = {"70b-tp8": (80, 1), "8b-tp1": (32, 8)}
TOKENS, DIM, BLOCKS = 16, 128, 256


class _Case:
    """One case's cache pair, lane and timed launcher call."""

    def __init__(self, torch: Any, copier: Any, name: str, rng: np.random.Generator,
                 words: int = 0) -> None:
        from kvlink.gpu import move

        layers, heads = CASES[name]
        dev = copier.device
        self.sblocks, self.dblocks = BLOCKS + 8, BLOCKS + 64
        self.src = [torch.randn(2, self.sblocks, TOKENS, heads, DIM, dtype=torch.bfloat16,
                                device=dev) for _ in range(layers)]
        self.dst = [torch.zeros(2, self.dblocks, TOKENS, heads, DIM, dtype=torch.bfloat16,
                                device=dev) for _ in range(layers)]
        unit = TOKENS * heads * DIM * 2
        classes = move.PARAM_WORDS
        if words:  # this case's launches in that size class only (set while its lane binds)
            move.PARAM_WORDS = (words,)
        try:
            lane = copier.lane(plane_bases(self.src, self.sblocks, unit),
                               plane_bases(self.dst, self.dblocks, unit), unit,
                               (self.sblocks, self.dblocks), region_map(self.src, dev),
                               region_map(self.dst, dev))
            assert lane is not None and lane.fits(BLOCKS)
        finally:
            move.PARAM_WORDS = classes
        self.lane, self.unit, self.layers = lane, unit, layers
        self.sids, self.dids = shuffled_ids(rng, BLOCKS)
        self.inner: list[float] = []  # the launcher's call, seconds
        post = lane.post

        def timed(*args: Any, **kw: Any) -> None:
            t = time.perf_counter()
            post(*args, **kw)
            self.inner.append(time.perf_counter() - t)

        lane.post = timed  # type: ignore[method-assign]
        launch, grid, parts = lane.launches[BLOCKS]
        self.shape = {"grid": grid, "threads": launch.threads, "parts_per_block": parts,
                      "table_words": int(launch.table.shape[0]), "unit_bytes": unit,
                      "segments": lane.segments}

    def verify(self, torch: Any) -> bool:
        si = torch.from_numpy(self.sids).to(self.src[0].device)
        di = torch.from_numpy(self.dids).to(self.src[0].device)
        return all(torch.equal(d[:, di], s[:, si]) for s, d in zip(self.src, self.dst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--classes", default="",
                    help="comma-separated table size classes (words) to run each case in too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from kvlink.gpu.copy import BatchCopier

    dev = torch.device("cuda:0")
    copier = BatchCopier(dev)
    assert copier.computes_addresses and copier._cuda is not None
    native = copier._cuda.launcher is not None
    rng = np.random.default_rng(0)
    cases = {name: _Case(torch, copier, name, rng) for name in CASES}
    for words in (int(w) for w in args.classes.split(",") if w.strip()):
        for name in CASES:
            try:
                c = _Case(torch, copier, name, rng, words)
            except AssertionError:  # (a class it does not fit: left out)
                continue
            if c.shape["table_words"] == words:
                cases[f"{name}@{words}"] = c
    stream = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    verified = {}
    for name, c in cases.items():
        p = copier.copy_lane(c.lane, c.sids, c.dids, stream, None)
        p.wait()
        verified[name] = not p.failed() and c.verify(torch)
    host: dict[str, list[float]] = {f"{n}/{m}": [] for n in cases for m in ("cold", "warm")}
    inner: dict[str, list[float]] = {k: [] for k in host}
    done: dict[str, list[float]] = {k: [] for k in host}
    for i in range(args.reps + 10):
        for key in rng.permutation(list(host)).tolist():
            name, mode = key.split("/")
            c = cases[name]
            stream.synchronize()
            if mode == "cold":
                sweep()
            else:  # two untimed posts first: its code and data hot
                for _ in range(2):
                    copier.copy_lane(c.lane, c.sids, c.dids, stream, None).wait()
            c.inner.clear()
            t0 = time.perf_counter()
            p = copier.copy_lane(c.lane, c.sids, c.dids, stream, None)
            took = time.perf_counter() - t0
            while not p.done():  # (a loop, as a caller polling for it)
                pass
            seen = time.perf_counter() - t0
            assert not p.failed(), key
            if i >= 10:
                host[key].append(took)
                inner[key].extend(c.inner[-1:])
                done[key].append(seen)
    us = 1e6
    med = {k: statistics.median(v) * us for k, v in host.items()}
    med_inner = {k: statistics.median(v) * us for k, v in inner.items() if v}
    med_done = {k: statistics.median(v) * us for k, v in done.items()}
    for k in host:
        print(f"{k:20s} copy_lane {med[k]:6.1f} us   launcher "
              f"{med_inner.get(k, float('nan')):6.1f} us   done {med_done[k]:6.1f} us")
    out = {"reps": args.reps, "launcher": "native" if native else "ctypes",
           "verified": verified, "shapes": {n: c.shape for n, c in cases.items()},
           "copy_lane_host_median_us": med, "launcher_call_median_us": med_inner,
           "post_to_done_median_us": med_done,
           "raw_us": {k: [x * us for x in v] for k, v in host.items()},
           "raw_launcher_us": {k: [x * us for x in v] for k, v in inner.items()},
           "raw_done_us": {k: [x * us for x in v] for k, v in done.items()}}
    write_result("gpu_lane_host", out, args.out)
    sys.exit(0 if all(verified.values()) else 1)


if __name__ == "__main__":
    main()
