"""A copy bound once per peer pair: the address kernels' launches with everything but the
block ids written in advance.

A request's host time before its launch is its latency, and on a serving host that time is
cold: every step costs several times what it costs back to back (docs/history/e2e.md, "Why
cold costs what it costs"). :meth:`BatchCopier.copy_runs` works out per post what never
changes between two requests of one peer pair — the segment bases in the table, the region
maps, the launch shape and size class, the kernel's constant arguments. A :class:`Lane`
works them out once (per peer, at its first request), so a post copies the two block-id
arrays into the launch's own parameter buffer, writes a handful of argument slots, and
launches: the shape of a request's work that a few calls can do. The kernels take the ids
themselves (their KV_IDS form): they compute each block's addresses and refuse an id past
its side's block count, so the host neither multiplies nor bounds-checks the ids on this
path — on a serving host every numpy call a request makes costs tens of microseconds cold
(docs/e2e.md).

The kernels are the ones :meth:`BatchCopier.copy_runs` and :meth:`BatchCopier.copy_digest`
launch (``kv_move_runs`` with one run per block, ``kv_move_digest``) in their block-id form,
with their tables passed by value (:class:`~kvlink.gpu.move.TableLaunch`); a request whose
table does not fit the largest size class is the caller's to post the general way
(:meth:`Lane.fits`).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvlink.gpu import move
from kvlink.sampling import picked

U64 = npt.NDArray[np.uint64]
#: the argument slots a post writes (see Lane._constants for the kernels' signatures): plain
#: (n, status, seq, G), digest (n, status, seq, generation, check words, sample). -1: a value
#: the launch reads and the kernel does not take (the hold's generation: the launch finds its
#: slot on the board, and sample's blocks, with it)
_PLAIN_SLOTS = (1, 6, 7, 8)
_DIGEST_SLOTS = (1, 7, 8, -1, 16, 23)
#: a digest kernel's first differing index where every compared digest matched
NO_MISMATCH = (1 << 64) - 1
#: which of a digest post's values is the address of its check words, which the launch sets
#: to where the kernel starts from (C launcher and Lane.launch alike): no mismatch, no rows
#: compared, none missed
_DIGEST_CHECK = 4
#: which of a post's values (plain and digest alike) is the address of its status word, which
#: the C launcher sets to 0 before the launch, with its end word (Lane.launch's caller clears
#: both itself), and which is the post's sequence number, which the launcher has the stream
#: write into the end word once the kernel has ended
_STATUS, _SEQ = 1, 2
#: where a lane's post ends, in words from its status word: the stream writes the post's
#: sequence number there once its kernel has ended (a stream memory operation: the poll that
#: sees the copy done reads a word, where it queried a driver event)
END_WORD = 4
_CHECK_START = np.array([NO_MISMATCH, 0, 0], dtype=np.uint64)
_CHECK_START_AT = _CHECK_START.ctypes.data  # (numpy's ctypes address costs a call per use)
#: a digest post's value that is the hold's generation, and the argument slots where the hold's
#: offset and bytes on the board go, as its slot shows them at the launch (read by the launcher),
#: and the pick's (sample: how many blocks are checked, see sample_order; 0: every block)
_DIGEST_GENERATION, _BOARD_AT, _BOARD_LEN, _DIGEST_PICK = 3, 19, 20, 23


def _values(n: int, status: int, seq: int, g: int, check: tuple[int, int, bool] | None
            ) -> tuple[int, ...]:
    """What a post writes into its launch's slots (``_PLAIN_SLOTS`` / ``_DIGEST_SLOTS``, in
    that order), whichever launches it: ctypes here, the C launcher the same values written
    out in :meth:`Lane.post` (a call less on a READ's path before its launch)."""
    return ((n, status, seq, g) if check is None else
            (n, status, seq, check[0], check[1], int(check[2])))


class Regions(Protocol):
    """What a lane needs of a side's region map (kvlink.gpu.copy.RegionMap)."""

    ptr: int
    kernel_count: int

    def through(self, bases: U64, span: int) -> U64 | None: ...


class BoardDigest(NamedTuple):
    """What a digest lane's kernel needs besides the blocks (kvlink.transport.LaneDigests, in
    device terms): the consumer's views and weights, the unit's pages, and the producer's hold
    board as the device sees it (``board``: the mapping's device address; ``layout``: where
    a hold lies on it, kvlink.holdboard.DeviceLayout) and as we do (``host``: the same
    mapping's address here, where a post reads its hold's slot)."""

    pages: int  # per unit: 1, or K and V side by side: 2
    page_bytes: int
    geometry: int  # device pointers (kvlink.integrity's fused views, weights)
    weights: int
    board: int
    layout: tuple[int, int, int, int]
    host: int


def sample_order(remote_ids: npt.NDArray[np.int64], generation: int
                 ) -> tuple[npt.NDArray[np.int64], int]:
    """The order a digest lane's kernel takes a ``sample`` READ's blocks in, and how many it
    checks: the positions of the blocks ``sample`` picks (:func:`kvlink.sampling.picked`, by
    the hold's generation, as the producer picked them) first, then the others, each in
    order. What the C launcher writes after the ids (kvlink/_native.c). The kernel takes
    each segment's units in that order: a checked unit's row is its place in it (the kernel
    works no pick out), and none ends a segment — the last block, checked at every level,
    ended every one, the grid's last unit too. Its round trip to the board then lengthened
    the whole copy: with both, the 70B request's `sample` costs 2.3 us over the plain lane,
    3.9 before (bench/results/gpu_digest_order/)."""
    keep = picked(generation, remote_ids)
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)]).astype(np.int64)
    return order, int(keep.sum())


