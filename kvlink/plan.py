"""Block planning: block ids x head map -> coalesced (local, remote) extent arrays.

A peer's geometry is fixed at handshake, so everything that depends only on the two specs and
the head map is worked out once, in a :class:`PlanTable`: validation, the in-page piece offsets,
and per *segment* (a (layer, K|V) plane, or a layer when K and V of a block are neighbours) the
address of block 0 and the block stride on both sides. Planning a request is then O(blocks):

* the runs of block-id pairs consecutive on *both* sides are found once, on the id lists;
* one extent per (segment, run) is written by broadcasting the segment bases against the runs;
* seams — the last extent of a segment touching the first of the next on both sides (layers
  back to back in one allocation, a request covering a whole plane) — are found in O(segments)
  and merged by one variable-length coalesce, only when there is one.

The output is exactly the general path's (every (layer, K|V, block, piece) address on a numpy
grid, then neighbours merged), which is kept for what the fast path does not cover: NHD head
slices (``block_size`` strided pieces per page), K/V-joined pages moved in head slices, and
specs whose planes mix whole-page and padded block strides.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvlink import native
from kvlink.errors import BlockIdOutOfRange, IncompatibleSpecError
from kvlink.headmap import HeadRead
from kvlink.layout import KVCacheSpec, Layout
from kvlink.transport import EXTENT_DTYPE, Extents, Runs

U64 = npt.NDArray[np.uint64]
Alloc = Callable[[int], Extents]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One request's extents: ``local[i]`` and ``remote[i]`` are the two ends of one copy."""

    local: Extents
    remote: Extents
    raw_descriptors: int  # extent count before coalescing

    @property
    def nbytes(self) -> int:
        return int(self.local["len"].sum())

    @property
    def descriptors(self) -> int:
        return int(self.local.shape[0])


class PlanPath(str, enum.Enum):
    """How a :class:`PlanTable` plans (fixed per peer, so logged once, not per request)."""

    RUNS = "runs"  # whole units, stride == unit on both sides: runs of consecutive ids merge
    BLOCKS = "blocks"  # one unit per (segment, block); nothing inside a segment can merge
    GENERAL = "general"  # the full [layer, kv, block, piece] grid, then coalesce


_PAIR_STEP = (1 << 32) + 1  # (local, remote) ids both one further, packed as in _run_starts


