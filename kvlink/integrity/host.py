"""Digests of host memory: one C call over every plane where kvlink's helpers are built
(:mod:`kvlink.native`), else one vectorised numpy pass per plane.

What a plane's reading costs to work out (aligned word views, whole-row views of a dense
page) is kept per plane: a worker's planes are fixed at register, and making the views costs
more than a small request's gather."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvlink.integrity.weights import U64, Planes, per_planes, weights, word_bytes


def _as_words(pages: npt.NDArray[np.uint8], word: int) -> npt.NDArray[Any] | None:
    """The same memory as ``(B, H, N, hb / word)`` unsigned words, where it is aligned."""
    ptr = int(pages.__array_interface__["data"][0])
    strides = pages.strides
    if (ptr | strides[0] | strides[1] | strides[2]) % word or strides[3] != 1:
        return None
    span = sum((n - 1) * st for n, st in zip(pages.shape[:3], strides[:3])) + pages.shape[3]
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(ptr)).view(f"<u{word}")
    return np.lib.stride_tricks.as_strided(
        raw, (*pages.shape[:3], pages.shape[3] // word), (*strides[:3], word), writeable=False)


class _Rows(NamedTuple):
    """How a host plane's blocks are read (:func:`_plane_rows`): worked out once per plane."""

    word: int  # bytes per word
    words: npt.NDArray[Any] | None  # (B, H, N, W) unsigned words; None: unaligned
    rows: npt.NDArray[Any] | None  # (B, H·N·W) whole rows of a dense page (HND or NHD)
    hnd: bool  # the rows' order: heads outermost (else tokens)


#: id(plane) -> (a weak reference to it, how it is read): the views in it are made from the
#: plane's address and keep nothing alive; a plane gone is a miss (its id may be reused)
_ROWS: dict[int, tuple[weakref.ref[npt.NDArray[Any]], _Rows]] = {}


def _plane_rows(pages: npt.NDArray[np.uint8]) -> _Rows:
    """How ``pages`` is read, kept per plane (a worker's planes are fixed at register): its
    views cost more to make than a small request's gather of the plane, and a 70B rank has
    160 planes to make them for at every check."""
    got = _ROWS.get(id(pages))
    if got is not None and got[0]() is pages:
        return got[1]
    word = word_bytes(int(pages.shape[3]))
    words = _as_words(pages, word)
    rows, hnd = None, False
    if words is not None:
        b, h, n, w = words.shape
        sb, sh, sn, _ = words.strides
        hnd = sh == n * w * word and sn == w * word
        nhd = sn == h * w * word and sh == w * word
        if hnd or nhd:
            rows = np.lib.stride_tricks.as_strided(words, (b, h * n * w), (sb, word),
                                                   writeable=False)
    how = _Rows(word, words, rows, hnd)
    if len(_ROWS) > 4096:
        _ROWS.clear()
    _ROWS[id(pages)] = (weakref.ref(pages), how)
    return how


def _gather(how: _Rows, ids: npt.NDArray[np.int64], h0: int, h1: int) -> npt.NDArray[Any]:
    """``words[ids, h0:h1]`` as (n, heads, N, W), fast: a dense page (HND or NHD) is gathered
    as whole rows (one contiguous copy per block) and re-viewed in logical order, instead of
    an element-wise copy through four strides (10x slower on a 16 MiB plane)."""
    assert how.words is not None
    if how.rows is None:
        return np.ascontiguousarray(how.words[ids, h0:h1])
    _, h, n, w = how.words.shape
    taken = how.rows[ids]
    if how.hnd:
        return taken.reshape(-1, h, n, w)[:, h0:h1]
    return taken.reshape(-1, n, h, w).transpose(0, 2, 1, 3)[:, h0:h1]


def numpy_plane(pages: npt.NDArray[np.uint8], ids: npt.NDArray[np.int64], h0: int,
                h1: int) -> U64:
    """``[blocks, heads]`` digests of one host plane's blocks ``ids``, heads ``[h0, h1)``:
    the path where kvlink's C helpers are not built or cannot read the planes."""
    hb = int(pages.shape[3])
    how = _plane_rows(pages)
    word = how.word
    if how.words is not None:
        x = _gather(how, ids, h0, h1)
    else:
        x = np.ascontiguousarray(pages[ids, h0:h1]).view(f"<u{word}")
    if word != 8:
        x = x.astype(np.uint64)
    w = weights(int(pages.shape[2]), hb // word)
    # one pass, no temporary (5x the multiply-then-sum); uint64 arithmetic wraps mod 2**64
    return np.asarray(np.einsum("bhtw,tw->bh", x, w), dtype=np.uint64)


_UNSET: Any = object()
_c_helpers: Any = _UNSET  # kvlink.native's module, once looked up (None: not built)
#: id(planes) -> (planes, their C table or None: kvlink.native's digest cannot read them)
HOST_TABLES: dict[int, tuple[Planes, Any]] = {}


def native_digest(planes: Planes, ids: npt.NDArray[np.int64], h0: int, h1: int,
                  out: U64) -> bool:
    """The digests of host planes into ``out`` in one C call (kvlink.native's ``digest``:
    every plane, each word read once in place, without the GIL), where kvlink's
    C helpers build and every plane is whole aligned 8-byte words (a head of 2^k x 8 bytes,
    as every KV head is); False: numpy's path. Ids outside a plane raise IndexError, as
    numpy's indexing does."""
    global _c_helpers
    if _c_helpers is _UNSET:
        from kvlink import native

        _c_helpers = native.load()
    if _c_helpers is None:
        return False
    got = per_planes(HOST_TABLES, planes, _host_table)
    if got is None:
        return False
    table, blocks = got
    first = planes[0][0]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= blocks):
        raise IndexError(f"block ids outside [0, {blocks}): {ids.min()}..{ids.max()}")
    if not 0 <= h0 < h1 <= int(first.shape[1]):
        raise IndexError(f"heads [{h0}, {h1}) outside [0, {first.shape[1]})")
    tokens, words = int(first.shape[2]), int(first.shape[3]) // 8
    _c_helpers.digest(table, np.ascontiguousarray(ids, dtype=np.int64),
                      weights(tokens, words), out, h0, tokens, words)
    return True


def _host_table(planes: Planes) -> tuple[npt.NDArray[np.int64], int] | None:
    """(address, block stride, head stride, token stride) per plane, and the fewest blocks
    a plane holds — for kvlink.native's ``digest`` —, or None where a plane is not whole
    aligned 8-byte words of one shape (numpy's path takes those)."""
    rows, shape = [], tuple(planes[0][0].shape[1:])
    for view in (v for row in planes for v in row):
        how = _plane_rows(view)
        if how.word != 8 or how.words is None or tuple(view.shape[1:]) != shape:
            return None
        rows.append((int(view.__array_interface__["data"][0]), *view.strides[:3]))
    blocks = min(int(v.shape[0]) for row in planes for v in row)
    return np.array(rows, dtype=np.int64), blocks
