"""Batched device copy over extent tables: the data mover of cuda_ipc and of host staging.

A request is thousands of small extents (a 4k-token Llama-70B request is 20480 blocks of 8 KiB);
one ``cudaMemcpyAsync`` each would spend more time launching than copying, and any per-extent
numpy work on the host shows up directly in the request's latency. So the host does as little as
possible: it copies the caller's extent records into pinned memory and launches two kernels
(_gpukernels: ``prepare`` validates and translates on the device, ``copy`` moves the bytes).
Long requests go in pieces, so the GPU starts on the first piece while the host is still
copying the records of the next; the per-piece check means an invalid extent fails the post
and is never touched, though valid pieces before it may already have been copied (a FAILED
transfer leaves its destination undefined, as one cut short by a dead peer does).

Launches skip Triton's Python dispatch after the first call (the compiled kernel is called
directly) when every argument keeps the integer width it was compiled for. Triton is imported
lazily: the package imports on machines without it.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import ExtentOutOfBounds
from kvlink.transport import Extents

CHUNK = 256 << 10  # bytes one program of the copy kernel moves (more for very long extents)
PIECE = 4096  # extents per launch pair
_PREP_BLOCK = 1024
_COPY_BLOCK = 1024
_COPY_WARPS = 4
_I32 = 1 << 31


class RegionMap:
    """Registered regions on the device — (start, end, delta) triples — for ``prepare``."""

    def __init__(self, starts: npt.ArrayLike, ends: npt.ArrayLike, delta: npt.ArrayLike,
                 device: Any) -> None:
        import torch

        table = np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1)
                                for x in (starts, ends, delta)])
        self.count = table.shape[0] // 3
        self.tensor = torch.from_numpy(table).to(device)
        self.ptr = int(self.tensor.data_ptr())

    @classmethod
    def anywhere(cls, device: Any) -> RegionMap:
        """No restriction: for copies between buffers the caller owns (host staging)."""
        return cls([0], [1 << 62], [0], device)


class _Kernel:
    """One Triton kernel with its launch constants; direct launches once compiled."""

    def __init__(self, name: str, num_warps: int, **consts: int) -> None:
        self.name = name
        self.num_warps = num_warps
        self.consts = consts
        self._compiled: Any = None
        self._wide: tuple[bool, ...] = ()

    def __call__(self, grid: tuple[int, ...], *args: int) -> None:
        wide = tuple(a >= _I32 for a in args)
        if self._compiled is not None and wide == self._wide:
            self._compiled[(*grid, 1, 1)[:3]](*args, *self.consts.values())
            return
        from kvlink_transports import _gpukernels

        fn = getattr(_gpukernels, self.name)
        self._compiled = fn[grid](*args, **self.consts, num_warps=self.num_warps)
        self._wide = wide


class Pending:
    """One enqueued copy: its completion event and the buffers the kernels still use."""

    __slots__ = ("event", "host", "seq", "tab")

    def __init__(self, event: Any, host: Any, seq: int, tab: Any) -> None:
        self.event, self.host, self.seq, self.tab = event, host, seq, tab

    def done(self) -> bool:
        return bool(self.event.query())

    def failed(self) -> bool:
        """After done(): did ``prepare`` refuse an extent (so nothing of that piece moved)?"""
        return self.host is not None and int(self.host.numpy().view(np.int64)[0]) == self.seq

    def wait(self) -> None:
        self.event.synchronize()


def _records(ext: Extents) -> npt.NDArray[np.uint64]:
    return np.ascontiguousarray(ext).view(np.uint64)


class BatchCopier:
    """Enqueues batched copies on the caller's current stream (one device)."""

    def __init__(self, device: Any, *, chunk: int = CHUNK, piece: int = PIECE,
                 copy_block: int = _COPY_BLOCK, copy_warps: int = _COPY_WARPS) -> None:
        import torch

        self.device = torch.device(device)
        self.chunk = max(4096, int(chunk))
        self.piece = max(1, int(piece))
        props = torch.cuda.get_device_properties(self.device)
        self.min_programs = 4 * int(props.multi_processor_count)
        self._flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._prepare = _Kernel("prepare", 4, BLOCK=_PREP_BLOCK)
        self._copy = _Kernel("copy", copy_warps, BLOCK=copy_block)
        self._seq = itertools.count(1)
        self._inflight: collections.deque[Pending] = collections.deque()
        self._lock = threading.Lock()  # posts from several threads take turns

    def _split(self, n: int, first_len: int) -> int:
        """Programs per extent: about ``chunk`` bytes each, and enough of them to fill the GPU."""
        g = max(1, -(-first_len // self.chunk))
        if n * g < self.min_programs:
            g = max(g, min(-(-self.min_programs // n), max(1, first_len // 16384)))
        return min(g, 65535)

    def copy(self, src: Extents, smap: RegionMap, dst: Extents, dmap: RegionMap) -> Pending:
        """Copy src[i] -> dst[i] for every i. Extents are checked on the device against their
        maps and translated through them (delta); a refused extent shows as ``failed()``."""
        import torch

        if src.shape != dst.shape:
            raise ExtentOutOfBounds(
                f"source and destination extent counts differ: {src.shape[0]} vs {dst.shape[0]}"
            )
        n = int(src.shape[0])
        with self._lock:
            while self._inflight and self._inflight[0].done():
                self._inflight.popleft()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            if n == 0:
                event.record()
                return Pending(event, None, 0, None)
            seq = next(self._seq) % (_I32 - 1) + 1
            host = torch.empty(8 + 32 * n, dtype=torch.uint8, pin_memory=True)
            tab = torch.empty(3 * n, dtype=torch.int64, device=self.device)
            hv = host.numpy().view(np.uint64)
            hv[0] = 0
            s_rec, d_rec = _records(src), _records(dst)
            hp, tp, fp = int(host.data_ptr()), int(tab.data_ptr()), int(self._flag.data_ptr())
            g = self._split(n, int(src["len"][0]))
            for p0 in range(0, n, self.piece):
                p1 = min(n, p0 + self.piece)
                hv[1 + 2 * p0 : 1 + 2 * p1] = s_rec[2 * p0 : 2 * p1]
                hv[1 + 2 * n + 2 * p0 : 1 + 2 * n + 2 * p1] = d_rec[2 * p0 : 2 * p1]
                k = p1 - p0
                self._prepare(((k + _PREP_BLOCK - 1) // _PREP_BLOCK,),
                              hp + 8 + 16 * p0, hp + 8 + 16 * n + 16 * p0, k,
                              smap.ptr, smap.count, dmap.ptr, dmap.count,
                              tp + 8 * p0, n, fp, hp, seq)
                self._copy((k, g), tp + 8 * p0, n, fp, seq, g)
            event.record()
            pending = Pending(event, host, seq, tab)
            self._inflight.append(pending)
            return pending
