"""Digests on the wire and on the hold board: the forms a verdict, a push's note and the
producer's board carry them in, and where a reader finds them on the board without a copy."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.integrity.weights import U64

#: (block ids, little-endian u64 digests, folded): lists and bytes off the wire, views of
#: the hold board's copy (:func:`unpack`)
Digests = tuple[Sequence[int] | npt.NDArray[np.int64], bytes | memoryview, bool]
WireDigests = tuple[list[int], bytes, bool]  # what a verdict or a push's note carries
#: a landing board's digest area, opened for a push's digests (kvlink.landing.DigestArea.open
#: with the push's tag): (the decode's block ids, (layers, planes, heads)) -> where they go,
#: ``[layers x planes, k, heads]`` words, or None where they do not fit
AreaOpener = Callable[[npt.NDArray[np.int64], tuple[int, ...]], "U64 | None"]


_BOARD_HEAD = 4  # words: digests, folded, positions, words per digest row


def pack(got: WireDigests, rows: npt.NDArray[np.int64]) -> bytes:
    """``got`` as one blob for the hold board's arena (kvlink.holdboard), little-endian
    64-bit words: (digests k, folded, positions n, words per row), then per held position the
    row of its digest (-1: not digested), the k block ids, the k rows of digests. The rows
    let a reader's copy kernel compare in place (:func:`board_rows`)."""
    ids, blob, folded = got
    per = len(blob) // 8 // max(len(ids), 1)
    head = np.array([len(ids), int(folded), rows.shape[0], per], dtype="<u8").tobytes()
    return (head + np.asarray(rows, dtype="<i8").tobytes()
            + np.asarray(ids, dtype="<i8").tobytes() + blob)


def unpack(raw: bytes) -> Digests | None:
    """:func:`pack`'s (block ids, digests, folded), as views of ``raw`` (no copy); None for a
    blob that is not one (the caller then asks)."""
    if len(raw) < 8 * _BOARD_HEAD or len(raw) % 8:
        return None
    k, folded, n, _ = (int(x) for x in np.frombuffer(raw, dtype="<u8", count=_BOARD_HEAD))
    at = 8 * (_BOARD_HEAD + n)
    if folded > 1 or at + 8 * k > len(raw):
        return None
    ids = np.frombuffer(raw, dtype="<i8", count=k, offset=at)
    return ids, memoryview(raw)[at + 8 * k:], bool(folded)


@dataclasses.dataclass(slots=True)
class BoardRows:
    """Where a hold's digests lie on its producer's hold board, for a reader's copy kernel
    to compare with what it lands in place (kvlink.transport.DigestJob): host addresses, in
    the reader's mapping ``region``, of the row per held position and of the digest rows."""

    blocks: int  # held positions
    count: int  # digest rows
    folded: bool
    row_words: int
    rows: npt.NDArray[np.int64]  # [blocks] each held position's digest row (-1: none), copied
    address: int  # host address of digest row 0
    region: tuple[int, int]  # the board mapping: (host address, bytes)


def board_rows(view: Any, generation: int, fp: int | None = None) -> BoardRows | None:
    """The digest rows ``generation``'s hold published on ``view`` (a holdboard.BoardView),
    located without copying them (the row per held position is copied: it travels with the
    copy kernel's launch); None where it shows none (``fp``: only over those block ids). What
    was read there counts only if the hold is still shown over the reader's blocks after it:
    the reader's after-check once its READ is done (the pages are given back only after the
    withdrawal, and a generation never comes back)."""
    area = view.digest_area(generation, fp)
    if area is None:
        return None
    at, nbytes = area
    k, folded, n, per = view.words(at, _BOARD_HEAD)
    rows = 8 * _BOARD_HEAD
    start = rows + 8 * (n + k)
    if folded > 1 or start + 8 * k * per > nbytes:
        return None
    # every position digested (``full``): :func:`pack`'s rows are 0..n-1, not read (one step
    # less on each READ's path; rows that said otherwise would only make the compare fail)
    got = _in_order(n) if k == n else view.int64s(at + rows, n)
    return BoardRows(n, k, bool(folded), per, got, view.region[0] + at + start, view.region)


@functools.lru_cache(maxsize=64)
def _in_order(n: int) -> npt.NDArray[np.int64]:
    """0..n-1, read-only: the rows of a hold whose every position is digested."""
    got = np.arange(n, dtype=np.int64)
    got.flags.writeable = False
    return got