def board_slot(digest: BoardDigest, generation: int) -> tuple[int, int]:
    """Where the hold ``generation`` lies on the board as its slot shows it now (offset,
    bytes); (0, 0) where the slot shows another generation. What the C launcher reads for a
    post (kvlink/_native.c): a torn read is harmless, as for the kernel's own reads — what the
    kernel compares counts only if the after-check finds the hold still shown."""
    slot0, mask = digest.layout[0], digest.layout[1]
    words = (ctypes.c_uint64 * 4).from_address(digest.host + 8 * slot0
                                               + 32 * (generation & mask))
    return (int(words[2]), int(words[3])) if words[0] == generation else (0, 0)


class Lane:
    """One peer pair's copy of whole blocks: ``src_base[s] + src_id * unit`` ->
    ``dst_base[s] + dst_id * unit``, ``unit`` bytes, for every segment ``s`` and block pair,
    ids below ``limits`` (source, destination block counts: the device refuses the others);
    with ``digest``, the fused integrity digest's kernel instead, which finds the producer's
    rows on its hold board itself (:class:`BoardDigest`): a post passes the hold's generation
    and nothing else of them.
    Made by :meth:`kvlink.gpu.copy.BatchCopier.lane`; launched under its lock
    (:meth:`~kvlink.gpu.copy.BatchCopier.copy_lane`). ``maps``: both sides' region maps, which
    :meth:`rebind` replaces (a peer connected anew).

    Where each segment's blocks below its side's count all lie in one region of its side's
    map (a vLLM cache: a region per layer, a segment per layer and K/V), the lane translates
    the segments' bases through the maps once, here, and its launches pass no maps: the
    kernel skips the region lookup per unit — a binary search over 80 regions, twice, before
    each 4 KiB unit of the 70B TP8-rank request could move (bench/gpu_lane_probe.py). The
    kernel's id bound keeps every unit inside the region found here."""

    def __init__(self, cuda: move.CudaMove, src_base: U64, dst_base: U64, unit: int,
                 limits: tuple[int, int], maps: tuple[Regions, Regions], *, chunk: int,
                 min_programs: int, small: int, digest: BoardDigest | None = None) -> None:
        self._cuda, self._lib = cuda, cuda.lib
        self.segments = int(src_base.shape[0])
        self.unit = int(unit)
        self.limits = (int(limits[0]), int(limits[1]))
        self._given = (src_base, dst_base)
        self._regions: tuple[Regions, Regions] | None = None
        self._bases: U64 = np.zeros(0, dtype=np.uint64)
        self._maps = (0, 0, 0, 0)
        self._bind(maps)
        self._chunk, self._min_programs = chunk, min_programs
        self.digest = digest
        if digest is None:  # the table's words per block: source and destination ids
            self._name, self._shape, self._nargs = (
                "kv_move_runs", cuda.shape(unit, small), move.NARGS + move.IDS_NARGS[0])
        else:
            self._name, self._shape, self._nargs = (
                "kv_move_digest", move.DIGEST_SHAPE,
                move.DIGEST_NARGS + move.IDS_NARGS[1] + move.BOARD_NARGS)
        self._classes: dict[int, move.TableLaunch] = {}  # size class -> its launch buffers
        #: blocks -> (launch buffers, grid, parts per block): requests repeat their sizes. A
        #: count found here fits (:meth:`fits` for the others): the transport's post asks
        #: here first, where a call to :meth:`fits` would be two frames on a READ's path
        #: before its launch, cold (bench/results/gpu_ab_6dccf04)
        self.launches: dict[int, tuple[move.TableLaunch, int, int]] = {}
        #: blocks -> the C launcher's form of that launch, and its parts per block
        self._forms: dict[int, tuple[tuple[Any, ...], int]] = {}
        #: the argument slots a post writes, in the order :meth:`post` gives their values
        self._slots = (_PLAIN_SLOTS if digest is None else _DIGEST_SLOTS)

    def fits(self, blocks: int) -> bool:
        """Whether a request of ``blocks`` travels with its launch (else: post it the general
        way). Also builds what such a launch needs, so the first post pays for it."""
        return self._bound(blocks) is not None

    @property
    def translated(self) -> bool:
        """Whether the bases were translated here (the kernel then looks no region up)."""
        return self._maps == (0, 0, 0, 0)

    def rebind(self, maps: tuple[Regions, Regions]) -> None:
        """The region maps of a peer connected anew (its mappings are new)."""
        if self._regions is not None and all(a is b for a, b in zip(maps, self._regions)):
            return
        self._bind(maps)
        for launch in self._classes.values():
            launch.table[:2 * self.segments] = self._bases
            self._constants(launch)

    def _bind(self, maps: tuple[Regions, Regions]) -> None:
        """The bases and map arguments the launches take for ``maps``: the bases translated
        where every segment's blocks lie in one region of each side (null maps: no lookup),
        else as given with both maps (the kernel looks each unit up)."""
        (src, dst), (smap, dmap) = self._given, maps
        self._regions = maps
        s_to = smap.through(src, self.limits[0] * self.unit)
        d_to = None if s_to is None else dmap.through(dst, self.limits[1] * self.unit)
        if s_to is None or d_to is None:
            self._bases = np.concatenate([src, dst]).astype(np.uint64)
            self._maps = (smap.ptr, smap.kernel_count, dmap.ptr, dmap.kernel_count)
        else:
            self._bases = np.concatenate([s_to, d_to])
            self._maps = (0, 0, 0, 0)

    def _bound(self, blocks: int) -> tuple[move.TableLaunch, int, int] | None:
        got = self.launches.get(blocks)
        if got is not None:
            return got
        # (a digest lane's table also holds the order its kernel takes the blocks in)
        per = 2 if self.digest is None else 3
        words = self._cuda.table_class(2 * self.segments + per * blocks)
        if not words or not blocks:
            return None
        launch = self._classes.get(words)
        if launch is None:
            launch = self._cuda.table_launch(self._name, self._shape, words, self._nargs,
                                             ids=True, board=self.digest is not None)
            if launch is None:
                return None
            launch.table[:2 * self.segments] = self._bases
            self._constants(launch)
            self._classes[words] = launch
        units = self.segments * blocks
        if self.digest is None:  # parts per block: as copy_runs cuts a run of one block
            g = move.parts_per_extent(units, self.unit, self._chunk,
                                      self._min_programs * launch.groups)
        else:
            g = 1
        got = (launch, -(-units * g // launch.groups), g)
        if len(self.launches) > 4096:
            self.launches.clear()
        self.launches[blocks] = got
        return got

    def _constants(self, launch: move.TableLaunch) -> None:
        """The argument slots no request changes (see the kernels' signatures)."""
        v, (sp, sn, dp, dn), (sb, db), d = launch.vals, self._maps, self.limits, self.digest
        if d is None:  # (S, R, smap, ns, dmap, nd, status, seq, G, unit, snb, dnb)
            v[0], v[2], v[3], v[4], v[5] = self.segments, sp, sn, dp, dn
            v[9], v[10], v[11] = self.unit, sb, db
        else:  # (S, n, unit, smap, ns, dmap, nd, status, seq, geo, wt, nrows, out, Q,
            # page, board, bad, snb, dnb, at, bytes, lo, hi, sample; nrows: not read where
            # the kernel finds the hold's rows on its board, as here)
            v[0], v[2], v[3], v[4], v[5], v[6] = self.segments, self.unit, sp, sn, dp, dn
            v[9], v[10], v[11], v[12], v[13], v[14], v[15] = (d.geometry, d.weights, 0, 0,
                                                              d.pages, d.page_bytes, d.board)
            v[17], v[18], v[21], v[22] = sb, db, d.layout[2], d.layout[3]

    def post(self, launcher: Any, src_ids: npt.NDArray[np.int64],
             dst_ids: npt.NDArray[np.int64], status: int, seq: int, stream: int,
             after: int | None, order: int,
             check: tuple[int, int, bool] | None = None,
             signal: tuple[int, int, int, int] | None = None, start: int = 0) -> bool:
        """:meth:`launch` through the C launcher (kvlink.native: ``launcher``), which also
        orders ``stream`` after the caller's ``after`` (through the event ``order``, where it
        has work pending) and has the stream mark the post's end after the kernel (``seq``
        into the end word, ``END_WORD`` words past ``status``) — one call. It clears the
        status and end words before the launch; on a digest lane it also sets ``check``'s
        words to what the kernel starts from, and reads where the hold lies from its slot on
        the board (:func:`board_slot`). The ids may be lists of ints too (the launcher
        converts them); others raise TypeError, ValueError or OverflowError before any driver
        call. Raises RuntimeError naming the driver step that refused (before the launch:
        nothing of this copy was enqueued; "marking the end" and "signalling" come after it).
        ``signal`` (a push into a landing board): (kv_signal, the flag's device address, the
        value it must show, the value it takes), launched after the copy, before its end
        mark (kvlink.landing: the flag follows every byte). ``start`` (a copy timed on the
        device): a timing event the launcher records right before the launch, after the
        order's wait; returns whether it did (a refused record leaves the copy untimed)."""
        n = len(src_ids)
        form, g = self._forms.get(n) or self._form(n)
        return bool(launcher.post(form, src_ids, dst_ids, stream, after, order,
                                  (n, status, seq, g) if check is None else  # (_values,
                                  (n, status, seq, check[0], check[1], check[2]),  # no frame)
                                  signal, start or None))

    def posted(self, n: int) -> npt.NDArray[np.int64]:
        """The ids the last post of ``n`` blocks launched with (source ids, then destination
        ids), as they are in its launch's table: a copy of our own, one numpy call however
        the caller handed them (lists converted by the launcher)."""
        launch = self.launches[n][0]
        at = 2 * self.segments
        return launch.ids[at:at + 2 * n].copy()

    def _form(self, n: int) -> tuple[tuple[Any, ...], int]:
        got = self.launches.get(n) or self._bound(n)
        if got is None:
            raise RuntimeError(f"a lane cannot take {n} blocks with the launch (fits() first)")
        launch, grid, g = got
        fn = launch.fn
        form: tuple[Any, ...] = (
            int(getattr(fn, "value", fn) or 0), launch.table.ctypes.data,
            ctypes.addressof(launch.vals), launch.params, grid, launch.threads,
            2 * self.segments, n, int(launch.table.shape[0]), self._slots,
            -1 if self.digest is None else _DIGEST_CHECK, self._board_form(), _STATUS, _SEQ)
        if len(self._forms) > 4096:
            self._forms.clear()
        self._forms[n] = (form, g)
        return form, g

    def _board_form(self) -> tuple[int, int, int, int, int, int] | None:
        """What the C launcher needs to read a digest post's hold slot (:func:`board_slot`)
        and to order a ``sample`` post's blocks (:func:`sample_order`): the board's first slot
        here, the slots' mask, which value is the generation, and the argument slots for the
        hold's offset and bytes and for the pick."""
        d = self.digest
        if d is None:
            return None
        return (d.host + 8 * d.layout[0], d.layout[1], _DIGEST_GENERATION, _BOARD_AT,
                _BOARD_LEN, _DIGEST_PICK)

    def launch(self, src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64],
               status: int, seq: int, stream: int,
               check: tuple[int, int, bool] | None = None) -> None:
        """Enqueue the copy of blocks ``src_ids`` -> ``dst_ids`` (int64; the device refuses an id
        outside its side's block count, and an address outside the registered regions) on
        ``stream``; ``status``: the address of the post's status word (``seq`` lands there if
        the device refuses an extent). ``check`` (a digest lane): (the hold's generation, the
        address of the three words the kernel reports in: kvlink.gpu.copy.copy_lane, and
        whether it checks ``sample``'s blocks, picked as kvlink.integrity.checked picks them
        by the generation, or every block).
        Raises RuntimeError where the driver refuses the launch (nothing was enqueued)."""
        n = src_ids.shape[0]
        got = self.launches.get(n) or self._bound(n)
        if got is None:
            raise RuntimeError(f"a lane cannot take {n} blocks with the launch (fits() first)")
        launch, grid, g = got
        t, at = launch.ids, 2 * self.segments
        t[at:at + n] = src_ids  # (a negative id: past every block count, as the kernel reads)
        t[at + n:at + 2 * n] = dst_ids
        v = launch.vals
        for slot, value in zip(self._slots, _values(n, status, seq, g, check)):
            if slot >= 0:
                v[slot] = value
        if check is not None and self.digest is not None:
            ctypes.memmove(check[1], _CHECK_START_AT, 24)
            v[_BOARD_AT], v[_BOARD_LEN] = board_slot(self.digest, check[0])
            if check[2]:  # sample: the blocks it checks first (what the C launcher writes)
                order, v[_DIGEST_PICK] = sample_order(t[at:at + n], check[0])
                t[at + 2 * n:at + 3 * n] = order
        rc = launch.launch(self._lib, grid, stream)
        if rc:
            raise RuntimeError(f"cuLaunchKernel({self._name}, a lane's table of "
                               f"{launch.table.shape[0]} words) failed with CUDA error {rc}")
