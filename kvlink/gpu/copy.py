"""Batched device copy over extent tables: the data mover of cuda_ipc and of host staging.

A request is thousands of small extents (a 4k-token Llama-70B request is 20480 blocks of 8 KiB);
one ``cudaMemcpyAsync`` each would spend more time launching than copying, and any per-extent
numpy work on the host shows up directly in the request's latency. So the host does as little as
possible: one kernel (kernels.move) reads the extent records from pinned host memory, checks
and translates them, and moves the bytes. Records the caller built in pinned memory
(``host_extents``: the planner writes a request's extents there) are read in place, so a post is
one launch whatever its size. Records in pageable memory are first copied into a pinned buffer,
in pieces, so the GPU starts on the first piece while the host is still copying the next. Where a
program moves long extents (tens of kilobytes each), the records are first copied to the device
(a few kilobytes: one record per long extent), since a program's first load from host memory
waits a PCIe round trip. The kernel is CUDA C compiled by NVRTC (kvlink.gpu.move) where that works,
else the Triton one (kvlink.gpu.kernels). An
invalid extent fails the post and is never touched, though other extents of the post may already
have been copied (a FAILED transfer leaves its destination undefined, as one cut short by a dead
peer does).

Launches skip Triton's Python dispatch after the first call (the compiled kernel is called
directly) when every argument keeps the integer width it was compiled for. Triton is imported
lazily: the package imports on machines without it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError, ExtentOutOfBounds
from kvlink.gpu import move
from kvlink.gpu.lane import END_WORD, BoardDigest, Lane
from kvlink.gpu.lane import NO_MISMATCH as NO_MISMATCH  # (Pending.mismatch: all matched)
from kvlink.gpu.move import parts_per_extent
from kvlink.transport import Extents

log = logging.getLogger("kvlink.cuda_ipc")

CHUNK = 256 << 10  # bytes one Triton program moves of a long extent (CUDA: move.CHUNK)
PIECE = 8192  # extents per launch: the GPU works on one while the host writes the next
FIRST = 4096  # extents of the first launch
SMALL = 64 << 10  # extents up to this size go several to a program
#: a lane's blocks up to this size go several to a program (move.SMALL_SHAPE), larger ones
#: a block to each (move.LARGE_SHAPE): the 8B TP1 request's 32 KiB blocks moved in 270.6-272.7
#: us that way against 278.3-280.2 us several to a program, in two starts of one H200; the
#: 70B TP8 rank's 4 KiB pages take 3x as long a block to a program
#: (bench/results/gpu_lane_shapes_530ee35/)
LANE_SMALL = 16 << 10
# (rows per program, int64 words per load/store step, warps), tuned on an H200
# (scripts/gpu_copy_probe.py at 168f41c, since removed): small extents several to a program,
# long ones in big steps
_SMALL_SHAPE = (4, 1024, 4)
_LARGE_SHAPE = (1, 8192, 16)
_I32 = 1 << 31
_LENT_KEPT = 1024  # host_extents arrays lent out and not yet back from a copy


class RegionMap:
    """Registered regions on the device — (start, end, delta) triples — that the copy kernel
    checks extents against and translates them through (delta: peer pointer -> our mapping)."""

    def __init__(self, starts: npt.ArrayLike, ends: npt.ArrayLike, delta: npt.ArrayLike,
                 device: Any, search: bool = True) -> None:
        import torch

        cols = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (starts, ends, delta)]
        order = np.argsort(cols[0], kind="stable")
        ordered = [c[order] for c in cols]
        disjoint = bool((ordered[0][1:] >= ordered[1][:-1]).all())
        if disjoint:  # sorted by start (the scan's answer is the same: one region fits)
            cols = ordered
        table = np.concatenate(cols)
        self.count = table.shape[0] // 3
        #: what the CUDA C kernels take: -count where the regions are sorted and disjoint
        #: (they search them), else count (they scan them); ``search=False``: always scan
        self.kernel_count = -self.count if search and disjoint and self.count > 1 else self.count
        self._host = cols if disjoint else None  # (starts, ends, deltas), sorted by start
        self.tensor = torch.from_numpy(table).to(device)
        self.ptr = int(self.tensor.data_ptr())

    def through(self, bases: npt.NDArray[np.uint64], span: int) -> npt.NDArray[np.uint64] | None:
        """Each of ``bases`` translated through the one region that holds all of
        ``[base, base + span)``; None where some base has no such region, or where the regions
        overlap (then the kernel's lookup per extent, which takes the first that holds it, is
        kept). A lane translates its segments' bases once this way: every block below its
        side's count then lies in that region, and the device skips the lookup per unit."""
        if self._host is None or span <= 0:
            return None
        starts, ends, deltas = self._host
        at = bases.astype(np.int64)
        r = np.searchsorted(starts, at, side="right") - 1
        if (r < 0).any():
            return None
        if (at + span > ends[r]).any():
            return None
        return (at + deltas[r]).astype(np.uint64)

    @classmethod
    def anywhere(cls, device: Any) -> RegionMap:
        """No restriction: for copies between buffers the caller owns (host staging)."""
        return cls([0], [1 << 62], [0], device)


