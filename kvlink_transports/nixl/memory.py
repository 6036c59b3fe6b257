"""Registered memory as NIXL lists it: memory kinds, descriptor lists, block indices.

A region is DRAM device 0 (``cpu``) or VRAM device N (``cuda:N``). A post turns extents into
Nx3 ``(addr, len, devId)`` arrays (:func:`_dlist`), or, on the prepped path, into indices of
whole blocks of lists prepped ONCE per side (:class:`_Prep`, :func:`_pair_indices`); a request
whose extents mix DRAM and VRAM is split into one NIXL request per memory pair
(:func:`_memory_pairs`). All of it is numpy over the extent arrays, no Python loop over
extents. Separate from the transport because it is pure arithmetic on region tables (the one
NIXL call, ``prep_xfer_dlist``, takes the agent as an argument): it can be read, and tested,
without a peer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError, ExtentOutOfBounds
from kvlink.transport import Extents, Region, RegionTable, make_extents
from kvlink_transports.nixl.agent import _nixl_reason

log = logging.getLogger("kvlink.nixl")

_MEM_NAMES = ("DRAM", "VRAM")  # index = memory code used in the per-region arrays


def _mem_of(device: str, exc: type[Exception] = ConfigError) -> tuple[int, int]:
    """Region.device -> (memory code, NIXL devId): cpu -> (DRAM, 0), cuda:N -> (VRAM, N)."""
    kind, _, idx = device.partition(":")
    if kind == "cpu" and not idx:
        return 0, 0
    if kind == "cuda" and (not idx or idx.isdigit()):
        return 1, int(idx or 0)
    raise exc(f"region device {device!r} is not 'cpu' or 'cuda:N'")


class _Side:
    """Regions of one side with per-region memory code and devId, in RegionTable order."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.table = RegionTable(regions)
        codes = [_mem_of(r.device) for r in self.table.regions]
        self.mem = np.array([c[0] for c in codes], dtype=np.int8)
        self.dev = np.array([c[1] for c in codes], dtype=np.uint64)
        self.vram = self.mem == 1  # per region: device memory (stream order, per post)
        m = self.mem  # read on every post: worked out once (a side never changes)
        #: the memory code of every region when they share one (no per-extent lookup)
        self.one_kind: int | None = (int(m[0]) if m.size and int(m.min()) == int(m.max())
                                     else None)
        self.has_vram = bool(np.any(self.vram))


