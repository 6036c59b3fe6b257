"""CPU all-reduce over POSIX shared memory: the GPU protocol, for CPU tensor-parallel decode.

Why: gloo's all_reduce goes through TCP loopback and costs milliseconds for a 128 KiB decode
message; processes on one host can instead share one mapping and synchronise on flags, which costs
a memcpy, the reduction itself and two barriers of a few microseconds each.

Segment layout (one file in /dev/shm, created by group rank 0, unlinked as soon as every rank has
mapped it, so a crash leaks nothing)::

    header  (4 KiB)   magic, version, world, capacity, abort word, pid of every rank, the
                      PID namespace of every rank
    start   flags     one 64-byte line per rank (int64 epoch)
    end     flags     one 64-byte line per rank
    slot[r]           per-rank input, ``capacity`` bytes each (4 KiB aligned)
    result            two-shot reduce-scatter output, ``capacity`` bytes

Protocol for call number ``e`` (``e`` grows by one per call on every rank):

* one-shot: copy input into ``slot[rank]``; start barrier (``start[rank] = e``, wait for all);
  every rank sums all slots in rank order into its output (fp32 accumulation, so all ranks get
  bit-identical results); end barrier, after which no peer reads our slot any more.
* two-shot: copy input into ``slot[rank]``; start barrier; each rank reduces its ``1/world``
  chunk of every slot (same fixed order) into ``result``; end barrier; everyone copies ``result``.
  No third barrier is needed: ``result`` is only rewritten after the next start barrier, which no
  rank passes before every peer has finished gathering.

The arithmetic runs through torch's vectorised CPU kernels on zero-copy views of the mapping
(numpy has no bf16 and its fp16 casts are ~10x slower); flags and layout are plain int64 words.
Set ``torch.set_num_threads`` to the cores each rank owns: torch's intra-op threads would otherwise
compete with the peers that the barriers wait for.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import tempfile
import uuid
from types import TracebackType

import torch
import torch.distributed as dist

from kvlink.allreduce._dist import agree, broadcast_obj, rank_and_world
from kvlink.allreduce.config import AllReduceConfig, ModeArg, choose_mode
from kvlink.allreduce.spin import FLAG_STRIDE_WORDS, EpochBarrier, ordering_is_safe
from kvlink.errors import AllReduceError

log = logging.getLogger("kvlink.allreduce")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_MAGIC = 0x6B766C6B5F617231  # "kvlk_ar1"
_VERSION = 2  # (2: the ranks' PID namespaces in the header)
_PAGE = 4096
_LINE = 64
_HEADER_BYTES = _PAGE
_H_MAGIC, _H_VERSION, _H_WORLD, _H_CAPACITY, _H_ABORT = 0, 1, 2, 3, 4
_H_PIDS = 8
#: where the ranks' PID namespaces are (the inode of /proc/self/ns/pid; 0: unknown). A pid
#: means a process only in its own namespace: ranks in two containers sharing /dev/shm (or
#: one started under ``unshare --pid``) see each other's pids as other processes or none, and
#: a live peer was taken for one that exited (PeerExitedError) where its number was unused
#: here. Such a peer's liveness is left to the timeout.
_H_PIDNS = 256
MAX_RANKS = _H_PIDNS - _H_PIDS  # (the header's words for the pids)
#: Two-shot chunk boundaries fall on this many elements, so ranks never write the same line.
_CHUNK_ALIGN = 32


def _pid_namespace() -> int:
    """This process's PID namespace (the inode of its /proc entry; 0 where there is none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ShmLayout:
    """Byte offsets of one segment; a pure function of (world, capacity) so every rank agrees."""

    world: int
    capacity: int

    @property
    def start_flags(self) -> int:
        return _HEADER_BYTES

    @property
    def end_flags(self) -> int:
        return _HEADER_BYTES + self.world * _LINE

    @property
    def slots(self) -> int:
        return _round_up(_HEADER_BYTES + 2 * self.world * _LINE, _PAGE)

    def slot(self, rank: int) -> int:
        return self.slots + rank * self.capacity

    @property
    def result(self) -> int:
        return self.slots + self.world * self.capacity

    @property
    def total(self) -> int:
        return self.result + self.capacity


