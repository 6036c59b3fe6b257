"""Which blocks ``sample`` integrity checks: a rule both sides apply to what both know.

:mod:`kvlink.integrity` decides with it what a producer digests and what its consumer checks;
:mod:`kvlink.gpu.lane` (and its C twin, ``kvlink/_native.c``'s ``post``) orders a cuda_ipc
READ's blocks with it, so that the copy kernel takes the checked ones first. A leaf, so that
the GPU layer, below integrity, applies the very same rule.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: ``sample`` checks about one block in this many, and the last one (its cost: a 1 GiB
#: request over tcp checks ~18 MiB, ~1 % of the transfer; docs/integrity.md)
SAMPLE_EVERY = 64

U64 = npt.NDArray[np.uint64]


def mix(x: U64) -> U64:
    """splitmix64's finaliser (arrays: their arithmetic wraps): spreads consecutive ids."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def picked(salt: int, block_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """The positions of ``block_ids`` that ``sample`` checks under the 64-bit ``salt``: those
    whose id, mixed with it, falls in one of :data:`SAMPLE_EVERY` buckets, and the last one
    always (every reader reads a request's tail, whatever its own prefix hits)."""
    with np.errstate(over="ignore"):
        mixed = mix(block_ids.view(np.uint64) ^ np.uint64(salt))
    keep: npt.NDArray[np.bool_] = np.asarray(mixed % np.uint64(SAMPLE_EVERY) == 0)
    if keep.size:
        keep[-1] = True
    return keep
