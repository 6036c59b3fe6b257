"""The two sides of a transfer's check: the producer fixes a request's digests when it starts
holding it (:meth:`Checker.fix`) and hands them out with its verdict, its hold board or a
push's note; the consumer digests what landed in its own blocks and compares
(:meth:`Checker.check`), a mismatch failing the receive with one line naming request, block,
layer, plane and head. A layer-wise push's digests are taken range by range
(:class:`RangeDigests`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.integrity.board import AreaOpener, BoardRows, WireDigests, pack
from kvlink.integrity.compute import (
    Later,
    digest,
    digest_later,
    first_mismatch,
    fold,
    into_plane_major,
    landed,
)
from kvlink.integrity.device import checked_on_gpu, device_table, on_gpu, upload
from kvlink.integrity.levels import Level, checked
from kvlink.integrity.weights import U64, Planes, weights
from kvlink.transport import DigestJob
from kvlink.wire import MAX_DIGEST_BYTES

HeadSlice = tuple[int, int, int]  # (local first head, remote first head, count)


def match(remote_ids: npt.ArrayLike, digest_ids: npt.ArrayLike
          ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(positions in ``remote_ids``, positions in ``digest_ids``) of the digested blocks a
    reader read, in digest order: a sort and a search, no Python loop per block."""
    rid = np.asarray(remote_ids, dtype=np.int64)
    did = np.asarray(digest_ids, dtype=np.int64)
    if not rid.size or not did.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if rid.shape == did.shape and np.array_equal(rid, did):  # every block digested (`full`)
        every = np.arange(rid.size, dtype=np.int64)
        return every, every
    order = np.argsort(rid, kind="stable")
    srt = rid[order]
    loc = np.minimum(np.searchsorted(srt, did), srt.size - 1)
    ok = srt[loc] == did
    return order[loc[ok]], np.flatnonzero(ok)


def _wire_form(ids: npt.NDArray[np.int64], d: U64) -> WireDigests:
    folded = d.nbytes > MAX_DIGEST_BYTES
    if folded:
        d = fold(d)
    return ids.tolist(), d.astype("<u8").tobytes(), folded


