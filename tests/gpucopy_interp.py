"""The batched-copy kernel (kvlink.gpu.kernels.move) under Triton's interpreter.

Run by tests/test_cuda_ipc.py in a subprocess with TRITON_INTERPRET=1 (the variable must be set
before Triton compiles anything). Source extents live in one buffer, destinations in another
that the kernel reaches only through a region map's delta, as it reaches a peer's memory
through our IPC mapping. Prints "interp ok" when every case matches numpy's reference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvlink.gpu import kernels

SPACE = 1 << 16
SEQ = 7


def run(lens: list[int], src_align: int, dst_align: int, parts: int, rows: int, piece: int,
        bad: int | None = None) -> None:
    n = len(lens)
    srcbuf = torch.randint(0, 255, (SPACE,), dtype=torch.uint8)
    dstbuf = torch.zeros(SPACE, dtype=torch.uint8)
    sb, db = srcbuf.data_ptr(), dstbuf.data_ptr()
    soff = np.cumsum([0] + [x + 16 for x in lens[:-1]]).astype(np.int64) + src_align
    doff = np.zeros(n, np.int64)  # destinations in reverse order, in the peer's address space
    at = dst_align
    for i in reversed(range(n)):
        doff[i], at = at, at + lens[i] + 32
    src = np.zeros((n, 2), np.int64)
    dst = np.zeros((n, 2), np.int64)
    src[:, 0], src[:, 1] = sb + soff, lens
    dst[:, 0], dst[:, 1] = doff, lens
    if bad is not None:
        dst[bad, 0] = SPACE  # one past the peer's region
    smap = torch.tensor([sb, sb + SPACE, 0], dtype=torch.int64)  # (start, end, delta)
    dmap = torch.tensor([0, SPACE, db], dtype=torch.int64)
    sr, dr = torch.from_numpy(src.reshape(-1)), torch.from_numpy(dst.reshape(-1))
    status = torch.zeros(1, dtype=torch.int64)
    for p0 in range(0, n, piece):
        k = min(n, p0 + piece) - p0
        kernels.move[(-(-k // rows), parts)](
            sr.data_ptr() + 16 * p0, dr.data_ptr() + 16 * p0, k, smap.data_ptr(), 1,
            dmap.data_ptr(), 1, status.data_ptr(), SEQ, parts, E=rows, BLOCK=16)
    want = torch.zeros(SPACE, dtype=torch.uint8)
    for i, length in enumerate(lens):
        same_program = bad is not None and i // piece == bad // piece and \
            (i % piece) // rows == (bad % piece) // rows
        if not same_program:
            want[doff[i] : doff[i] + length] = srcbuf[soff[i] : soff[i] + length]
    case = (lens, src_align, dst_align, parts, rows, piece, bad)
    assert torch.equal(dstbuf, want), case
    assert (int(status.item()) == SEQ) == (bad is not None), case


def main() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        lens = [int(x) * (16 if rng.random() < 0.5 else 1) for x in rng.integers(1, 300, n)]
        run(lens, int(rng.choice([0, 16])), int(rng.choice([0, 16, 3])),
            int(rng.integers(1, 4)), int(rng.choice([1, 2])), int(rng.integers(2, 5)))
    run([64, 128, 32, 48, 16, 16, 200], 0, 0, 2, 2, 3, bad=4)
    run([5, 7, 9], 3, 1, 1, 1, 3, bad=0)
    print("interp ok")


if __name__ == "__main__":
    main()