def _shm_dir(explicit: str | None) -> str:
    if explicit:
        return explicit
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclasses.dataclass
class _Views:
    """Zero-copy tensors over the segment for one (dtype, numel): cached, decode sizes repeat."""

    slots: list[torch.Tensor]
    result: torch.Tensor
    acc: torch.Tensor | None
    chunks: list[torch.Tensor]
    result_chunk: torch.Tensor
    acc_chunk: torch.Tensor | None


class ShmAllReduce:
    """Sum CPU tensors across the ranks of ``group`` through one shared-memory segment.

    ``group`` is a CPU process group (gloo) used only here, at construction, to agree on the
    segment. Every rank must then make the same sequence of :meth:`all_reduce` calls with the same
    shapes, dtypes and modes. A peer that stops calling makes the others raise
    :class:`~kvlink.allreduce.exceptions.PeerTimeoutError` (an ``AllReduceError``) naming it, after
    at most ``config.timeout_s`` seconds; the communicator is unusable after any error.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        config: AllReduceConfig | None = None,
        shm_dir: str | None = None,
        allow_weak_ordering: bool = False,
    ) -> None:
        self.config = config or AllReduceConfig()
        self.rank, self.world_size = rank_and_world(group)
        if self.world_size > MAX_RANKS:
            raise AllReduceError(f"shared-memory all-reduce: a group of {self.world_size} ranks "
                                 f"(at most {MAX_RANKS})")
        self._closed = False
        self._pidns = _pid_namespace()
        self._broken: str | None = None
        self._epoch = 0
        self._cache: dict[tuple[torch.dtype, int], _Views] = {}
        #: the fp32 accumulator of 16-bit calls, one for every size (calls run one at a time):
        #: one per cached size held up to 256 of them, 2 x the segment each at the top
        self._acc: torch.Tensor | None = None
        cap = _round_up(self.config.max_bytes, _PAGE)
        self.layout = ShmLayout(self.world_size, cap)
        self._mmap: mmap.mmap | None = None

        problem = ""
        if not (ordering_is_safe() or allow_weak_ordering):
            problem = "host CPU is not x86 (plain loads/stores are not ordered; see spin.py)"
        path = ""
        if self.rank == 0 and not problem:
            try:
                path = self._create(_shm_dir(shm_dir))
            except OSError as exc:
                problem = f"cannot create the shared segment: {exc}"
        path = broadcast_obj(path if not problem else "", group)
        if path and not problem:
            try:
                self._attach(path)
            except OSError as exc:
                problem = f"cannot map {path}: {exc}"
        verdict = agree(not problem and bool(path), problem or "rank 0 made no segment", group)
        if self.rank == 0 and path:
            dist.barrier(group=group)  # every rank has mapped it (or failed): unlink now
            _unlink(path)
        elif path:
            dist.barrier(group=group)
        if verdict is not None:
            self.close()
            raise AllReduceError(f"shared-memory all-reduce unavailable: {verdict}")

    # ---------------------------------------------------------------- setup
    def _create(self, directory: str) -> str:
        path = os.path.join(directory, f"kvlink-ar-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.layout.total)
            mm = mmap.mmap(fd, self.layout.total)
        except OSError:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        header = memoryview(mm)[:_HEADER_BYTES].cast("q")
        header[_H_WORLD] = self.world_size
        header[_H_CAPACITY] = self.layout.capacity
        header[_H_VERSION] = _VERSION
        header[_H_MAGIC] = _MAGIC
        header.release()
        mm.close()
        return path

    def _attach(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != self.layout.total:
                raise OSError(f"segment is {size} bytes, expected {self.layout.total}")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        whole = memoryview(self._mmap)
        # absolute address of the mapping, for futex waits on flag words (kept as an export)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        base_addr = ctypes.addressof(self._anchor)
        self._header = whole[:_HEADER_BYTES].cast("q")
        if self._header[_H_MAGIC] != _MAGIC or self._header[_H_WORLD] != self.world_size:
            raise OSError("segment header does not match this group (magic/world)")
        self._header[_H_PIDS + self.rank] = os.getpid()
        self._header[_H_PIDNS + self.rank] = self._pidns
        lay = self.layout
        span = self.world_size * _LINE

        def barrier(name: str, offset: int) -> EpochBarrier:
            return EpochBarrier(
                whole[offset : offset + span].cast("q"),
                address=base_addr + offset,
                name=name,
                rank=self.rank,
                world=self.world_size,
                timeout_s=self.config.timeout_s,
                pid_of=self._pid_of,
                aborted=self._aborted,
            )

        self._start = barrier("start", lay.start_flags)
        self._end = barrier("end", lay.end_flags)
        self._bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._whole = whole
        assert FLAG_STRIDE_WORDS * 8 == _LINE

    def _pid_of(self, rank: int) -> int:
        """``rank``'s pid as this process can check it; 0 (not checked) where it lives in
        another PID namespace (see _H_PIDNS)."""
        if self._header[_H_PIDNS + rank] != self._pidns:
            return 0
        return int(self._header[_H_PIDS + rank])

    def _aborted(self) -> int:
        return int(self._header[_H_ABORT])

    # ---------------------------------------------------------------- views
    def _views(self, dtype: torch.dtype, n: int) -> _Views:
        key = (dtype, n)
        views = self._cache.get(key)
        if views is not None:
            return views
        if len(self._cache) >= 256:
            self._cache.clear()
        lay = self.layout
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = n * size

        def at(offset: int, count: int) -> torch.Tensor:
            return self._bytes[offset : offset + count * size].view(dtype)

        slots = [at(lay.slot(p), n) for p in range(self.world_size)]
        result = at(lay.result, n)
        assert nbytes <= lay.capacity
        chunk = _round_up(-(-n // self.world_size), _CHUNK_ALIGN)
        lo = min(n, self.rank * chunk)
        hi = min(n, lo + chunk)
        chunks = [s[lo:hi] for s in slots]
        acc = self._accumulator()[:n] if dtype != torch.float32 else None
        views = _Views(
            slots=slots,
            result=result,
            acc=acc,
            chunks=chunks,
            result_chunk=result[lo:hi],
            acc_chunk=acc[: hi - lo] if acc is not None else None,
        )
        self._cache[key] = views
        return views

    def _accumulator(self) -> torch.Tensor:
        """fp32 room for the most elements of a 16-bit call the segment takes, made at the
        first such call and sliced by every size."""
        if self._acc is None:
            self._acc = torch.empty(self.layout.capacity // 2, dtype=torch.float32)
        return self._acc

    # ---------------------------------------------------------------- hot path
    def all_reduce(
        self, x: torch.Tensor, out: torch.Tensor | None = None, *, mode: ModeArg = "auto"
    ) -> torch.Tensor:
        """Return the element-wise sum of ``x`` over all ranks (in ``out`` if given; may be ``x``).

        Messages larger than the segment are reduced in ``capacity``-sized pieces; the mode is
        chosen per piece from its size (identically on every rank).
        """
        if self._broken is not None:
            raise AllReduceError(f"all-reduce communicator is broken: {self._broken}")
        if self._closed:
            raise AllReduceError("all-reduce communicator is closed")
        if x.device.type != "cpu":
            raise AllReduceError(f"shm all-reduce takes CPU tensors, got device {x.device}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise AllReduceError(f"shm all-reduce supports bf16/fp16/fp32, got {x.dtype}")
        if x.requires_grad or (out is not None and out.requires_grad):
            # (refused before any barrier: inside a step, torch's out= refusal broke the
            # communicator on every rank for good)
            raise AllReduceError("shm all-reduce takes tensors outside autograd (under "
                                 "torch.no_grad() or inference_mode, or x.detach())")
        src = (x if x.is_contiguous() else x.contiguous()).view(-1)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise AllReduceError(
                f"out must be contiguous {tuple(x.shape)} {x.dtype}, got "
                f"{tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}"
            )
        dst = out.view(-1)
        n = src.numel()
        if n == 0:
            return out
        if self.world_size == 1:
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            return out
        size = src.element_size()
        per_step = self.layout.capacity // size
        if n <= per_step:
            whole = choose_mode(n * size, self.world_size, self.config, mode, cpu=True)
            self._step(src, dst, whole)
            return out
        for lo in range(0, n, per_step):
            hi = min(n, lo + per_step)
            piece = choose_mode((hi - lo) * size, self.world_size, self.config, mode, cpu=True)
            self._step(src[lo:hi], dst[lo:hi], piece)
        return out

    def _step(self, src: torch.Tensor, dst: torch.Tensor, mode: str) -> None:
        views = self._views(src.dtype, src.numel())
        epoch = self._epoch + 1
        me = _signature(src, mode)
        try:
            views.slots[self.rank].copy_(src)
            self._start.arrive(epoch, me)
            self._start.wait(epoch)
            notes = self._start.notes()
            if any(n != me for n in notes):  # (every rank sees the same notes: all raise)
                raise AllReduceError(
                    "the ranks called all-reduce with different tensors (each must make the "
                    "same calls, same shapes and dtypes): "
                    + "; ".join(f"rank {r}: {_described(n)}" for r, n in enumerate(notes)))
            if mode == "one_shot":
                _reduce_in_order(views.slots, dst, views.acc)
                self._end.arrive(epoch)
                self._end.wait(epoch)
            else:
                if views.result_chunk.numel():
                    _reduce_in_order(views.chunks, views.result_chunk, views.acc_chunk)
                self._end.arrive(epoch)
                self._end.wait(epoch)
                dst.copy_(views.result)
        except BaseException as exc:
            self._broken = str(exc) or type(exc).__name__
            if self._header[_H_ABORT] == 0:
                self._header[_H_ABORT] = self.rank + 1
            raise
        self._epoch = epoch

    # ---------------------------------------------------------------- teardown
    @property
    def calls(self) -> int:
        """Number of completed barrier epochs (one per step)."""
        return self._epoch

    def close(self) -> None:
        """Unmap the segment (idempotent). Peers still calling will time out naming this rank."""
        if self._closed:
            return
        self._closed = True
        self._cache.clear()
        self._acc = None
        for attr in ("_start", "_end"):
            barrier = self.__dict__.pop(attr, None)
            if isinstance(barrier, EpochBarrier):
                barrier.release()
        self.__dict__.pop("_bytes", None)
        self.__dict__.pop("_anchor", None)
        for attr in ("_header", "_whole"):
            view = self.__dict__.pop(attr, None)
            if isinstance(view, memoryview):
                with contextlib.suppress(BufferError):
                    view.release()
        if self._mmap is not None:
            # BufferError: a caller still holds a view; the GC unmaps it later.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_MODES = ("one_shot", "two_shot")


def _signature(src: torch.Tensor, mode: str) -> int:
    """What one step reduces, as one word: elements, dtype and mode (a rank that disagrees on
    any of them would sum other bytes than its peers, and return a silently wrong result)."""
    return (src.numel() << 8) | (SUPPORTED_DTYPES.index(src.dtype) << 4) | _MODES.index(mode)


def _described(signature: int) -> str:
    n, dtype, mode = signature >> 8, (signature >> 4) & 0xF, signature & 0xF
    return f"{n} elements of {SUPPORTED_DTYPES[dtype]}, {_MODES[mode]}"


def _reduce_in_order(
    srcs: list[torch.Tensor], dst: torch.Tensor, acc: torch.Tensor | None
) -> None:
    """``dst = round(((s0 + s1) + s2) + ...)`` with fp32 accumulation, always in rank order.

    The fixed order is what makes every rank's result bit-identical (fp addition is not
    associative); fp32 inputs accumulate straight into ``dst``.
    """
    if acc is None:
        torch.add(srcs[0], srcs[1], out=dst)
        for s in srcs[2:]:
            dst.add_(s)
        return
    acc.copy_(srcs[0])
    for s in srcs[1:]:
        acc.add_(s)
    dst.copy_(acc)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
