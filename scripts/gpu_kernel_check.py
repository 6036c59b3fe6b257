"""The batched device copy's kernels on a GPU, against a numpy reference: what CI checks of the
Triton kernel under Triton's interpreter (tests/gpucopy_interp.py), here for both kernels the
copier can use (CUDA C from NVRTC, Triton) on real device memory.

    python scripts/gpu_kernel_check.py [--cases N] [--out DIR]

Each case: random extent lengths (short ones, long ones cut into parts, a mix; unaligned ones
too), random source and destination alignments, destinations reached only through a region
map's delta (as a peer's memory is reached through our IPC mapping), records in pinned memory
from ``host_extents`` or in ordinary arrays (copied in pieces), and in some cases one extent
out of bounds: the post must then report failure, that extent's destination must be untouched,
and every other destination must hold either its source bytes or its old bytes. Writes
gpu_kernel_check.json (cases run and failed per kernel; exits 1 on any failure).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

SPACE = 64 << 20


def one_case(cp: Any, rng: np.random.Generator, src: Any, dst: Any, pinned: bool,
             bad: bool) -> str | None:
    """None if the copy matched the reference, else what went wrong."""
    import torch

    from kvlink.gpu.copy import RegionMap
    from kvlink.transport import make_extents

    kind = rng.integers(3)
    n = int(rng.integers(1, 300 if kind else 40))
    if kind == 0:  # long: parts
        lens = rng.integers(64 << 10, 1 << 20, n) // 16 * 16 + 16 * int(rng.integers(2))
    elif kind == 1:  # short
        lens = rng.integers(1, 64 << 10, n)
    else:  # blocks of one size, 16-byte multiples
        lens = np.full(n, int(rng.choice([512, 8192, 16384, 65536, 65552])))
    lens = lens.astype(np.int64)
    if lens.sum() + 64 * n > SPACE // 2:
        lens = np.minimum(lens, SPACE // 4 // n)
    salign, dalign = int(rng.integers(16)), int(rng.integers(16)) * int(rng.integers(2))
    gaps = rng.integers(0, 64, n) * 16
    soff = salign + np.concatenate([[0], np.cumsum(lens + gaps)[:-1]])
    order = rng.permutation(n)
    doff = np.zeros(n, np.int64)
    at = dalign
    for i in order:  # destinations in another order, reached through the map's delta
        doff[i] = at
        at += int(lens[i]) + 32
    src.random_(0, 255)
    dst.fill_(0xAB)
    sb, db = src.data_ptr(), dst.data_ptr()
    peer = 1 << 40  # the destination as the peer's address space
    se = make_extents((sb + soff).astype(np.uint64), lens.astype(np.uint64))
    de = make_extents((peer + doff).astype(np.uint64), lens.astype(np.uint64))
    badi = int(rng.integers(n)) if bad else -1
    if bad:
        de[badi]["addr"] = peer + SPACE - 8  # runs past the peer's region
    if pinned:
        ps, pd = cp.host_extents(n), cp.host_extents(n)
        ps[:], pd[:] = se, de
        se, de = ps, pd
    smap = RegionMap([sb], [sb + SPACE], [0], src.device)
    dmap = RegionMap([peer], [peer + SPACE], [db - peer], dst.device)
    p = cp.copy(se, smap, de, dmap, torch.cuda.current_stream())
    p.wait()
    if p.failed() != bad:
        return f"failed()={p.failed()} for a post {'with' if bad else 'without'} a bad extent"
    got = dst.cpu().numpy()
    want = src.cpu().numpy()
    for i in range(n):
        d = got[doff[i]:doff[i] + lens[i]]
        if i == badi:  # neither where it would have gone nor where it points
            if not (np.all(d == 0xAB) and np.all(got[SPACE - 8:] == 0xAB)):
                return f"bad extent {i} was written"
            continue
        s = want[soff[i]:soff[i] + lens[i]]
        if not np.array_equal(d, s) and not (bad and np.all(d == 0xAB)):
            return f"extent {i} of {n} (len {lens[i]}, kind {kind}) differs"
    return None


def main() -> None:
    import torch

    from kvlink.gpu.copy import BatchCopier

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cases", type=int, default=60)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    src = torch.empty(SPACE, dtype=torch.uint8, device=dev)
    dst = torch.empty(SPACE, dtype=torch.uint8, device=dev)
    res: dict[str, Any] = {"kernels": {}}
    bad_runs = 0
    for kernel in ("cuda", "triton"):
        cp = BatchCopier(dev, kernel=kernel, piece=64, first=16)  # small pieces: many launches
        rng = np.random.default_rng(1)
        failures = []
        for c in range(args.cases):
            err = one_case(cp, rng, src, dst, pinned=bool(c % 2), bad=c % 3 == 2)
            if err:
                failures.append(f"case {c}: {err}")
                print(kernel, "case", c, err, flush=True)
        res["kernels"][kernel] = {"cases": args.cases, "failures": failures}
        bad_runs += len(failures)
        print(kernel, "cases", args.cases, "failures", len(failures), flush=True)
    res["ok"] = bad_runs == 0
    _gpu_common.write(args.out, "gpu_kernel_check.json", res)
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