def _dlist(ext: Extents, dev: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    out = np.empty((ext.shape[0], 3), dtype=np.uint64)
    out[:, 0] = ext["addr"]
    out[:, 1] = ext["len"]
    out[:, 2] = dev
    return out


_BLOCK_MIN = 4096


def _auto_block(regions: Sequence[Region], cap: int) -> int:
    """The prepped-list block: 4 KiB, doubled until ``regions`` need at most ``cap`` of them."""
    b = _BLOCK_MIN
    while sum(r.nbytes // b for r in regions) > cap:
        b *= 2
    return b


def _check_block(block: int, regions: Sequence[Region], cap: int) -> None:
    """Raise ConfigError where an explicit ``prep_block_bytes`` cuts ``regions`` into more than
    ``cap`` (``prep_max_descriptors``) descriptors. Why: the option is in bytes, and a KV block's
    token count given for it (16) made a descriptor of every 16 bytes — 671M of them, prepped
    one by one, for a 10 GiB cache — where the default grows its block to stay under ``cap``."""
    count = sum(r.nbytes // block for r in regions)
    if count > cap:
        total = sum(r.nbytes for r in regions)
        raise ConfigError(
            f"nixl option prep_block_bytes={block} cuts {total} registered bytes into {count} "
            f"descriptors (prep_max_descriptors={cap}): it is in bytes — a KV block's bytes "
            f"(block_size x heads x head_dim x dtype bytes), or 0 for the default")


@dataclasses.dataclass
class _Prep:
    """Descriptor lists prepped ONCE for one side (ours, or a peer's) at one block size: every
    region cut into ``block``-byte descriptors, one prepped list per memory kind (NIXL's
    strided Nx5 form, one row per region). A request then names descriptors by index
    (:func:`_block_indices`), so ``post`` builds no list: ``make_prepped_xfer`` with two index
    arrays, which NIXL merges back to back."""

    block: int
    handles: dict[int, Any]  # memory code -> nixl_prepped_dlist_handle
    start: npt.NDArray[np.uint64]  # per region (RegionTable order): its address
    base: npt.NDArray[np.int64]  # index of its first block in its memory kind's list
    nblocks: npt.NDArray[np.int64]  # whole blocks in it (a shorter tail is not prepped)
    tail: npt.NDArray[np.bool_]  # it ends in such a tail
    side: _Side | None = None  # the region table it was made from (used only with that one)

    @property
    def shift(self) -> int:
        """log2(block) when block is a power of two, else -1."""
        return self.block.bit_length() - 1 if self.block & (self.block - 1) == 0 else -1

    @property
    def descriptors(self) -> int:
        return int(self.nblocks.sum())

    def release(self) -> None:
        for h in self.handles.values():
            try:
                h.release()
            except Exception as exc:
                log.debug("nixl prepped dlist release: %s", _nixl_reason(exc))
        self.handles = {}


def _make_prep(agent: Any, who: str, side: _Side, block: int) -> _Prep:
    """Prep ``side``'s regions at ``block`` (``who``: "NIXL_INIT_AGENT" or the peer's agent)."""
    regions = side.table.regions
    n = len(regions)
    start = np.array([r.addr for r in regions], dtype=np.uint64)
    nblocks = np.array([r.nbytes // block for r in regions], dtype=np.int64)
    base = np.zeros(n, dtype=np.int64)
    handles: dict[int, Any] = {}
    tail = np.array([r.nbytes % block != 0 for r in regions], dtype=np.bool_)
    prep = _Prep(block, handles, start, base, nblocks, tail, side)
    try:
        for mem in (0, 1):
            sel = np.flatnonzero((side.mem == mem) & (nblocks > 0))
            if sel.size == 0:
                continue
            counts = nblocks[sel]
            base[sel] = np.cumsum(counts) - counts
            rows = np.empty((sel.size, 5), dtype=np.uint64)
            rows[:, 0] = start[sel]
            rows[:, 1] = block
            rows[:, 2] = side.dev[sel]
            rows[:, 3] = block
            rows[:, 4] = counts.astype(np.uint64)
            handles[mem] = agent.prep_xfer_dlist(who, rows, _MEM_NAMES[mem])
    except BaseException:
        prep.release()
        raise
    return prep


def _first_blocks(
    prep: _Prep, ri: npt.NDArray[np.intp], ext: Extents
) -> npt.NDArray[np.int64] | None:
    """Index of the first prepped block of each extent (extent i lies in region ``ri[i]``);
    None when one does not start and end on whole prepped blocks of its region."""
    b = prep.block
    one = prep.start.shape[0] == 1
    r0 = 0 if one else int(ri[0])
    if one or bool((ri == r0).all()):  # the common case: scalars instead of gathers
        off = ext["addr"] - prep.start[r0]
    else:
        off = ext["addr"] - prep.start[ri]
    first: npt.NDArray[np.int64]
    if prep.shift >= 0:  # a power of two: masks and shifts (uint64 % and // are slow)
        if ((off | ext["len"]) & np.uint64(b - 1)).any():
            return None
        first = (off >> np.uint64(prep.shift)).view(np.int64)
    else:  # (each on its own: an OR of the two is a multiple of b only for a power of two;
        # 8 | 3000 = 3000 mapped an extent at offset 8 onto block 0, and moved the wrong bytes)
        if (off % np.uint64(b)).any() or (ext["len"] % np.uint64(b)).any():
            return None
        first = (off // np.uint64(b)).view(np.int64)
    if one or bool((ri == r0).all()):
        if prep.tail[r0] and int((off + ext["len"]).max()) > int(prep.nblocks[r0]) * b:
            return None
        first += prep.base[r0]
        return first
    if (first + (ext["len"] // np.uint64(b)).view(np.int64) > prep.nblocks[ri]).any():
        return None
    first += prep.base[ri]
    return first


def _pair_indices(
    lprep: _Prep, li: npt.NDArray[np.intp], local: Extents,
    rprep: _Prep, ri: npt.NDArray[np.intp], remote: Extents,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
    """Local and remote indices into the prepped lists of the blocks making up the extent
    pairs (same block size both sides; lengths pair up, check_pairs), in order; None when an
    extent is not made of whole prepped blocks. Vectorised: no Python loop over extents."""
    lf = _first_blocks(lprep, li, local)
    rf = _first_blocks(rprep, ri, remote) if lf is not None else None
    if lf is None or rf is None:
        return None
    b = lprep.block
    ln = local["len"]
    if int(ln.min()) == b and int(ln.max()) == b:  # one block per extent
        return lf.astype(np.int32), rf.astype(np.int32)
    cnt = (ln // np.uint64(b)).view(np.int64)
    ends = cnt.cumsum()
    total = int(ends[-1])
    if total >= 1 << 31:
        return None
    ends -= cnt  # each extent's first position in the index arrays
    ar = np.arange(total, dtype=np.int32)
    li_ = (lf - ends).astype(np.int32).repeat(cnt)
    li_ += ar
    ri_ = (rf - ends).astype(np.int32).repeat(cnt)
    ri_ += ar
    return li_, ri_


def _segment_firsts(prep: _Prep, bases: npt.NDArray[np.uint64]
                    ) -> tuple[npt.NDArray[np.int32], int] | None:
    """For a request in RUNS form (kvlink.transport.Runs: extent (s, r) at ``bases[s]`` +
    its run's offset): each segment's first prepped block index, and the bytes every segment
    has room for past its base (the smallest), or None where a base lies outside the prepped
    regions or off a block boundary — the first block of each segment located as any extent
    is (``RegionTable.locate``, :func:`_first_blocks`). Made once per (prep, bases): the
    planner hands every request of a peer the same bases."""
    side = prep.side
    if side is None or bases.size == 0 or prep.descriptors >= 1 << 31:  # (int32 indices)
        return None
    ext = make_extents(bases, prep.block)
    try:
        ri = side.table.locate(ext, "segment base")
    except ExtentOutOfBounds:
        return None
    firsts = _first_blocks(prep, ri, ext)
    if firsts is None:
        return None
    room = prep.base[ri] + prep.nblocks[ri] - firsts  # whole prepped blocks from the base on
    return firsts.astype(np.int32), int(room.min()) * prep.block


def _run_indices(lfirst: npt.NDArray[np.int32], rfirst: npt.NDArray[np.int32],
                 local_at: npt.NDArray[np.uint64], remote_at: npt.NDArray[np.uint64],
                 block: int, per: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Prepped block indices of segments x runs of ``per`` blocks each, segment-major as
    :meth:`Runs.expand` orders the extents: two broadcast adds, no per-extent address math.
    The offsets are whole blocks (the caller checked), the indices fit int32 (the total)."""
    shift = block.bit_length() - 1 if block & (block - 1) == 0 else -1
    out = []
    for first, at in ((lfirst, local_at), (rfirst, remote_at)):
        rel = ((at >> np.uint64(shift)) if shift >= 0 else at // np.uint64(block)
               ).astype(np.int32)
        if per == 1:  # one block per run (the worker's form): one add, straight to int32
            idx = np.add(first[:, None], rel[None, :])
        else:
            idx = (first[:, None, None] + rel[None, :, None]
                   + np.arange(per, dtype=np.int32)[None, None, :])
        out.append(idx.reshape(-1))
    return out[0], out[1]


def _memory_pairs(
    local: _Side, li: npt.NDArray[np.intp], remote: _Side, ri: npt.NDArray[np.intp],
) -> list[tuple[npt.NDArray[np.bool_] | None, int, int]]:
    """The mixed-memory split: ``(mask, local memory code, remote memory code)`` per NIXL
    request a transfer needs (extent i lies in local region ``li[i]`` and remote region
    ``ri[i]``). One part with mask None when every extent pairs the same two memory kinds
    (the usual case, told from the region tables alone where each side has one kind); else
    one part per DRAM/VRAM pair, its mask selecting its extents."""
    parts: list[tuple[npt.NDArray[np.bool_] | None, int, int]]
    lk, rk = local.one_kind, remote.one_kind
    if lk is not None and rk is not None:  # no per-extent lookup
        parts = [(None, lk, rk)]
    else:
        lmem, rmem = local.mem[li], remote.mem[ri]
        if lmem.min() == lmem.max() and rmem.min() == rmem.max():
            parts = [(None, int(lmem[0]), int(rmem[0]))]
        else:
            pair = lmem.astype(np.int16) * 2 + rmem
            parts = [(pair == k, int(k) // 2, int(k) % 2) for k in np.unique(pair)]
    return parts