class _Kernel:
    """One Triton kernel with its launch constants.

    Triton's per-call dispatch (specialisation keys, stream lookup, hook checks) costs more
    host time than the launch itself, and a request's first piece waits for it. So after the
    first dispatched launch the compiled kernel's launcher is called directly — for calls whose
    integer arguments have the widths it was compiled for (``direct``: pointers >= 2**31, counts
    below). Launch hooks of profilers do not see these launches.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._direct: dict[tuple[int, ...], Callable[[int, int, int, tuple[int, ...]], None]] = {}

    def direct(self, consts: tuple[int, ...], warps: int
               ) -> Callable[[int, int, int, tuple[int, ...]], None] | None:
        """The direct launcher (grid x, grid y, raw stream, args), once compiled."""
        return self._direct.get((*consts, warps))

    def __call__(self, grid: tuple[int, int], stream: Any, args: tuple[int, ...],
                 consts: tuple[int, ...], warps: int, direct: bool) -> None:
        launch = self._direct.get((*consts, warps)) if direct else None
        if launch is not None:
            launch(grid[0], grid[1], stream.cuda_stream, args)
            return
        import torch

        from kvlink.gpu import kernels

        fn = getattr(kernels, self.name)
        names = fn.arg_names[len(args):]  # the constexprs, last in the signature
        with torch.cuda.stream(stream):
            compiled = fn[grid](*args, **dict(zip(names, consts)), num_warps=warps)
        if direct:
            self._direct[(*consts, warps)] = _direct_launcher(compiled, consts)


def _direct_launcher(compiled: Any, consts: tuple[int, ...]
                     ) -> Callable[[int, int, int, tuple[int, ...]], None]:
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    meta = getattr(compiled, "packed_metadata", None)
    if run is None or function is None or meta is None:  # another Triton: its public runner

        def runner(g0: int, g1: int, stream: int, args: tuple[int, ...]) -> None:
            compiled[(g0, g1, 1)](*args, *consts, stream=stream)

        return runner

    def launch(g0: int, g1: int, stream: int, args: tuple[int, ...]) -> None:
        run(g0, g1, 1, stream, function, meta, None, None, None, *args, *consts)

    return launch


@dataclasses.dataclass(slots=True)  # not frozen: made on every fused READ's post
class DigestLaunch:
    """What :meth:`BatchCopier.copy_digest`'s kernel needs besides the copy: device pointers
    to the digest geometry and weights, pages per unit (1, or K and V side by side: 2), one
    page's bytes, ``count`` digest rows (a block's row at or past it is not checked: the
    kernel reads no further than that); ``words``: digest words to write back (rows x planes
    x heads; 0: none); ``expect``: device pointer to the producer's rows to compare with (0:
    none)."""

    geometry: int
    weights: int
    pages: int
    page_bytes: int
    count: int
    words: int = 0
    expect: int = 0


class Pending:
    """One enqueued copy: its completion and the records its kernels read (pinned, and on the
    device where they were uploaded). Its completion is a driver event recorded after it, or,
    for a lane's copy (``event`` 0), the end word its stream marks in ``buf`` once the kernel
    has ended (reading it makes no driver call: a poll of a READ in flight reads one word).
    Once seen complete, its status is kept and the event and buffers go back to the copier
    (the event only if nobody took it: ``shared``)."""

    __slots__ = ("_done", "_failed", "buf", "checks_lane", "compared", "dbuf", "digest_at",
                 "digests", "end", "error", "event", "ids", "keep", "looks", "mismatch",
                 "owner", "ptr", "samples", "seq", "shared", "stream")

    def __init__(self, owner: BatchCopier, event: int, buf: _Pinned | None, seq: int,
                 keep: tuple[Extents, ...] = (), dbuf: Any = None, error: str = "",
                 stream: Any = None) -> None:
        self.owner, self.event, self.buf, self.seq = owner, event, buf, seq
        #: a lane's copy: the word its stream sets to ``seq`` once it ended (None: the event)
        self.end: Any = None if event or buf is None else buf.end
        self.ptr = 0 if buf is None else buf.ptr  # (that buffer's address: lane_end reads it)
        self.looks = 0  # (how often it was found not ended: see _LOOKS_BEFORE_ASKING)
        self.keep = keep  # caller's pinned records the kernel reads: alive until it has run
        self.dbuf = dbuf  # device copy of the records, if uploaded
        self.error = error  # the host could not enqueue all of it (why); failed() once done
        self.stream = stream  # the copy's (torch) stream, for completion_event
        self.shared: Any = None  # the torch event completion_event handed out
        #: copy_digest: where in ``buf`` the kernel writes its mismatch word (0: nowhere), and
        #: its digests (first word, count)
        self.digest_at = (0, 0, 0)
        self.digests: npt.NDArray[np.uint64] | None = None  # copied out once done
        #: lowest (row, plane, head) index whose digest differed from the expected ones,
        #: NO_MISMATCH if none did; None where nothing was compared (or the copy failed)
        self.mismatch: int | None = None
        #: the producer's rows compared (a digest lane's copy: known once done, 0 where a unit
        #: found none); ``checks_lane``: its kernel reports in ``buf``'s check words
        self.checks_lane = False
        self.samples = False  # (a digest lane's copy that checks `sample`'s blocks only)
        self.compared = 0
        #: a lane's launch through the C launcher: the ids it launched with (source ids, then
        #: destination ids; int64, ours), whatever form the caller handed them in
        self.ids: npt.NDArray[np.int64] | None = None
        self._done = self._failed = False

    def done(self) -> bool:
        if not self._done:
            owner, end = self.owner, self.end
            if end is None:
                if owner._events.query(self.event):
                    with owner._lock:
                        owner._finish_locked(self)
                return self._done
            lane_end = owner._lane_end
            words = (lane_end(self.ptr, self.seq, self.checks_lane) if lane_end is not None
                     else () if end.value == self.seq else None)
            if words is not None:
                with owner._lock:  # (BatchCopier._finish without its frame: the poll that
                    owner._finish_locked(self, words)  # sees a READ done is on its path)
            else:
                self.looks += 1
                if self.looks % _LOOKS_BEFORE_ASKING == 0:
                    owner._ask_stream(self)
        return self._done

    def failed(self) -> bool:
        """After done(): did the device refuse an extent (so that program copied nothing), or
        could the host not enqueue all of the copy (``error`` says why)?"""
        return self._failed

    def completion_event(self) -> Any:
        """A torch CUDA event complete once the copy has ended: a stream that waits on it runs
        after the copy (whether it succeeded is ``failed()``'s answer). Recorded on the copy's
        stream at the first call, not at the post (which records a driver event of its own,
        cheaper than torch's, or none: a lane's stream marks its end): it may also wait for
        copies posted after this one and before the call, never for less. The same event at
        every call."""
        if self.shared is None:
            self.shared = self.owner.torch.cuda.Event()
            self.shared.record(self.stream)
        return self.shared

    def wait(self) -> None:
        if self._done:
            return
        if self.end is None:
            self.owner._events.synchronize(self.event)
            self.owner._finish(self)
            return
        self.completion_event().synchronize()  # (the copy has ended: its mark is there)
        if not self.done():
            self.owner._ask_stream(self)


class _Pinned:
    """A pinned host buffer and its uint64 view (making the view costs as much as a launch)."""

    __slots__ = ("bytes", "check", "end", "ptr", "size", "status", "tensor", "words")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.size = int(tensor.shape[0])  # its free list's key (torch's shape: a cold call)
        self.ptr: int = tensor.data_ptr()
        self.bytes: npt.NDArray[np.uint8] = tensor.numpy()
        self.words: npt.NDArray[np.uint64] = self.bytes.view(np.uint64)
        #: word 0, the copy's status, as a ctypes scalar: read and cleared once per post, where
        #: numpy's per-scalar path costs several microseconds cold
        self.status = ctypes.c_longlong.from_address(self.ptr)
        #: words 1-3, a digest lane's check words (BatchCopier.copy_lane), read at its DONE
        #: poll in one call, where numpy's slice and list cost several microseconds cold
        #: (every buffer is a page at least: _size_class)
        self.check: Any = (ctypes.c_uint64 * 3).from_address(self.ptr + 8)
        #: a lane's end word (kvlink.gpu.lane.END_WORD), which its stream marks once the copy
        #: has ended (32 bits: cuStreamWriteValue32)
        self.end = ctypes.c_int32.from_address(self.ptr + 8 * END_WORD)


def launch_shape(n: int, first_len: int, chunk: int, min_programs: int,
                 small: tuple[int, int, int], large: tuple[int, int, int]
                 ) -> tuple[tuple[int, int, int], int]:
    """((rows per program, step, warps), programs per row) for n extents: small extents
    several to a program, long ones split into ``chunk``-byte parts, and enough programs to fill
    the GPU. The first extent stands for all: a request's extents are blocks of one size, or
    runs of them."""
    shape = small if first_len <= SMALL else large
    rows = shape[0]
    g = max(1, -(-first_len // chunk))
    if -(-n // rows) * g < min_programs:
        g = max(g, min(-(-min_programs * rows // n), max(1, first_len // 16384)))
    return shape, min(g, 65535)


def piece_cuts(n: int, rows: int, first: int, piece: int) -> list[int]:
    """Ends of the pieces of an n-extent copy: a small first piece so the GPU starts early, then
    full pieces, which the host fills faster than the GPU drains them. Every end but the last
    is a multiple of ``rows`` (a program's rows never straddle two launches)."""
    first = -(-min(first, piece) // rows) * rows
    piece = -(-piece // rows) * rows
    return [*range(first, n, piece), n] if first < n else [n]


#: a lane post's pinned buffer: its status word, a digest lane's three check words, the end
#: word its stream marks (kvlink.gpu.lane.END_WORD)
_STATUS_BYTES = 8 * (END_WORD + 1)
#: a lane's copy not seen ended after this many looks has its stream asked whether it still
#: runs: a stream that never marks its end (a kernel that faulted, its context then dead)
#: fails the copy, where an endless poll would hang it
_LOOKS_BEFORE_ASKING = 4096
#: one lane post in this many is timed on the device (two timing events on its stream: a
#: driver call before its launch and one after), and the first _TIMED_FIRST (device_times;
#: kvlink.gpu.ends.CopyEnds counts with the median of the last five)
_TIMED_EVERY, _TIMED_FIRST = 32, 5
_KEPT_TIMES = 4096  # (BatchCopier.seconds_by_kind)


def _size_class(nbytes: int) -> int:
    """Recycled buffers come in powers of two (at least a page), so posts of similar sizes
    share them."""
    return max(4096, 1 << (nbytes - 1).bit_length())


def _records(ext: Extents) -> npt.NDArray[np.uint64]:
    return np.ascontiguousarray(ext).view(np.uint64)


# arrays handed out by host_extents and their roots (views reach one through .base): id -> array
_HOST_EXTENTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HOST_ADDRESS: dict[int, int] = {}  # id of an array handed out -> its address


def adopt_host_extents(host: npt.NDArray[np.uint8], n: int) -> Extents:
    """``n`` extents over ``host`` (page-locked bytes), known to _pinned_address from now on
    (and views of them) until the last array over the memory is gone."""
    from kvlink.transport import EXTENT_DTYPE

    out = host.view(EXTENT_DTYPE)[:n]
    _HOST_EXTENTS[id(host)] = host
    _HOST_EXTENTS[id(out)] = out
    _HOST_ADDRESS[id(out)] = int(out.ctypes.data)
    weakref.finalize(out, _HOST_ADDRESS.pop, id(out), None)
    return out


def _pinned_address(ext: Extents) -> int:
    """Address of ``ext``'s records if the device can read them in place (contiguous 16-byte
    records in an array from host_extents: page-locked, so host and device address are one
    under UVA), else 0. Pure Python on purpose: a driver query here (``is_pinned``) costs tens
    of microseconds when the host thread has just woken, all of it before the launch."""
    if _HOST_EXTENTS.get(id(ext)) is ext and id(ext) in _HOST_ADDRESS:  # as handed out
        return _HOST_ADDRESS[id(ext)]
    if ext.dtype.itemsize != 16 or not ext.flags.c_contiguous:
        return 0
    root: Any = ext
    while root is not None:
        if _HOST_EXTENTS.get(id(root)) is root:
            return int(ext.ctypes.data)
        root = getattr(root, "base", None)
    return 0


class BatchCopier:
    """Enqueues batched copies on a given stream of one device."""

    def __init__(self, device: Any, *, chunk: int | None = None, piece: int = PIECE,
                 first: int = FIRST, small: tuple[int, int, int] = _SMALL_SHAPE,
                 large: tuple[int, int, int] = _LARGE_SHAPE, kernel: str = "auto") -> None:
        """``kernel``: "cuda" (NVRTC-built, an error if it can't be), "triton", or "auto"
        (CUDA C where it builds, else Triton)."""
        import torch

        if kernel not in ("auto", "cuda", "triton"):
            raise ConfigError(f"kernel must be 'auto', 'cuda' or 'triton', not {kernel!r}")
        self.torch = torch
        self.device = torch.device(device)
        self._cuda = None
        if kernel == "cuda":
            self._cuda = move.CudaMove(self.device)
        elif kernel == "auto":
            self._cuda = move.load(self.device)
        self.kernel = "cuda" if self._cuda is not None else "triton"
        #: the C look at a lane's end (kvlink.native ``lane_end``: its end word, and once that
        #: shows, its status and check words, in one call); None: read through ctypes
        self._lane_end: Callable[[int, int, bool], tuple[bool, int, int, int] | None] | None = (
            getattr(self._cuda.launcher, "lane_end", None) if self._cuda is not None else None)
        if chunk is None:
            chunk = move.CHUNK if self._cuda is not None else CHUNK
        self.chunk = max(4096, int(chunk))
        self.piece = max(1, int(piece))
        self.first = max(1, int(first))
        self.small, self.large = small, large
        props = torch.cuda.get_device_properties(self.device)
        self.min_programs = 4 * int(props.multi_processor_count)
        self._move = _Kernel("move")
        self._seq = itertools.count(1)
        self._inflight: collections.deque[Pending] = collections.deque()
        # recycled: creating an event costs more than recording it, and a pinned allocation
        # the caching allocator can't serve from its cache costs a millisecond
        self._events = move.DriverEvents(self.device.index if self.device.index is not None
                                         else torch.cuda.current_device())
        self._pinned: dict[int, list[_Pinned]] = collections.defaultdict(list)
        #: the free list of a lane post's own buffer (its status and check words): taken
        #: without _take's call and size class on a READ's path before its launch
        self._status_free = self._pinned[_size_class(_STATUS_BYTES)]
        # host_extents' buffers: lent out by id of the array handed out, back once its copy
        # completed (a request's planning allocates nothing in steady state)
        self._records: dict[int, list[_Pinned]] = collections.defaultdict(list)
        self._lent: collections.OrderedDict[int, tuple[Extents, _Pinned]] = (
            collections.OrderedDict())
        self._onboard: dict[int, list[Any]] = collections.defaultdict(list)  # device records
        self._plans: dict[tuple[int, int, bool], tuple[tuple[int, int, int], int, list[int]]] = {}
        self._lock = threading.Lock()  # posts from several threads take turns
        self._order: move.StreamOrder | None = None  # copies after a caller's stream
        self._order_event: int | None = None  # the C launcher's (for the same order)
        self._signal: tuple[int, int, int] | None = None  # the post being enqueued's
        #: whether a stream marks a host word here (cuStreamWriteValue32, a lane's end):
        #: asked at the first lane (None: not yet), which there is none without it
        self._marks: bool | None = None
        #: lane posts until the next one timed on the device (see device_times), how many
        #: were, and those whose times are not read yet: (copy, start and end events, bytes)
        self._untimed = self._times = 0
        self.timed: collections.deque[tuple[Pending, int, int, int]] = collections.deque()
        #: the device times read so far, in seconds, by the kind of lane copy ("plain", or a
        #: digest lane's "sample" and "full"): what a bench splits a request's time with
        #: (the kernel against the host around it); the latest _KEPT_TIMES of each kind
        self.seconds_by_kind: dict[str, collections.deque[float]] = {
            kind: collections.deque(maxlen=_KEPT_TIMES) for kind in ("plain", "sample", "full")}

    def _plan(self, n: int, first_len: int, pieces: bool = True
              ) -> tuple[tuple[int, int, int], int, list[int]]:
        """Launch shape, parts per extent and piece ends, cached: requests repeat their sizes.
        The shape is (rows a program, step, warps) for Triton, (threads a block, threads a
        part, vectors in flight) for CUDA."""
        key = (n, first_len, pieces)
        plan = self._plans.get(key)
        if plan is None:
            if self._cuda is not None:
                shape = self._cuda.shape(first_len, SMALL)
                g = parts_per_extent(n, first_len, self.chunk,
                                     self.min_programs * (shape[0] // shape[1]))
                rows = 1
            else:
                shape, g = launch_shape(n, first_len, self.chunk, self.min_programs,
                                        self.small, self.large)
                rows = shape[0]
            plan = shape, g, piece_cuts(n, rows, self.first, self.piece) if pieces else [n]
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _take(self, nbytes: int) -> _Pinned:
        free = self._pinned[_size_class(nbytes)]
        if free:
            return free.pop()
        return _Pinned(self.torch.empty(_size_class(nbytes), dtype=self.torch.uint8,
                                        pin_memory=True))

    def _finish(self, p: Pending) -> None:
        with self._lock:
            self._finish_locked(p)

    def _take_onboard(self, nbytes: int, stream: Any) -> Any:
        free = self._onboard[_size_class(nbytes)]
        if free:
            return free.pop()
        # allocated on the stream that uses it: the caching allocator may hand out a block
        # freed on the current stream while that stream's kernels still use it
        with self.torch.cuda.stream(stream):
            return self.torch.empty(_size_class(nbytes), dtype=self.torch.uint8,
                                    device=self.device)

    def _finish_locked(self, p: Pending, words: tuple[bool, int, int, int] | tuple[()] = ()
                       ) -> None:
        """``p`` seen complete: its outcome kept, its buffers and event given back. ``words``:
        a lane's status and check words as ``lane_end`` read them (else read here)."""
        if p._done:
            return
        if p.dbuf is not None:
            self._onboard[p.dbuf.shape[0]].append(p.dbuf)
            p.dbuf = None
        if p.buf is not None:
            p._failed = words[0] if words else p.buf.status.value == p.seq
            bad, at, count = p.digest_at
            if p.checks_lane and not p._failed:
                # a digest lane's words side by side — the first index that differed, the rows
                # compared, whether a unit found none: one read (this is a READ's DONE poll)
                first, rows, missed = words[1:] if words else p.buf.check[:]
                p.mismatch = first
                p.compared = 0 if missed else rows
                if not p.compared and p.mismatch == NO_MISMATCH:
                    p.mismatch = None  # a unit found no rows to compare: the caller digests
            elif bad and not p._failed:
                p.mismatch = int(p.buf.words[bad])
            if count and not p._failed:
                p.digests = p.buf.words[at:at + count].copy()
            self._pinned[p.buf.size].append(p.buf)
            p.buf = None
        p._failed = p._failed or bool(p.error)
        for ext in () if p._failed else p.keep:  # a failed copy's records explain the refusal
            lent = self._lent.pop(id(ext), None)
            if lent is not None and lent[0] is ext:
                self._records[lent[1].size].append(lent[1])
        if p.event:
            self._events.recycle(p.event)
        p.keep = ()
        p._done = True

    def _ask_stream(self, p: Pending) -> None:
        """A lane's copy long not seen ended: where its stream has nothing left to run and its
        end is still not marked, or the driver answers with an error (a kernel that faulted
        leaves its context dead), it fails saying so — never an endless poll."""
        with self._lock:
            if p._done or p.end is None or p.end.value == p.seq:
                return
            rc = self._events.stream_query(p.stream.cuda_stream)
            if rc == move.NOT_READY:
                return
            if p.end.value == p.seq:  # (it ended between the two reads)
                self._finish_locked(p)
                return
            p.error = (f"the copy's stream ended without marking its end (seq {p.seq})"
                       if rc == 0 else f"cuStreamQuery of the copy's stream: CUDA error {rc}")
            self._finish_locked(p)

    def host_extents(self, n: int) -> Extents:
        """An uninitialised extent array in pinned memory: records built here are posted
        without a copy (the kernel reads them in place), in one launch. Recycled: once a copy
        that read it completed, the array may be handed out again (do not read it after)."""
        size = _size_class(max(1, n) * 16)
        with self._lock:
            free = self._records[size]
            buf = free.pop() if free else None
        if buf is None:  # a pinned allocation costs tens of microseconds: only to grow
            buf = _Pinned(self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True))
        ext = adopt_host_extents(buf.bytes, n)
        with self._lock:
            self._lent[id(ext)] = (ext, buf)
            while len(self._lent) > _LENT_KEPT:  # planned, never posted: let them go
                self._lent.popitem(last=False)
        return ext

    def copy(self, src: Extents, smap: RegionMap, dst: Extents, dmap: RegionMap,
             stream: Any, after: int | None = None,
             signal: tuple[int, int, int] | None = None) -> Pending:
        """Copy src[i] -> dst[i] for every i on ``stream``, after the work enqueued so far on
        the stream whose raw handle is ``after`` (``torch.cuda.current_stream().cuda_stream``;
        None: no such wait). Extents are checked on the device against their
        maps and translated through them; a refused one shows as ``failed()``, as does a launch
        the driver refused (``error``). Pinned records (``host_extents``) must stay unchanged
        until the copy is done. ``signal``: ``(flag, expect, value)``, a landing flag's device
        address (kvlink.landing) moved from ``expect`` to ``value`` after the copy unless it
        refused an extent — only with :attr:`computes_addresses`."""
        if src.shape != dst.shape:
            raise ExtentOutOfBounds(
                f"source and destination extent counts differ: {src.shape[0]} vs {dst.shape[0]}"
            )
        with self._lock:
            if after is not None and after != stream.cuda_stream:
                # the caller's pending work on `after` first: a wait on the device, no host
                # sync, skipped where `after` has nothing pending
                if self._order is None:
                    self._order = move.StreamOrder()
                self._order.wait(stream.cuda_stream, after)
            held: list[Any] = []  # our buffers the launches read, for the error path
            self._signal = signal
            try:
                return self._copy_locked(src, smap, dst, dmap, stream, held)
            except (RuntimeError, OSError) as exc:  # a CUDA error: what was enqueued may run
                # nothing goes back to the pools: launches already enqueued may read them
                return self._enqueue(stream, None, 0, (src, dst, *held),
                                     error=f"{type(exc).__name__}: {exc}")

    @property
    def computes_addresses(self) -> bool:
        """Whether :meth:`copy_runs` is available (the CUDA C kernel; not Triton's)."""
        return self._cuda is not None

    def copy_runs(self, table: npt.NDArray[np.uint64], segments: int, runs: int,
                  smap: RegionMap, dmap: RegionMap, stream: Any,
                  after: int | None = None, longest: int = -1,
                  signal: tuple[int, int, int] | None = None) -> Pending:
        """:meth:`copy` of segments x runs extents whose addresses the kernel computes:
        ``table`` is (source bases [segments], destination bases [segments], source offsets
        [runs], destination offsets [runs], lengths [runs]) as uint64 — a few kilobytes where
        the extents would be hundreds; ``longest``: the longest length, where the caller knows
        it (-1: found in ``table``); ``signal`` as :meth:`copy` takes it. Only with
        :attr:`computes_addresses`."""
        if self._cuda is None:
            raise ConfigError("copy_runs needs the CUDA C kernel (NVRTC)")
        with self._lock:
            held: list[Any] = []
            self._signal = signal
            try:
                n = segments * runs
                if n == 0:
                    return self._enqueue(stream, None, 0)
                seq = next(self._seq) % (_I32 - 1) + 1
                if longest < 0:
                    longest = int(table[2 * segments + 2 * runs:].max())
                shape = self._cuda.shape(longest, SMALL)
                g = parts_per_extent(n, longest, self.chunk,
                                     self.min_programs * (shape[0] // shape[1]))
                cuda, raw = self._cuda, stream.cuda_stream
                buf, dbuf, _ = self._launch_table(
                    "kv_move_runs", shape, n * g, table, 0, stream, after, held,
                    lambda buf, _words: (segments, runs, smap.ptr, smap.kernel_count,
                                         dmap.ptr, dmap.kernel_count, buf.ptr, seq, g),
                    lambda args: cuda.launch(shape, n * g, args, raw, runs=True))
                return self._enqueue(stream, buf, seq, (), dbuf)
            except (RuntimeError, OSError) as exc:
                return self._enqueue(stream, None, 0, tuple(held),
                                     error=f"{type(exc).__name__}: {exc}")

    def copy_digest(self, table: npt.NDArray[np.uint64], segments: int, blocks: int, unit: int,
                    smap: RegionMap, dmap: RegionMap, stream: Any, after: int | None,
                    digest: DigestLaunch) -> Pending:
        """:meth:`copy_runs` of one ``unit`` per (segment, block) — ``table`` is (source bases
        [segments], destination bases [segments], source offsets [blocks], destination
        offsets [blocks], each block's digest row [blocks] (int64 bits; -1: not checked)) —
        with the integrity digests of what lands computed by the same kernel
        (``kv_move_digest``; a block that is not checked is only copied): once done,
        ``Pending.digests`` holds ``digest.words`` of them, and ``Pending.mismatch`` says
        whether they equal ``digest.expect``'s. Only with :attr:`computes_addresses`."""
        if self._cuda is None:
            raise ConfigError("copy_digest needs the CUDA C kernel (NVRTC)")
        if table.shape[0] != 2 * segments + 3 * blocks:
            raise ConfigError(f"copy_digest: a table of {table.shape[0]} words for {segments} "
                              f"segments and {blocks} blocks (2 x segments + 3 x blocks)")
        with self._lock:
            held: list[Any] = []
            self._signal = None
            try:
                if segments * blocks == 0:
                    return self._enqueue(stream, None, 0)
                seq = next(self._seq) % (_I32 - 1) + 1
                cuda, raw = self._cuda, stream.cuda_stream
                units = segments * blocks

                def args(buf: _Pinned, words: int) -> tuple[int, ...]:
                    bad = buf.ptr + 8 + 8 * words  # host memory the device writes (UVA)
                    buf.words[1 + words] = NO_MISMATCH
                    out = bad + 8 if digest.words else 0
                    return (segments, blocks, unit, smap.ptr, smap.kernel_count, dmap.ptr,
                            dmap.kernel_count, buf.ptr, seq, digest.geometry, digest.weights,
                            digest.count, out, digest.pages, digest.page_bytes,
                            digest.expect, bad)

                # spare: the mismatch word, then the digests written back
                buf, dbuf, words = self._launch_table(
                    "kv_move_digest", move.DIGEST_SHAPE, units, table, 1 + digest.words,
                    stream, after, held, args, lambda a: cuda.launch_digest(units, a, raw))
                pending = self._enqueue(stream, buf, seq, (), dbuf)
                pending.digest_at = (1 + words if digest.expect else 0, 2 + words,
                                     digest.words)
                pending.compared = digest.count if digest.expect else 0
                return pending
            except (RuntimeError, OSError) as exc:
                return self._enqueue(stream, None, 0, tuple(held),
                                     error=f"{type(exc).__name__}: {exc}")

    def mark(self, stream: Any) -> int:
        """An event after every copy enqueued on ``stream`` so far (ask :meth:`passed`):
        what a buffer those copies may read waits for before it is let go."""
        with self._lock:
            return self._events.record(stream.cuda_stream)

    def passed(self, event: int) -> bool:
        """Whether the copies before ``event`` (:meth:`mark`) have all ended; once they have,
        the event is recycled (not to be asked again)."""
        with self._lock:
            if not self._events.query(event):
                return False
            self._events.recycle(event)
            return True

    @property
    def takes_lists(self) -> bool:
        """Whether :meth:`copy_lane` takes ids as lists of ints too (the C launcher copies
        them into the launch itself; kvlink.native)."""
        return self._cuda is not None and self._cuda.launcher is not None

    def lane(self, src_base: npt.NDArray[np.uint64], dst_base: npt.NDArray[np.uint64],
             unit: int, limits: tuple[int, int], smap: RegionMap, dmap: RegionMap,
             digest: BoardDigest | None = None) -> Lane | None:
        """A :class:`~kvlink.gpu.lane.Lane` for :meth:`copy_lane`: whole ``unit``-byte blocks
        from ``src_base[s] + id * unit`` to ``dst_base[s] + id * unit``, ids below ``limits``
        (source, destination block counts) (``digest``: the fused digest's kernel, as
        :meth:`copy_digest`, comparing with the rows it finds on the producer's hold board).
        None without :attr:`computes_addresses` (post the general way)."""
        if self._cuda is None or not self._marks_ends():
            return None
        return Lane(self._cuda, src_base, dst_base, unit, limits, (smap, dmap),
                    chunk=self.chunk, min_programs=self.min_programs, small=LANE_SMALL,
                    digest=digest)

    def _marks_ends(self) -> bool:
        """Whether a stream can mark a lane's end here (cuStreamWriteValue32 into a pinned
        host word): tried once, on a stream of its own (not the caller's, which may hold a
        forward's work). Without it there are no lanes (posts go the general way, whose
        completion is an event), said once in the log."""
        if self._marks is None:
            with self._lock:
                buf = self._take(_STATUS_BYTES)
                buf.end.value = 0
                probe = self.torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                rc = self._events.mark_end(probe.cuda_stream, buf.ptr + 8 * END_WORD, 1)
                probe.synchronize()
                self._marks = rc == 0 and buf.end.value == 1
                self._pinned[buf.size].append(buf)
            if not self._marks:
                log.warning("cuda_ipc: no lanes on %s: a stream cannot mark a host word here "
                            "(cuStreamWriteValue32: CUDA error %d); copies post the general way",
                            self.device, rc)
        return self._marks

    def copy_lane(self, lane: Lane, src_ids: npt.NDArray[np.int64],
                  dst_ids: npt.NDArray[np.int64], stream: Any, after: int | None,
                  generation: int = 0, sample: bool = False,
                  signal: tuple[int, int, int] | None = None) -> Pending:
        """:meth:`copy_runs` (or, on a digest lane, :meth:`copy_digest`) of one run per block
        pair through ``lane`` (``lane.fits(len(src_ids))``; the device refuses an id out of
        range, like an extent outside the regions): the same kernels, status and completion,
        with nothing but the block ids written per post.
        ``generation`` (a digest lane): the hold whose rows its kernel finds on the producer's
        board and compares — :attr:`Pending.mismatch` and :attr:`Pending.compared` say once
        done; ``sample``: it checks the blocks ``sample`` picks (kvlink.integrity.checked, by
        the generation), else every block. With the C launcher (``takes_lists``) the ids may
        also be lists of ints; ids it does not take raise TypeError, ValueError or
        OverflowError, and nothing was enqueued. ``signal`` as :meth:`copy` takes it (a push
        into a landing board), after the copy and before its end mark."""
        with self._lock:
            buf: _Pinned | None = None
            start = 0  # a timed copy's start event (see device_times)
            try:
                seq = next(self._seq) % (_I32 - 1) + 1
                free = self._status_free  # (its status and end words: cleared by the launch)
                buf = free.pop() if free else self._take(_STATUS_BYTES)
                raw = stream.cuda_stream
                # a digest lane's kernel reports in three words: the first differing index,
                # the rows it compared, whether any unit found none (kv_move_digest,
                # KV_BOARD); the launch sets them to where the kernel starts from
                check = None if lane.digest is None else (generation, buf.ptr + 8, sample)
                launcher = self._cuda.launcher if self._cuda is not None else None
                if launcher is None:
                    buf.status.value = buf.end.value = 0
                    self._after(raw, after)
                    lane.launch(src_ids, dst_ids, buf.ptr, seq, raw, check)
                    if signal is not None:  # (before the end mark: see _enqueue)
                        self._cuda.signal(buf.ptr, seq, *signal, raw)  # type: ignore[union-attr]
                    rc = self._events.mark_end(raw, buf.ptr + 8 * END_WORD, seq)
                    if rc:
                        raise RuntimeError(f"marking the end (cuStreamWriteValue32), after the "
                                           f"launch, failed with CUDA error {rc}")
                else:  # the C launcher: the ids, the order after the caller's stream, the
                    # kernel and its end mark in one call. (Written out here, not a method: a
                    # READ's frames before its launch cost microseconds each cold,
                    # bench/results/gpu_ab_6dccf04)
                    if self._order_event is None:  # ours for good: serves every order
                        self._order_event = self._events.take()
                    self._untimed -= 1
                    if self._untimed < 0:  # (a driver that refuses timing events is asked
                        self._untimed = _TIMED_EVERY - 1  # again no sooner than a timed post)
                        start = self._events.take_timed()  # (recorded by the launch itself,
                        # right before the kernel: the host's steps before it are no part of
                        # the copy's time)
                    try:
                        timed = lane.post(launcher, src_ids, dst_ids, buf.ptr, seq, raw, after,
                                          self._order_event, check,
                                          None if signal is None else (
                                              self._cuda.signal_fn(),  # type: ignore[union-attr]
                                              *signal), start)
                    except (TypeError, ValueError, OverflowError):  # ids it does not take:
                        self._pinned[buf.size].append(buf)  # nothing made
                        if start:
                            self._events.recycle_timed(start)
                            self._untimed = 0  # (the next post is timed in its place)
                        raise
                    if start and not timed:  # the driver refused to record it: untimed
                        self._events.recycle_timed(start)
                        start = 0
                # (no event: the stream marks its end in buf, Pending.done reads it)
                pending = self._track(stream, buf, seq, 0)
                if start:  # after its end mark: the copy's time (the first few back to
                    self._times += 1  # back: the median of five the transport counts with)
                    self._untimed = 0 if self._times < _TIMED_FIRST else _TIMED_EVERY - 1
                    end = self._events.record_timed(raw)  # (0: refused; never raises: the
                    if end:  # copy is enqueued, and a FAILED copy must not still move bytes)
                        self.timed.append((pending, start, end,
                                           len(src_ids) * lane.segments * lane.unit))
                    else:
                        self._events.recycle_timed(start)
                    start = 0  # (device_times' now)
                if launcher is not None:
                    pending.ids = lane.posted(len(src_ids))
                pending.checks_lane = check is not None
                pending.samples = sample
                return pending
            except (RuntimeError, OSError) as exc:  # nothing of ours goes back: see copy()
                if start:  # (a timing event no copy's time reads)
                    self._events.recycle_timed(start)
                held: tuple[Any, ...] = () if buf is None else (buf,)
                return self._enqueue(stream, None, 0, held,
                                     error=f"{type(exc).__name__}: {exc}")

    def device_times(self) -> list[tuple[int, float]]:
        """(bytes, seconds on the device) of the lane copies timed since the last call whose
        times are in — the first few, then one post in :data:`_TIMED_EVERY`, each bracketed by
        two timing events on the copy's stream: what a transport expects its copies to take
        (kvlink.gpu.ends.CopyEnds.timed), where the host sees them end late or early. A
        copy that failed is left out (a refused kernel ends at once)."""
        got = []
        with self._lock:
            while self.timed:
                p, start, end, nbytes = self.timed[0]
                try:
                    seconds = self._events.elapsed(start, end)
                except RuntimeError as exc:  # (both events recycled): not a copy's time
                    log.debug("cuda_ipc: a timed copy's time: %s", exc)
                    seconds = 0.0
                if seconds is None:  # not ended yet: neither has any after it
                    break
                self.timed.popleft()
                got.append((p, nbytes, seconds))
        times = [(p, n, s) for p, n, s in got if s > 0 and p.done() and not p.failed()]
        for p, _, s in times:
            kind = "plain" if not p.checks_lane else "sample" if p.samples else "full"
            self.seconds_by_kind[kind].append(s)
        return [(n, s) for _, n, s in times]

    def _launch_table(self, name: str, shape: tuple[int, int, int], units: int,
                      table: npt.NDArray[np.uint64], spare: int, stream: Any,
                      after: int | None, held: list[Any],
                      args: Callable[[_Pinned, int], tuple[int, ...]],
                      uploaded: Callable[[tuple[int, ...]], None]) -> tuple[_Pinned, Any, int]:
        """A computed-address kernel ``name`` over ``units``, on ``stream`` after ``after``:
        its ``table`` passed with the launch where a size class takes it (no upload, nothing
        of ours on the device), else uploaded first and launched by ``uploaded(table's device
        address, *args)``. ``args(buf, words)``: the kernel's arguments after the table, for
        the pinned buffer ``buf`` (its status word, the table's ``words`` when uploaded from
        it, then ``spare`` words the kernel writes). Returns (buf, the device copy of the
        table or None, words)."""
        assert self._cuda is not None
        raw = stream.cuda_stream
        if self._cuda.table_class(table.shape[0]):
            buf = self._take(8 + 8 * spare)
            held.append(buf)
            buf.status.value = 0
            self._after(raw, after)
            if self._cuda.launch_with_table(name, shape, units, table, args(buf, 0), raw):
                return buf, None, 0
            held.remove(buf)  # no such kernel here after all: uploaded, below
            self._pinned[buf.size].append(buf)
        buf, dbuf, at = self._stage(table, spare, stream, after, held)
        words = int(table.shape[0])
        uploaded((at, *args(buf, words)))
        return buf, dbuf, words

    def _after(self, raw: int, after: int | None) -> None:
        if after is not None and after != raw:
            if self._order is None:
                self._order = move.StreamOrder()
            self._order.wait(raw, after)

    def _stage(self, table: npt.NDArray[np.uint64], spare: int, stream: Any,
               after: int | None, held: list[Any]) -> tuple[_Pinned, Any, int]:
        """The computed-address kernels' start: ``table`` into a pinned buffer (its status word
        first, ``spare`` words after the table for the kernel), one small upload to the device
        (the kernel's loads then hit device memory, not PCIe), then ``stream`` ordered after
        ``after`` — after the upload, which touches only our buffer: the table is on the device
        by the time the caller's work ends (a layer-wise push's last range is then one launch
        behind the forward, not an upload and one). Returns (buffer, device copy, its
        address); both go into ``held``."""
        assert self._cuda is not None
        words = table.shape[0]
        buf = self._take(8 + 8 * words + 8 * spare)
        held.append(buf)
        buf.status.value = 0
        buf.words[1:1 + words] = table
        dbuf = self._take_onboard(8 * words, stream)
        held.append(dbuf)
        at = int(dbuf.data_ptr())
        raw = stream.cuda_stream
        self._cuda.upload(at, buf.ptr + 8, 8 * words, raw)
        self._after(raw, after)
        return buf, dbuf, at

    def _copy_locked(self, src: Extents, smap: RegionMap, dst: Extents, dmap: RegionMap,
                     stream: Any, held: list[Any]) -> Pending:
        n = src.shape[0]
        if n == 0:
            return self._enqueue(stream, None, 0)
        # everything up to the first launch is the request's latency: nothing else here
        seq = next(self._seq) % (_I32 - 1) + 1
        s_at, d_at = _pinned_address(src), _pinned_address(dst)
        first_len = int(src[0]["len"])
        if self._cuda is not None and first_len > SMALL:
            return self._copy_onboard(src, smap, dst, dmap, stream, seq, s_at, d_at,
                                      first_len, held)
        if s_at and d_at:  # read in place: one launch, only a status word of ours
            buf = self._take(8)
            held.append(buf)
            buf.status.value = 0
            plan = self._plan(n, first_len, pieces=False)
            self._launch(plan, s_at, d_at, 0, n, smap, dmap, buf.ptr, seq, stream)
            return self._enqueue(stream, buf, seq, (src, dst))
        buf = self._take(8 + 32 * n)
        held.append(buf)
        hv, hp = buf.words, buf.ptr
        hv[0] = 0
        s_rec, d_rec = _records(src), _records(dst)
        plan = self._plan(n, int(s_rec[1]))
        p0 = 0
        for p1 in plan[2]:
            hv[1 + 2 * p0 : 1 + 2 * p1] = s_rec[2 * p0 : 2 * p1]
            hv[1 + 2 * n + 2 * p0 : 1 + 2 * n + 2 * p1] = d_rec[2 * p0 : 2 * p1]
            self._launch(plan, hp + 8 + 16 * p0, hp + 8 + 16 * (n + p0), p0, p1, smap, dmap,
                         hp, seq, stream)
            p0 = p1
        return self._enqueue(stream, buf, seq)

    def _copy_onboard(self, src: Extents, smap: RegionMap, dst: Extents, dmap: RegionMap,
                      stream: Any, seq: int, s_at: int, d_at: int, first_len: int,
                      held: list[Any]) -> Pending:
        """Long extents: upload the records (one per extent, so few), then one launch that
        reads them from device memory."""
        n = src.shape[0]
        keep: tuple[Extents, ...] = (src, dst)
        if s_at and d_at:
            buf = self._take(8)
        else:  # ordinary arrays: through our pinned buffer
            buf = self._take(8 + 32 * n)
            buf.words[1 : 1 + 2 * n] = _records(src)
            buf.words[1 + 2 * n : 1 + 4 * n] = _records(dst)
            s_at, d_at, keep = buf.ptr + 8, buf.ptr + 8 + 16 * n, ()
        held.append(buf)
        buf.status.value = 0
        dbuf = self._take_onboard(32 * n, stream)
        held.append(dbuf)
        at = int(dbuf.data_ptr())
        assert self._cuda is not None
        raw = stream.cuda_stream
        self._cuda.upload(at, s_at, 16 * n, raw)
        self._cuda.upload(at + 16 * n, d_at, 16 * n, raw)
        plan = self._plan(n, first_len, pieces=False)
        self._launch(plan, at, at + 16 * n, 0, n, smap, dmap, buf.ptr, seq, stream)
        return self._enqueue(stream, buf, seq, keep, dbuf)

    def _launch(self, plan: tuple[tuple[int, int, int], int, list[int]], s_at: int, d_at: int,
                p0: int, p1: int, smap: RegionMap, dmap: RegionMap, status: int, seq: int,
                stream: Any) -> None:
        """One kernel over rows [p0, p1) whose records start at s_at / d_at."""
        shape, g, _ = plan
        if self._cuda is not None:
            args = (s_at, d_at, p1 - p0, smap.ptr, smap.kernel_count, dmap.ptr,
                    dmap.kernel_count, status, seq, g)
            self._cuda.launch(shape, (p1 - p0) * g, args, stream.cuda_stream)
            return
        args = (s_at, d_at, p1 - p0, smap.ptr, smap.count, dmap.ptr, dmap.count, status, seq, g)
        rows, block, warps = shape
        consts = (rows, block)
        grid = -(-(p1 - p0) // rows)
        direct = min(s_at, d_at, smap.ptr, dmap.ptr, status) >= _I32 and p1 - p0 < _I32
        launch = self._move.direct(consts, warps) if direct else None
        if launch is not None:
            launch(grid, g, stream.cuda_stream, args)
        else:
            self._move((grid, g), stream, args, consts, warps, direct)

    def _enqueue(self, stream: Any, buf: _Pinned | None, seq: int,
                 keep: tuple[Extents, ...] = (), dbuf: Any = None, error: str = "") -> Pending:
        """The post's signal (if any, and only after launches that were all enqueued), then the
        completion event — after the signal, so that the status word it reads is not handed
        back before it ran; finished posts hand back their buffers."""
        signal, self._signal = self._signal, None
        if signal is not None and buf is not None and not error and self._cuda is not None:
            self._cuda.signal(buf.ptr, seq, *signal, stream.cuda_stream)
        return self._track(stream, buf, seq, self._events.record(stream.cuda_stream), keep,
                           dbuf, error)

    def _track(self, stream: Any, buf: _Pinned | None, seq: int, event: int,
               keep: tuple[Extents, ...] = (), dbuf: Any = None, error: str = "") -> Pending:
        """A copy enqueued, its completion ``event`` recorded: kept in flight (and the copies
        seen finished meanwhile handed back)."""
        events, inflight = self._events, self._inflight
        while inflight and (inflight[0]._done or (
                events.query(inflight[0].event) if inflight[0].end is None
                else inflight[0].end.value == inflight[0].seq)):
            p = inflight.popleft()
            if not p._done:  # (a copy its poll saw done is finished: no call, on a post's path)
                self._finish_locked(p)
        pending = Pending(self, event, buf, seq, keep, dbuf, error, stream)
        self._inflight.append(pending)
        return pending