class RangeDigests:
    """A layer-wise push's digests (:meth:`Checker.for_layers`), taken range by range as the
    prefill writes its layers — each when its range is pushed, on the caller's stream, over
    the KV its WRITE then reads — and sent whole with "written", by the decode's block ids.
    Taken at the end instead, over the prefill's blocks as they are then, they would only
    disagree with what landed where a block changed *after* its range was read (the decode's
    copy still right), and agree where it changed before.

    ``into``: a landing board's digest area (kvlink.landing.DigestArea.open's
    ``[layers x planes, k, heads]``), where each range's go, ahead of its WRITE, so that a
    same-host decode checks what landed once its flag shows every layer, without the note."""

    def __init__(self, planes: Planes, pick: npt.NDArray[np.bool_], src: npt.NDArray[np.int64],
                 dst: npt.NDArray[np.int64]) -> None:
        self._planes, self._src, self.ids = planes, src[pick], dst[pick]
        self._ranges: list[Later] = []  # layers [0, upto), in order
        self.upto = 0
        #: (stream, the ids on the GPU), uploaded at the first range on that stream
        self._on_device: tuple[int, Any] | None = None
        self._into: U64 | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, planes, heads) of every range together: what an area must hold per
        digested block (with the decode's block ids, :attr:`ids`)."""
        first = self._planes[0][0]
        return len(self._planes), len(self._planes[0]), int(first.shape[1])

    def into(self, place: U64) -> None:
        """Put every range's digests in ``place`` (``[layers x planes, k, heads]`` words; for
        GPU planes, page-locked), from the first range on."""
        if self._ranges:
            raise ValueError("a digest area is given before the first range, not after")
        self._into = place

    def take(self, start: int, stop: int) -> None:
        """Layers ``[start, stop)`` are written (enqueued on the caller's stream): digest them.
        Ranges come in order (a layer-wise push's do); raises ValueError for one that does not
        start where the last ended."""
        if start != self.upto:
            raise ValueError(f"layers [{start}, {stop}) do not follow [0, {self.upto})")
        dev = None
        if self._src.size and on_gpu(self._planes):
            import torch

            device = device_table(self._planes).device
            stream = torch.cuda.current_stream(device).cuda_stream
            if self._on_device is None or self._on_device[0] != stream:
                self._on_device = (stream, upload(self._src, device))
            dev = self._on_device[1]
        per = len(self._planes[0])
        into = None if self._into is None else self._into[start * per:stop * per]
        self._ranges.append(digest_later(self._planes, self._src, (start, stop), dev, into))
        self.upto = stop

    def wire(self, layers: int) -> WireDigests:
        """The digests of layers ``[0, layers)`` for the note, once every range is DONE (on
        a GPU each range's copy was enqueued before its WRITE, which waited for it: nothing
        is waited for here). Raises ValueError where the ranges taken stop short of them."""
        if self.upto != layers:
            raise ValueError(f"layers [0, {self.upto}) digested, not [0, {layers})")
        parts = [later.result() for later in self._ranges]
        return _wire_form(self.ids, np.concatenate(parts, axis=1))


class Checker:
    """One worker's integrity state: digests fixed at hold (producer) and the check of what
    landed (consumer). Digests are computed on the caller's thread, like the transfer work."""

    def __init__(self, level: Level) -> None:
        #: whether any level checks (not off), and whether it is ``sample``: plain attributes,
        #: kept by :attr:`level`'s setter, where a property's call is a frame on a READ's
        #: path (its post and the poll that sees it done), cold
        self.on = self.sampling = False
        self.level = level
        self.planes: Planes | None = None  # set at register (spec_planes or tensor_planes)
        self._fixed: dict[str, tuple[int, npt.NDArray[np.int64], U64]] = {}
        self._rows: dict[str, npt.NDArray[np.int64]] = {}  # per held position: digest row
        self.checked_blocks = 0  # consumer: blocks whose digests matched
        self.failures = 0  # consumer: receives failed on a digest mismatch
        self.check_seconds = 0.0  # consumer: time spent checking, since start (benchmarks)
        self.fused_blocks = 0  # consumer: checked blocks the copy kernel digested and compared
        self._geo: tuple[Planes, tuple[int, int, int, int] | None] | None = None

    @property
    def level(self) -> Level:
        """The deployment's setting (it may change at run time: lanes are kept per level)."""
        return self._level

    @level.setter
    def level(self, level: Level) -> None:
        self._level = level
        self.on, self.sampling = level is not Level.OFF, level is Level.SAMPLE

    # ------------------------------------------------------------------ producer
    def fix(self, req_id: str, generation: int, block_ids: npt.ArrayLike) -> None:
        """The request's KV is final (it is being held): digest the blocks a reader will
        check (:func:`checked`)."""
        if not self.on or self.planes is None:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        mask = checked(self.level, generation, ids)
        sel = ids[mask]
        self._fixed[req_id] = (generation, sel, digest(self.planes, sel))
        self._rows[req_id] = np.where(mask, np.cumsum(mask) - 1, -1)

    def drop(self, req_id: str, generation: int) -> None:
        got = self._fixed.get(req_id)
        if got is not None and got[0] == generation:
            del self._fixed[req_id]
            self._rows.pop(req_id, None)

    def for_verdict(self, req_id: str, generation: int) -> WireDigests:
        """(block ids, digests, folded) to send with an "intact" verdict; empty if none."""
        got = self._fixed.get(req_id)
        if got is None or got[0] != generation:
            return [], b"", False
        _, ids, d = got
        return _wire_form(ids, d)

    def for_board(self, req_id: str, generation: int) -> bytes:
        """The digests to publish with the hold on the hold board (:func:`pack`; empty if
        none), so a same-host reader checks what landed without asking for a verdict."""
        got = self.for_verdict(req_id, generation)
        rows = self._rows.get(req_id)
        return pack(got, rows) if got[0] and rows is not None else b""

    def for_push(self, src_ids: npt.ArrayLike, dst_ids: npt.ArrayLike,
                 lease: tuple[str, int] | None, into: AreaOpener | None = None
                 ) -> WireDigests | None:
        """(decode block ids, digests, folded) for a push's "written" note: the digests the
        hold fixed (``lease``: (held request, generation)) of the blocks pushed, named by
        the ids they land in; None where it fixed none (take them as the push's layers are
        pushed: :meth:`for_layers`, the whole push being one range). ``into``: a landing
        board's digest area (its opener: kvlink.landing.DigestArea.open with the push's tag),
        where they go too, unfolded, before the WRITE is posted."""
        got = self._fixed.get(lease[0]) if lease is not None else None
        if not self.on or self.planes is None or got is None or lease is None \
                or got[0] != lease[1]:
            return None
        _, ids, d = got
        pushed, digested = match(src_ids, ids)  # (the held blocks this push writes)
        sel, d = np.asarray(dst_ids, dtype=np.int64)[pushed], d[digested]
        place = into(sel, d.shape[1:]) if into is not None and sel.size else None
        if place is not None:
            into_plane_major(place, d)
        return _wire_form(sel, d)

    def for_layers(self, req_id: str, src_ids: npt.ArrayLike, dst_ids: npt.ArrayLike
                   ) -> RangeDigests | None:
        """A push's digests, to be taken range by range as its layers are pushed
        (:class:`RangeDigests`; a whole push is one range), of the blocks ``checked`` picks by
        the request id; None with integrity off."""
        if not self.on or self.planes is None:
            return None
        dst = np.asarray(dst_ids, dtype=np.int64)
        return RangeDigests(self.planes, checked(self.level, req_id, dst),
                            np.asarray(src_ids, dtype=np.int64), dst)

    # ------------------------------------------------------------------ consumer
    def fused_job(self, on_board: BoardRows, page_bytes: int) -> DigestJob | None:
        """What a transport that copies on the device needs to digest what it lands while it
        copies and compare it with the producer's rows on its hold board
        (:class:`~kvlink.transport.DigestJob`). None where the planes are not on a GPU, the
        kernel cannot take their geometry, or the rows are not ours to compare (folded, or
        another row width): the check then digests after the copy. On every same-host READ's
        critical path: the planes' part is worked out once."""
        if not on_board.count or on_board.folded:
            return None
        got = self.fused_views()
        if got is None or on_board.row_words != got[2] * got[3]:
            return None
        return DigestJob(got[0], got[1], got[2], got[3], page_bytes, on_board.blocks,
                         on_board.count, on_board.rows, on_board.address, on_board.region)

    def fused_views(self) -> tuple[int, int, int, int] | None:
        """What a copy kernel that digests while it copies needs of our views: (geometry,
        weights — device pointers —, planes, heads); None with integrity off, or where the
        planes are not on a GPU or the kernel cannot take their geometry. Worked out once per
        set of planes."""
        planes = self.planes
        if not self.on or planes is None:
            return None
        geo = self._geo
        if geo is None or geo[0] is not planes:
            geo = self._geo = (planes, self._fused_geometry(planes))
        return geo[1]

    @staticmethod
    def _fused_geometry(planes: Planes) -> tuple[int, int, int, int] | None:
        """(geometry, weights, planes, heads) for the copy kernel, or None (host planes, a
        geometry the kernel cannot take)."""
        first = planes[0][0] if planes and planes[0] else None
        if first is None or isinstance(first, np.ndarray) or first.device.type != "cuda":
            return None
        hb = int(first.shape[3])
        table = device_table(planes)
        got = table.fused(weights(int(first.shape[2]), hb // 8)) if hb % 8 == 0 else None
        if got is None:
            return None
        return got[0], got[1], len(planes) * len(planes[0]), int(first.shape[1])

    def check(self, req_id: str, local_ids: npt.NDArray[np.int64],
              remote_ids: npt.NDArray[np.int64], heads: HeadSlice,
              digest_ids: Sequence[int] | npt.NDArray[np.int64],
              blob: bytes | memoryview | U64, folded: bool, layers: int, planes: int,
              plane_major: bool = False) -> str | None:
        """None when what landed matches the producer's digests of the heads we read; else
        the reason (naming request, block, layer, plane and head), which fails the receive.
        ``blob``: the digests as the wire carries them (``[blocks, layers, planes, heads]``
        little-endian words), or with ``plane_major`` as a landing board's digest area keeps
        them (``[layers x planes, blocks, heads]`` words: kvlink.landing), which the device
        check takes as they are."""
        if not self.on:
            return None
        t0 = time.perf_counter()
        try:
            return self._check(req_id, local_ids, remote_ids, heads, digest_ids, blob, folded,
                               layers, planes, plane_major)
        finally:
            self.check_seconds += time.perf_counter() - t0

    def _check(self, req_id: str, local_ids: npt.NDArray[np.int64],
               remote_ids: npt.NDArray[np.int64], heads: HeadSlice,
               digest_ids: Sequence[int] | npt.NDArray[np.int64],
               blob: bytes | memoryview | U64, folded: bool, layers: int, planes: int,
               plane_major: bool) -> str | None:
        if not len(digest_ids):
            self.failures += 1
            return (f"integrity {self.level.value}: the producer sent no digest for {req_id} "
                    "(is integrity off there, or was it held before its KV was final?): "
                    "not trusted")
        assert self.planes is not None
        i_idx, j_idx = match(remote_ids, digest_ids)
        if not i_idx.size:
            self.failures += 1
            return f"integrity: none of the producer's digested blocks of {req_id} was read"
        lp, rp, count = heads
        k, n = len(digest_ids), int(i_idx.size)
        ran, bad = False, None
        try:
            if plane_major and not folded:  # (a landing board's area: [layers x planes][k])
                by_plane = np.asarray(blob, dtype=np.uint64).reshape(layers * planes, k, -1)
                if n == k and rp == 0 and count == by_plane.shape[2] and on_gpu(self.planes):
                    # every digested block read, every head: the kernel takes them as they are
                    ran, bad = checked_on_gpu(self.planes, local_ids[i_idx], lp, by_plane,
                                               plane_major=True)
                theirs_all = by_plane.reshape(layers, planes, k, -1).transpose(2, 0, 1, 3)
            else:
                theirs_all = np.frombuffer(blob, dtype="<u8").reshape(
                    (k, 1 if folded else layers, 1 if folded else planes, -1))
        except ValueError:
            self.failures += 1
            return f"integrity: the producer's digests of {req_id} have the wrong size"
        if not ran:
            theirs = theirs_all[j_idx][..., rp:rp + count].view(np.uint64)
            ran, bad = (False, None) if folded else checked_on_gpu(
                self.planes, local_ids[i_idx], lp, theirs)
        if not ran:  # folded, or not on a GPU: digest what landed, compare here
            ours = landed(self.planes, local_ids[i_idx], (lp, lp + count))
            if folded:
                ours = fold(ours)
            bad = first_mismatch(theirs, ours)
        if bad is None:
            self.checked_blocks += n
            return None
        self.failures += 1
        b, layer, kv, head = bad
        where = "layers folded" if folded else f"layer {layer}, plane {kv}"
        return (f"integrity: KV of {req_id} differs from the producer's: local block "
                f"{int(local_ids[i_idx[b]])} (remote {int(digest_ids[j_idx[b]])}), {where}, "
                f"head {lp + head} (local)")