@functools.lru_cache(maxsize=64)
def _units(n: int, unit: int) -> U64:
    """``n`` lengths of ``unit`` bytes (read-only, shared: requests repeat their sizes)."""
    out = np.full(n, unit, dtype=np.uint64)
    out.setflags(write=False)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PlanTable:
    """What planning against one peer needs that does not depend on the block ids.

    Built once per (local spec, remote spec, HeadRead) — at handshake — by :meth:`build`, which
    raises everything :func:`plan_transfer` would for an incompatible pair. :meth:`plan` then
    costs O(blocks + segments x runs) on the fast paths (see the module docstring).
    """

    local: KVCacheSpec
    remote: KVCacheSpec
    read: HeadRead | None
    local_offsets: U64  # piece offsets inside a local page
    remote_offsets: U64
    piece: int  # bytes of one piece
    kv_inner: bool  # K and V of a block are neighbours on both sides: kv iterates innermost
    path: PlanPath
    unit: int  # fast paths: bytes one block contributes to one segment
    local_base: U64  # fast paths: [segments] address of block 0's unit
    remote_base: U64
    local_stride: U64  # fast paths: [segments] bytes between blocks
    remote_stride: U64
    local_gaps: frozenset[int] | None  # see _gaps
    remote_gaps: frozenset[int] | None

    @classmethod
    def build(cls, local: KVCacheSpec, remote: KVCacheSpec,
              read: HeadRead | None = None) -> PlanTable:
        """Validate the pair and precompute the per-segment table (see the class docstring)."""
        if local.num_layers != remote.num_layers or local.num_kv != remote.num_kv:
            raise IncompatibleSpecError(
                f"layers x planes differ: local {local.num_layers}x{local.num_kv} vs "
                f"remote {remote.num_layers}x{remote.num_kv}"
            )
        loff, roff, piece = _page_pieces(local, remote, read)
        kv_inner = _kv_inner(local) and _kv_inner(remote)
        path, unit, (lb, rb, ls, rs) = _segments(local, remote, loff, roff, piece, kv_inner)
        for a in (lb, rb):  # every request of the pair shares them (a transport may cache by
            a.flags.writeable = False  # their identity)
        return cls(local, remote, read, loff, roff, piece, kv_inner, path, unit, lb, rb, ls, rs,
                   _gaps(lb, ls), _gaps(rb, rs))

    @classmethod
    def for_peer(cls, local: KVCacheSpec, remote: KVCacheSpec,
                 read: HeadRead | None = None) -> PlanTable:
        """:meth:`build`, once per (local, remote, read): kept in a small bounded cache.

        Keyed on the spec objects' identities — a KVCacheSpec is never changed once made, and
        a kept table holds its specs, so an id cannot be reused by another spec while its entry
        lives. This is what lets :func:`plan_transfer` callers get the table's speed without
        holding one.
        """
        key = (id(local), id(remote), read)
        with _CACHE_LOCK:
            table = _CACHE.pop(key, None)
            if table is not None:
                _CACHE[key] = table  # most recently used last
                return table
        table = cls.build(local, remote, read)  # raises for an incompatible pair: not kept
        with _CACHE_LOCK:
            _CACHE[key] = table
            while len(_CACHE) > _CACHE_SIZE:
                del _CACHE[next(iter(_CACHE))]
        return table

    @property
    def segments(self) -> int:
        return int(self.local_base.shape[0])

    def plan(self, local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike,
             alloc: Alloc | None = None) -> Plan:
        """Extents moving ``remote_ids`` blocks of the remote into ``local_ids`` blocks locally.

        The same arrays serve READ (remote -> local) and WRITE (local -> remote). Block ids are
        bounds-checked here, before anything can be posted. ``alloc(n)`` makes the output arrays
        (a transport's ``extents``, so they land where it posts from without another copy); it
        is called for the local array, then the remote one.
        """
        if self.path is PlanPath.RUNS:
            done = self._plan_native(local_ids, remote_ids, alloc)
            if done is not None:
                return done
        lids, rids = self._check_ids(local_ids, remote_ids)
        if self.path is PlanPath.GENERAL:
            return self._plan_grid(lids, rids, alloc)
        return self._plan_segments(lids, rids, alloc)

    def _plan_native(self, local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike,
                     alloc: Alloc | None) -> Plan | None:
        """The RUNS path in one call of kvlink's C helper (``plan_runs``: the ids' bounds, the
        runs, one extent per (segment, run), the seams merged): a 16-block request's plan
        21.5 us cold against numpy's 69.3 (4.2 against 22.5 warm), and the plan phase of its
        tcp READ through KVWorker 0.08 ms against 0.2 (bench/results/plan_native/). None
        where it does not apply — the helper not built, ids that are not contiguous int64
        arrays, an id out of range: the numpy path then plans, or names the bad id."""
        helpers = native.load()
        if (helpers is None or not isinstance(local_ids, np.ndarray)
                or not isinstance(remote_ids, np.ndarray) or local_ids.dtype != np.int64
                or remote_ids.dtype != np.int64 or local_ids.ndim != 1
                or local_ids.shape != remote_ids.shape or not local_ids.flags.c_contiguous
                or not remote_ids.flags.c_contiguous):
            return None
        room = self.segments * local_ids.shape[0]
        lext, rext = np.empty(room, EXTENT_DTYPE), np.empty(room, EXTENT_DTYPE)
        n = helpers.plan_runs(local_ids, remote_ids, self.local_base, self.remote_base,
                              self.unit, self.local.num_blocks, self.remote.num_blocks, lext,
                              rext)
        if n < 0:
            return None
        raw = self.raw_count(local_ids.shape[0])
        if alloc is None:
            return Plan(lext[:n], rext[:n], raw)
        lout, rout = alloc(n), alloc(n)
        lout[...], rout[...] = lext[:n], rext[:n]
        return Plan(lout, rout, raw)

    def runs(self, local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike, *,
             local_checked: bool = False, coalesce: bool = True) -> Runs | None:
        """The RUNS path's plan before it is expanded: (segment bases, runs), for a transport
        that computes the addresses on its device (cuda_ipc). None where the request does not
        fit that form (another path, or a seam to merge): use :meth:`plan`. ``local_checked``:
        ``local_ids`` is what ``self.local.check_block_ids`` returned (not checked again).
        ``coalesce=False``: one run per block (no run finding on the host: two multiplies, for
        a device that copies many small extents as fast as few large ones)."""
        if self.path is not PlanPath.RUNS:
            return None
        lids, rids = self._check_ids(local_ids, remote_ids, local_checked)
        n = lids.shape[0]
        if n and not coalesce:  # (seams need no merging: each block is its own extent)
            return Runs.of_blocks(self.local_base, self.remote_base, lids, rids, self.unit,
                                  self.raw_count(n), _units(n, self.unit))
        if n == 0 or self._seams(lids, rids) is not None:
            return None
        lrun, rrun, lens, longest = self._run_starts(lids, rids)
        return Runs(self.local_base, self.remote_base, lrun, rrun, lens, self.raw_count(n),
                    n * self.unit, longest)

    def _run_starts(self, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64]
                    ) -> tuple[U64, U64, U64, int]:
        """Byte offsets (local, remote) and lengths of the runs of ids consecutive on both
        sides, and the longest run's bytes (RUNS path: stride == unit, so one multiply per
        run). Few numpy calls: at a few hundred ids their fixed cost is the time. Both ids
        fit 31 bits (checked), so one int64 holds the pair, and a run goes on exactly where
        the pair steps by (1, 1)."""
        n = lids.shape[0]
        edge = np.empty(n + 1, dtype=bool)  # a run starts at each True; edge[n] closes
        edge[0] = edge[n] = True
        if max(self.local.num_blocks, self.remote.num_blocks) <= 1 << 31:
            pair = lids << 32
            pair |= rids
            np.not_equal(pair[1:] - pair[:-1], _PAIR_STEP, out=edge[1:n])
        else:  # ids past 31 bits: each side on its own
            np.not_equal(lids[1:] - lids[:-1], 1, out=edge[1:n])
            edge[1:n] |= rids[1:] - rids[:-1] != 1
        at = edge.nonzero()[0]
        starts = at[:-1]
        blocks = at[1:] - starts
        unit = np.uint64(self.unit)
        return (lids.view(np.uint64)[starts] * unit, rids.view(np.uint64)[starts] * unit,
                blocks.view(np.uint64) * unit, int(blocks.max()) * self.unit)

    def plan_general(self, local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike,
                     alloc: Alloc | None = None) -> Plan:
        """The general path whatever :attr:`path` says: every piece on a grid, then coalesced.
        Same output as :meth:`plan`; kept callable for benchmarks and tests."""
        lids, rids = self._check_ids(local_ids, remote_ids)
        return self._plan_grid(lids, rids, alloc)

    def raw_count(self, blocks: int) -> int:
        """Extents before coalescing: (layer, K|V, block, piece) count, by arithmetic."""
        pieces = int(self.local_offsets.shape[0])
        return self.local.num_layers * self.local.num_kv * blocks * pieces

    # ------------------------------------------------------------------ internals
    def _check_ids(self, local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike,
                   local_checked: bool = False
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        lids = (local_ids if local_checked and isinstance(local_ids, np.ndarray)
                and local_ids.dtype == np.int64 and local_ids.ndim == 1
                else self.local.check_block_ids(local_ids, "local"))
        rids = self.remote.check_block_ids(remote_ids, "remote")
        if lids.shape != rids.shape:
            raise BlockIdOutOfRange(
                f"{lids.shape[0]} local block ids but {rids.shape[0]} remote block ids"
            )
        return lids, rids

    def _plan_segments(self, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64],
                       alloc: Alloc | None) -> Plan:
        """Fast paths: one extent per (segment, run), seams merged only where there are any.

        Written for few numpy calls: at a few hundred blocks their fixed cost, not the data,
        is most of the time.
        """
        n = lids.shape[0]
        raw = self.raw_count(n)
        if n == 0:
            return Plan(_alloc(alloc, 0), _alloc(alloc, 0), raw)
        unit = np.uint64(self.unit)
        lu, ru = lids.view(np.uint64), rids.view(np.uint64)  # bounds-checked: never negative
        lens: U64 | np.uint64
        if self.path is PlanPath.RUNS:
            # stride == unit on every segment: one multiply per run, not per (segment, run)
            lrun, rrun, lens, _ = self._run_starts(lids, rids)
            lstride = rstride = None
        else:
            lrun, rrun, lens = lu, ru, unit
            lstride, rstride = self.local_stride[:, None], self.remote_stride[:, None]
        segs, runs = self.segments, lrun.shape[0]
        seams = self._seams(lids, rids)
        if seams is None:
            lext, rext = _alloc(alloc, segs * runs), _alloc(alloc, segs * runs)
            _outer(self.local_base, lrun, lstride, lext["addr"].reshape(segs, runs))
            _outer(self.remote_base, rrun, rstride, rext["addr"].reshape(segs, runs))
            lext["len"].reshape(segs, runs)[...] = lens
            rext["len"] = lext["len"]
            return Plan(lext, rext, raw)
        la = _outer(self.local_base, lrun, lstride, np.empty((segs, runs), np.uint64))
        ra = _outer(self.remote_base, rrun, rstride, np.empty((segs, runs), np.uint64))
        brk = np.ones((segs, runs), dtype=bool)
        brk[1:, 0] = ~seams
        first = brk.reshape(-1).nonzero()[0]
        merged = np.add.reduceat(np.broadcast_to(lens, (segs, runs)).reshape(-1), first)
        lext, rext = _alloc(alloc, first.shape[0]), _alloc(alloc, first.shape[0])
        lext["addr"] = la.reshape(-1)[first]
        rext["addr"] = ra.reshape(-1)[first]
        lext["len"] = merged
        rext["len"] = merged
        return Plan(lext, rext, raw)

    def _seams(self, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64]
               ) -> npt.NDArray[np.bool_] | None:
        """[segments - 1]: the request's last unit in segment j ends, on both sides, where its
        first unit in segment j + 1 starts; None when no segment does (the usual answer, found
        in O(1) from the table's gap sets when strides are uniform). uint64 wraps like C; only
        equality is asked, so the wrap is harmless."""
        if self.segments < 2:
            return None
        lf, ll, rf, rl = int(lids[0]), int(lids[-1]), int(rids[0]), int(rids[-1])
        if not (_may_touch(self.local_gaps, ll - lf, self.local_stride, self.unit)
                and _may_touch(self.remote_gaps, rl - rf, self.remote_stride, self.unit)):
            return None
        seam = _touch(self.local_base, self.local_stride, lf, ll, self.unit)
        seam &= _touch(self.remote_base, self.remote_stride, rf, rl, self.unit)
        return seam if seam.any() else None

    def _plan_grid(self, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64],
                   alloc: Alloc | None) -> Plan:
        """General path: addresses over the whole [layer, kv, block, piece] grid, merged."""
        loff, roff, piece = self.local_offsets, self.remote_offsets, self.piece
        if loff.shape[0] > 1:
            # strided head slices of NHD pages: pieces are never adjacent, so skip the merge and
            # write addresses straight into the output records
            n = self.raw_count(lids.shape[0])
            lext, rext = _alloc(alloc, n), _alloc(alloc, n)
            _grid(self.local, lids, loff, self.kv_inner, lext["addr"])
            _grid(self.remote, rids, roff, self.kv_inner, rext["addr"])
            lext["len"] = piece
            rext["len"] = piece
            return Plan(lext, rext, raw_descriptors=n)
        la = _grid(self.local, lids, loff, self.kv_inner)
        ra = _grid(self.remote, rids, roff, self.kv_inner)
        return Plan(*coalesce(la, ra, piece, alloc), raw_descriptors=int(la.shape[0]))


