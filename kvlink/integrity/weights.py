"""The digest's arithmetic, shared by every path that computes one (host, device, kernel).

A digest is a weighted sum, modulo 2**64, of a head's words in logical order; the weights are
odd and fixed by each word's (token, word) position, so both sides of a transfer agree on them
without exchanging anything (:func:`weights`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.sampling import mix

U64 = npt.NDArray[np.uint64]
Planes = Sequence[Sequence[Any]]  # [layer][plane] -> (blocks, heads, tokens, head bytes) uint8


def word_bytes(head_bytes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) a head of ``head_bytes`` is made of: what its
    digest sums over."""
    return next(w for w in (8, 4, 2, 1) if head_bytes % w == 0)


@functools.lru_cache(maxsize=64)
def weights(tokens: int, words: int) -> U64:
    """Odd weights, one per (token, word) of a head: fixed, so both sides agree."""
    with np.errstate(over="ignore"):
        seq = np.arange(1, tokens * words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        w = mix(seq) | np.uint64(1)
    w.setflags(write=False)
    return w.reshape(tokens, words)


def per_planes(cache: dict[int, tuple[Planes, Any]], planes: Planes,
               build: Callable[[Planes], Any]) -> Any:
    """``build(planes)``, made once per planes object (a worker's, fixed at register) and
    kept in ``cache`` by its id, with the planes themselves (an id reused by other planes is
    built anew); the last 64 kept."""
    got = cache.get(id(planes))
    if got is None or got[0] is not planes:
        if len(cache) > 64:
            cache.clear()
        got = cache[id(planes)] = (planes, build(planes))
    return got[1]
