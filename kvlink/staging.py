"""Host-buffer staging: move device memory with a host-only transport, pipelined in chunks.

When neither GPUDirect RDMA nor CUDA IPC can reach the peer, KV still has to move: gather the
request's device extents into a pinned host buffer (on a side stream, so the model's stream is
never blocked), send the host buffer with any host transport, and scatter it into the peer's
device extents. The byte stream of a transfer is cut into fixed-size chunks; while chunk k is on
the wire, chunk k+1 is being gathered (send side) or chunk k-1 scattered (receive side), so the
pipeline runs at the speed of its slowest stage. Buffers come from a bounded pool shared by every
transfer of the process and are reused (no allocation per request); when the pool is empty a
transfer waits for a buffer (backpressure) up to a deadline.

The device side is a :class:`Copier`: :class:`CudaCopier` (one Triton gather/scatter launch plus
one bulk copy per chunk) on GPUs, :class:`HostCopier` for host memory — which runs the very same
pipeline on CPU, so CI checks bytes, chunk boundaries and the pool bound without a GPU.

Stream order (the manners of CUDA libraries, as for cuda_ipc: docs/cuda_ipc.md "Stream order").
The copies run on the copier's side stream, on the transport's thread for the peer, long after
``post`` returned; they must still see the caller's memory as the caller's current stream leaves
it at ``post``. So ``post`` (on the caller's thread) takes a :meth:`Copier.mark`: a query of the
caller's current stream of the device and, where work is pending, a CUDA event recorded on it
(:class:`StreamMarks`, driver calls, a small pool of events: the wait happens later on another
thread, so one reused event would be re-recorded under it). The transfer's thread hands the mark
to :meth:`Copier.after` before the transfer's first gather (WRITE source) or scatter (READ
destination): the side stream waits on the event on the device, no host sync. Completion: the
pipeline synchronises every chunk's copy before it reports the transfer (a READ is DONE only
once its last scatter to the device has completed). Serving a peer's READ of our memory or
applying its WRITE has no local caller: those copies are ordered after nothing of ours but the
side stream's earlier work; that the served blocks are final (computed, synchronised) before
they are offered, and untouched while a peer writes them, is the owner's responsibility.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import hostmem
from kvlink.errors import TransferError
from kvlink.gpu.move import EVENT_DISABLE_TIMING, NOT_READY, typed_driver
from kvlink.transport import EXTENT_DTYPE, Extents, make_extents


def cut_stream(ext: Extents, chunk: int) -> list[Extents]:
    """Cut the byte stream of ``ext`` (extents back to back) into chunks of exactly ``chunk``
    bytes (the last may be shorter); an extent crossing a chunk boundary is split. Vectorised."""
    n = ext.shape[0]
    if n == 0:
        return []
    lens = ext["len"].astype(np.int64)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    total = int(starts[-1] + lens[-1])
    cuts = np.arange(0, total, chunk, dtype=np.int64)
    points = np.union1d(starts[lens > 0], cuts)
    ends = np.append(points[1:], total)
    idx = np.searchsorted(starts, points, side="right") - 1
    pieces = np.empty(points.shape[0], dtype=EXTENT_DTYPE)
    pieces["addr"] = ext["addr"][idx] + (points - starts[idx]).astype(np.uint64)
    pieces["len"] = (ends - points).astype(np.uint64)
    bounds = np.searchsorted(points, cuts)
    return [pieces[a:b] for a, b in zip(bounds, np.append(bounds[1:], points.shape[0]))]


@dataclasses.dataclass
class Buffer:
    addr: int
    nbytes: int
    view: memoryview
    owner: Any  # keeps the allocation alive


class PinnedPool:
    """A bounded set of equal host buffers, pinned when CUDA is present."""

    def __init__(self, count: int, nbytes: int, pin: bool = False) -> None:
        if count < 2:
            raise ValueError(f"staging needs at least 2 buffers to overlap, got {count}")
        self.count, self.nbytes = count, nbytes
        self._free: list[Buffer] = [self._alloc(nbytes, pin) for _ in range(count)]
        self._cv = threading.Condition()
        self.in_use = 0
        self.high_water = 0

    @staticmethod
    def _alloc(nbytes: int, pin: bool) -> Buffer:
        if pin:
            import torch

            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            addr = int(t.data_ptr())
            return Buffer(addr, nbytes, hostmem.view(addr, nbytes), t)
        a = np.empty(nbytes, dtype=np.uint8)
        a.fill(0)  # touch the pages now, not inside a timed transfer
        addr = int(a.__array_interface__["data"][0])
        return Buffer(addr, nbytes, hostmem.view(addr, nbytes), a)

    def acquire(self, timeout: float) -> Buffer:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"no staging buffer free within {timeout:.1f}s "
                                        f"({self.count} x {self.nbytes} B all in use)")
                self._cv.wait(left)
            buf = self._free.pop()
            self.in_use += 1
            self.high_water = max(self.high_water, self.in_use)
            return buf

    def release(self, buf: Buffer) -> None:
        with self._cv:
            self._free.append(buf)
            self.in_use -= 1
            self._cv.notify()


class StreamMarks:
    """Marks of the work enqueued so far on the caller's current stream, taken on one thread and
    waited on by another stream later, on another thread: a stream query (nothing more where the
    stream is idle: then there is nothing to wait for) and, where work is pending, an event from
    a pool recorded on it. :meth:`wait` enqueues the stream wait (it takes the event's state at
    that moment, so the event goes back to the pool right after); :meth:`drop` hands back a mark
    that will not be waited on. Driver calls through ctypes, each in the device's primary
    context (pushed where the calling thread has another one current, or none)."""

    KEEP = 64  # free events kept; more are destroyed

    def __init__(self, device: int, lib: Any = None, current_stream: Any = None) -> None:
        vp = ctypes.c_void_p
        if lib is None:
            lib = typed_driver(cuStreamQuery=[vp],
                               cuEventCreate=[ctypes.POINTER(vp), ctypes.c_uint],
                               cuEventRecord=[vp, vp], cuEventDestroy_v2=[vp],
                               cuStreamWaitEvent=[vp, vp, ctypes.c_uint],
                               cuEventQuery=[vp], cuEventSynchronize=[vp],
                               cuDevicePrimaryCtxRetain=[ctypes.POINTER(vp), ctypes.c_int],
                               cuCtxGetCurrent=[ctypes.POINTER(vp)],
                               cuCtxPushCurrent_v2=[vp], cuCtxPopCurrent_v2=[ctypes.POINTER(vp)])
        if current_stream is None:
            import torch

            # torch's raw getter (what cuda_ipc and Triton use): no torch.cuda.Stream object
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            current_stream = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
        self._lib, self._current, self.device = lib, current_stream, device
        ctx = vp()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "retain context")
        self._ctx = ctx
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.created = 0

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"stream order: {what} failed with CUDA error {rc}")

    def _enter(self) -> bool:
        cur = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value == self._ctx.value:
            return False
        self._check(self._lib.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent")
        return True

    def _leave(self, pushed: bool) -> None:
        if pushed:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def take(self) -> Any:
        """On the caller's thread: an event marking what its current stream of the device holds
        now, or None where that stream is idle."""
        lib = self._lib
        pushed = self._enter()
        try:
            stream = self._current(self.device)
            rc = lib.cuStreamQuery(stream)
            if rc == 0:
                return None
            if rc != NOT_READY:
                self._check(rc, f"cuStreamQuery(0x{stream:x})")
            with self._lock:
                ev = self._free.pop() if self._free else None
            if ev is None:
                ev = ctypes.c_void_p()
                self._check(lib.cuEventCreate(ctypes.byref(ev), EVENT_DISABLE_TIMING),
                            "cuEventCreate")
                self.created += 1
            rc = lib.cuEventRecord(ev, stream)
            if rc:
                self.drop(ev)
                self._check(rc, f"cuEventRecord on stream 0x{stream:x}")
            return ev
        finally:
            self._leave(pushed)

    def wait(self, stream: int, mark: Any) -> None:
        """On the copying thread: ``stream``'s next work runs after ``mark``; the mark is
        handed back (also when the driver refuses)."""
        pushed = self._enter()
        try:
            rc = self._lib.cuStreamWaitEvent(stream, mark, 0)
        finally:
            self.drop(mark)
            self._leave(pushed)
        self._check(rc, f"cuStreamWaitEvent on stream 0x{stream:x}")

    def reached(self, mark: Any) -> bool:
        """Whether the device ran everything ``mark`` marks (for a transfer the host starts
        itself, once the caller's work is done: no host sync, asked at each poll)."""
        pushed = self._enter()
        try:
            rc = self._lib.cuEventQuery(mark)
        finally:
            self._leave(pushed)
        if rc == NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def synchronize(self, mark: Any) -> None:
        """On a transfer's own thread: block (the GIL released) until the device ran
        everything ``mark`` marks; the mark is handed back (also when the driver refuses)."""
        pushed = self._enter()
        try:
            rc = self._lib.cuEventSynchronize(mark)
        finally:
            self.drop(mark)
            self._leave(pushed)
        self._check(rc, "cuEventSynchronize")

    def drop(self, mark: Any) -> None:
        with self._lock:
            if len(self._free) < self.KEEP:
                self._free.append(mark)
                return
        self._lib.cuEventDestroy_v2(mark)


def mark_post(marks: StreamMarks | None, on_device: npt.NDArray[np.bool_],
              regions: npt.NDArray[np.intp]) -> Any:
    """For a transport whose library copies device memory on streams of its own (nixl,
    mooncake): a mark of the caller's current stream where the post's extents, lying in
    registered ``regions`` (``on_device``: which registered regions are device memory), touch
    device memory and that stream has work pending; else None (nothing to wait for)."""
    if marks is None or not bool(np.any(on_device[regions])):
        return None
    return marks.take()


class Copier(abc.ABC):
    """Moves a chunk between (device) extents and a host buffer, asynchronously."""

    def mark(self) -> Any:
        """On the posting thread: a token for the work enqueued so far on the caller's current
        stream of the device, or None (nothing to wait for: host memory, or an idle stream).
        Every token goes to exactly one :meth:`after` or :meth:`drop`."""
        return None

    def after(self, mark: Any) -> None:
        """On the copying thread, before a transfer's first gather or scatter: the copies
        enqueued from now on run after ``mark`` (on the device, no host sync)."""
        return None

    def drop(self, mark: Any) -> None:
        """Hand back a mark that will not be waited on (its transfer ended before copying)."""
        return None

    @abc.abstractmethod
    def gather(self, ext: Extents, buf: Buffer) -> Any:
        """Start copying ``ext`` back to back into ``buf``; returns a token for :meth:`wait`."""

    @abc.abstractmethod
    def scatter(self, buf: Buffer, ext: Extents) -> Any:
        """Start spreading ``buf`` over ``ext``; returns a token for :meth:`wait`."""

    @abc.abstractmethod
    def wait(self, token: Any) -> None:
        """Block until the copy behind ``token`` is complete."""


class HostCopier(Copier):
    """Host memory standing in for a device: synchronous memmoves, same pipeline."""

    def gather(self, ext: Extents, buf: Buffer) -> Any:
        hostmem.gather(ext, buf.addr)
        return None

    def scatter(self, buf: Buffer, ext: Extents) -> Any:
        hostmem.scatter(buf.addr, ext)
        return None

    def wait(self, token: Any) -> None:
        return None


class CudaCopier(Copier):
    """GPU extents <-> pinned host: one batched gather/scatter (kvlink.gpu.copy) into a device
    scratch buffer plus one bulk async copy per chunk, all on a side stream; completion by CUDA
    event."""

    def __init__(self, device: int, chunk: int, scratch: int = 2) -> None:
        import torch

        from kvlink.gpu.copy import BatchCopier, RegionMap

        self.torch = torch
        self.device = torch.device("cuda", device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.copier = BatchCopier(self.device)
        self._anywhere = RegionMap.anywhere(self.device)  # our own buffers: nothing to guard
        self._scratch = [torch.empty(chunk, dtype=torch.uint8, device=self.device)
                         for _ in range(scratch)]
        self._next = 0
        # the transport's threads (one per peer, one per inbound connection) share the stream
        # and the scratch buffers: a chunk's slot, copy and bulk copy are enqueued together
        self._lock = threading.Lock()
        self.marks = StreamMarks(device)

    def mark(self) -> Any:
        return self.marks.take()

    def after(self, mark: Any) -> None:
        if mark is not None:
            self.marks.wait(self.stream.cuda_stream, mark)

    def drop(self, mark: Any) -> None:
        if mark is not None:
            self.marks.drop(mark)

    def _slot(self) -> Any:
        s = self._scratch[self._next % len(self._scratch)]
        self._next += 1
        return s

    def _host(self, buf: Buffer, n: int) -> Any:
        return buf.owner[:n] if hasattr(buf.owner, "pin_memory") else \
            self.torch.from_numpy(buf.owner[:n])

    def _packed(self, scratch: Any, ext: Extents) -> Extents:
        """Extents laying ``ext``'s bytes back to back from the start of ``scratch``."""
        offsets = np.concatenate(([0], np.cumsum(ext["len"][:-1], dtype=np.uint64)))
        return make_extents(np.uint64(scratch.data_ptr()) + offsets.astype(np.uint64),
                            ext["len"])

    def gather(self, ext: Extents, buf: Buffer) -> Any:
        torch = self.torch
        n = int(ext["len"].sum())
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            scratch = self._slot()
            self.copier.copy(ext, self._anywhere, self._packed(scratch, ext), self._anywhere,
                             self.stream)
            self._host(buf, n).copy_(scratch[:n], non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self.stream)
        return ev

    def scatter(self, buf: Buffer, ext: Extents) -> Any:
        torch = self.torch
        n = int(ext["len"].sum())
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            scratch = self._slot()
            scratch[:n].copy_(self._host(buf, n), non_blocking=True)
            self.copier.copy(self._packed(scratch, ext), self._anywhere, ext, self._anywhere,
                             self.stream)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self.stream)
        return ev

    def wait(self, token: Any) -> None:
        token.synchronize()


def send_staged(send: Callable[[memoryview], None], ext: Extents, copier: Copier,
                pool: PinnedPool, chunk: int, timeout: float) -> int:
    """Gather chunk k+1 while chunk k is being sent. Returns the chunk count."""
    chunks = cut_stream(ext, chunk)
    pending: list[tuple[Buffer, Any, int]] = []
    try:
        for part in chunks:
            buf = pool.acquire(timeout)
            pending.append((buf, copier.gather(part, buf), int(part["len"].sum())))
            if len(pending) == 2:
                _send_one(send, copier, pool, pending.pop(0))
        while pending:
            _send_one(send, copier, pool, pending.pop(0))
    finally:
        for buf, token, _ in pending:
            copier.wait(token)
            pool.release(buf)
    return len(chunks)


def _send_one(send: Callable[[memoryview], None], copier: Copier, pool: PinnedPool,
              item: tuple[Buffer, Any, int]) -> None:
    buf, token, n = item
    try:
        copier.wait(token)
        send(buf.view[:n])
    finally:
        pool.release(buf)


def recv_staged(recv_into: Callable[[memoryview], None], ext: Extents, copier: Copier,
                pool: PinnedPool, chunk: int, timeout: float) -> int:
    """Receive chunk k+1 while chunk k is being scattered. Returns the chunk count."""
    chunks = cut_stream(ext, chunk)
    inflight: list[tuple[Buffer, Any]] = []
    try:
        for part in chunks:
            if len(inflight) == 2:
                buf, token = inflight.pop(0)
                copier.wait(token)
                pool.release(buf)
            buf = pool.acquire(timeout)
            try:
                recv_into(buf.view[: int(part["len"].sum())])
            except BaseException:
                pool.release(buf)
                raise
            inflight.append((buf, copier.scatter(buf, part)))
    finally:
        for buf, token in inflight:
            copier.wait(token)
            pool.release(buf)
    return len(chunks)