def plan_transfer(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_ids: npt.ArrayLike,
    remote_ids: npt.ArrayLike,
    read: HeadRead | None = None,
    alloc: Alloc | None = None,
) -> Plan:
    """Extents moving ``remote_ids`` blocks of ``remote`` into ``local_ids`` blocks of ``local``:
    ``PlanTable.for_peer(local, remote, read).plan(local_ids, remote_ids, alloc)`` — the table
    is built on the first request of a pair and reused after (see PlanTable.for_peer)."""
    return PlanTable.for_peer(local, remote, read).plan(local_ids, remote_ids, alloc)


# PlanTable.for_peer's tables, least recently used first. Bounded: a worker talks to a few
# dozen (peer rank, HeadRead) pairs; a table is a few arrays of segments entries.
_CACHE: dict[tuple[int, int, HeadRead | None], PlanTable] = {}
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def _segments(local: KVCacheSpec, remote: KVCacheSpec, loff: U64, roff: U64, piece: int,
              kv_inner: bool) -> tuple[PlanPath, int, tuple[U64, U64, U64, U64]]:
    """The fast-path table, or PlanPath.GENERAL with empty arrays.

    A *unit* is what one block contributes to one segment, in the general path's order: a piece
    of one plane, or — K and V neighbours and moved whole — the block's K and V pages as one.
    Inside a segment two units of consecutive list positions touch on a side iff that side's
    block stride equals the unit and the ids step by one (strides are at least a page, and a
    page at least a piece). So either every segment merges runs (RUNS), or none merges anything
    (BLOCKS); a mix, or several pieces per page, is left to the general path.
    """
    empty = np.zeros(0, dtype=np.uint64)
    general = (PlanPath.GENERAL, 0, (empty, empty, empty, empty))
    if loff.shape[0] != 1:
        return general
    if kv_inner:
        whole = piece == local.page_bytes == remote.page_bytes
        same_kv = (np.array_equal(local.block_stride[:, 0], local.block_stride[:, 1])
                   and np.array_equal(remote.block_stride[:, 0], remote.block_stride[:, 1]))
        # a stride of one page with K and V one page apart would put V of block b on K of
        # block b + 1: units two blocks apart would touch; leave such overlaps to the grid
        overlap = (np.any(local.block_stride == piece)
                   or np.any(remote.block_stride == piece))
        if not whole or not same_kv or overlap:
            return general
        unit = 2 * piece
        lb, rb = local.plane_base[:, 0], remote.plane_base[:, 0]
        ls, rs = local.block_stride[:, 0], remote.block_stride[:, 0]
    else:
        unit = piece
        lb, rb = local.plane_base.reshape(-1), remote.plane_base.reshape(-1)
        ls, rs = local.block_stride.reshape(-1), remote.block_stride.reshape(-1)
    merges = (ls == unit) & (rs == unit)
    if merges.all():
        path = PlanPath.RUNS
    elif not merges.any():
        path = PlanPath.BLOCKS
    else:
        return general
    seg = (lb + loff[0], rb + roff[0], np.ascontiguousarray(ls), np.ascontiguousarray(rs))
    return path, unit, seg


