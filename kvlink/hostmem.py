"""Raw host-memory access for transports that copy through the CPU (tcp, host staging).

Extents are absolute addresses inside registered regions (checked by the caller with a
RegionTable before any byte is touched). Views are memoryviews over that memory — no copies;
gather/scatter run one C memmove per extent over numpy arrays of addresses.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvlink.transport import Extents


def view(addr: int, nbytes: int) -> memoryview:
    """Writable memoryview of ``nbytes`` at ``addr`` (the memory must outlive the view)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def address_of(buf: memoryview | bytearray | np.ndarray) -> int:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return int(arr.__array_interface__["data"][0])


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum in uint64 (np.concatenate with a Python 0 would go float64)."""
    out = np.zeros(lengths.shape[0], dtype=np.uint64)
    np.cumsum(lengths[:-1], dtype=np.uint64, out=out[1:])
    return out


def gather(extents: Extents, dst: int) -> int:
    """Copy extents back to back into memory at ``dst``; returns the bytes copied."""
    offsets = _offsets(extents["len"])
    memmove = ctypes.memmove
    for a, n, o in zip(extents["addr"].tolist(), extents["len"].tolist(), offsets.tolist()):
        memmove(dst + o, a, n)
    return int(extents["len"].sum())


def scatter(src: int, extents: Extents) -> int:
    """Inverse of :func:`gather`: spread back-to-back bytes at ``src`` over ``extents``."""
    offsets = _offsets(extents["len"])
    memmove = ctypes.memmove
    for a, n, o in zip(extents["addr"].tolist(), extents["len"].tolist(), offsets.tolist()):
        memmove(a, src + o, n)
    return int(extents["len"].sum())


def frame_bounds(lengths: np.ndarray, target: int, alone: int | None = None) -> np.ndarray:
    """Split extents into frames of about ``target`` bytes; returns frame start indices + end.

    Deterministic from the lengths alone, so both ends of a connection agree on the framing
    without sending it. An extent starts a new frame when its start offset crosses a multiple of
    ``target``; an extent of ``alone`` bytes or more (default ``target``) travels alone, so it is
    sent zero-copy and received straight into place.
    """
    n = lengths.shape[0]
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    start = _offsets(lengths)
    bucket = start // np.uint64(target)
    big = lengths >= np.uint64(target if alone is None else alone)
    new = np.empty(n, dtype=bool)
    new[0] = True
    new[1:] = (bucket[1:] != bucket[:-1]) | big[1:] | big[:-1]
    return np.append(np.flatnonzero(new), n).astype(np.int64)