def _gaps(base: U64, stride: U64) -> frozenset[int] | None:
    """Distances from each segment's block 0 to the next one's (mod 2**64), when every segment
    has the same block stride: then a seam is possible only if the request's span is one."""
    if stride.shape[0] < 2 or not (stride == stride[0]).all():
        return None
    return frozenset((base[1:] - base[:-1]).tolist())


def _may_touch(gaps: frozenset[int] | None, span: int, stride: U64, unit: int) -> bool:
    """False when no segment's last unit can touch the next segment's first (see _gaps)."""
    if gaps is None:
        return True
    return (span * int(stride[0]) + unit) % (1 << 64) in gaps


def _touch(base: U64, stride: U64, first: int, last: int, unit: int) -> npt.NDArray[np.bool_]:
    """[segments - 1]: the unit of block ``last`` in segment j ends where block ``first``'s
    starts in segment j + 1."""
    end = base[:-1] + stride[:-1] * np.uint64(last) + np.uint64(unit)
    return np.asarray(end == base[1:] + stride[1:] * np.uint64(first))


def _outer(base: U64, run: U64, stride: U64 | None, out: U64) -> U64:
    """out[j, r] = base[j] + run[r] (* stride[j], when given) — one broadcast, no loop."""
    if stride is None:
        np.add(base[:, None], run[None, :], out=out)
    else:
        np.multiply(stride, run[None, :], out=out)
        out += base[:, None]
    return out


def _page_pieces(
    local: KVCacheSpec, remote: KVCacheSpec, read: HeadRead | None
) -> tuple[U64, U64, int]:
    """Offsets inside a page (local, remote) and the piece length for one page's exchange."""
    if local.mla or read is None or (
        read.count == local.num_kv_heads == remote.num_kv_heads
        and read.local_start == read.remote_start == 0
    ):
        if local.page_bytes != remote.page_bytes:
            raise IncompatibleSpecError(
                f"page sizes differ: local {local.page_bytes} B vs remote {remote.page_bytes} B"
            )
        zero = np.zeros(1, dtype=np.uint64)
        return zero, zero, local.page_bytes
    if not (read.local_start >= 0 and read.local_start + read.count <= local.num_kv_heads
            and read.remote_start >= 0 and read.remote_start + read.count <= remote.num_kv_heads):
        raise IncompatibleSpecError(f"{read} exceeds local {local.num_kv_heads} / remote "
                                    f"{remote.num_kv_heads} heads per rank")
    hb, bs = local.head_bytes, local.block_size
    # a one-head page is the same bytes in either layout: follow the side where it matters
    layout = local.layout if local.layout_matters else remote.layout
    if local.layout_matters and remote.layout_matters and local.layout is not remote.layout:
        raise IncompatibleSpecError(f"layouts differ: local {local.layout.value} vs remote "
                                    f"{remote.layout.value}")
    if layout is Layout.HND:
        return (np.array([read.local_start * bs * hb], dtype=np.uint64),
                np.array([read.remote_start * bs * hb], dtype=np.uint64), read.count * bs * hb)
    tok = np.arange(bs, dtype=np.uint64)
    return ((tok * local.num_kv_heads + read.local_start) * hb,
            (tok * remote.num_kv_heads + read.remote_start) * hb, read.count * hb)


def _kv_inner(spec: KVCacheSpec) -> bool:
    """True when K and V of one block are neighbours (joined layout): iterate kv innermost."""
    if spec.num_kv == 1:
        return False
    gap = spec.plane_base[:, 1].astype(np.int64) - spec.plane_base[:, 0].astype(np.int64)
    return bool(np.all(gap == spec.page_bytes))


def _alloc(alloc: Alloc | None, n: int) -> Extents:
    return np.empty(n, dtype=EXTENT_DTYPE) if alloc is None else alloc(n)


def _grid(spec: KVCacheSpec, ids: npt.NDArray[np.int64], offsets: U64,
          kv_inner: bool, out: U64 | None = None) -> U64:
    """Addresses over the [layer, kv, block, piece] grid (kv and block swapped if kv_inner).

    uint64 arithmetic wraps like C; the bounds were checked on the ids, so it never does here.
    """
    base = spec.plane_base[:, :, None, None]
    stride = spec.block_stride[:, :, None, None]
    blk = ids.astype(np.uint64)[None, None, :, None]
    if kv_inner:
        base, stride = base.transpose(0, 2, 1, 3), stride.transpose(0, 2, 1, 3)
        blk = blk.transpose(0, 2, 1, 3)
    shape = np.broadcast_shapes(base.shape, blk.shape, offsets[None, None, None, :].shape)
    if out is None:
        out = np.empty(int(np.prod(shape)), dtype=np.uint64)
    grid = out.reshape(shape)
    np.multiply(blk, stride, out=grid)
    grid += base
    grid += offsets
    return out


def coalesce(
    laddr: U64, raddr: U64, piece: int, alloc: Alloc | None = None,
) -> tuple[Extents, Extents]:
    """Merge runs of equal-length pieces that are contiguous on both sides into single extents."""
    n = laddr.shape[0]
    if n == 0:
        return _alloc(alloc, 0), _alloc(alloc, 0)
    step = np.uint64(piece)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(laddr[1:], laddr[:-1] + step, out=brk[1:])
    brk[1:] |= raddr[1:] != raddr[:-1] + step
    starts = np.flatnonzero(brk)
    counts = np.diff(np.append(starts, n)).astype(np.uint64)
    local, remote = _alloc(alloc, starts.shape[0]), _alloc(alloc, starts.shape[0])
    local["addr"] = laddr[starts]
    remote["addr"] = raddr[starts]
    local["len"] = counts * step
    remote["len"] = local["len"]
    return local, remote
