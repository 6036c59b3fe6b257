"""The integrity digest on the GPU: one kernel launch for every (block, layer, plane, head).

Computes exactly what :func:`kvlink.integrity.digest` computes on the host — per head, the sum
modulo 2**64 of each 8-byte word times an odd weight fixed by its (token, word) position — but
reads every plane through a table of (pointer, block stride, head stride, token stride), so a
request's 80 layers cost one launch instead of a few per plane. One thread block per digest;
its threads stride over the head's words and add up in shared memory (addition modulo 2**64 is
associative, so the order does not matter). The weights are recomputed from their position with
the same splitmix64 finaliser as the host's. Compiled by NVRTC through torch at first use;
``None`` from :func:`load` (logged once) falls back to torch ops per plane.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvlink.integrity")

SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u64 kv_mix(u64 x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One (block, plane, head) digest, by a block of THREADS threads (``part``: their shared
// sums): the head's words in logical order, each times its position's odd weight.
__device__ __forceinline__ u64 kv_digest_of(const i64* table, const i64* ids, i64 b, i64 p,
                                            i64 head, i64 tokens, i64 words, u64* part) {
  const i64* row = table + 4 * p;
  const char* page = (const char*)row[0] + ids[b] * row[1] + head * row[2];
  const i64 total = tokens * words;
  u64 acc = 0;
  for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
    const i64 t = i / words, w = i - t * words;
    const u64 x = *(const u64*)(page + t * row[3] + 8 * w);
    const u64 weight = kv_mix((u64)(i + 1) * 0x9E3779B97F4A7C15ull) | 1ull;
    acc += x * weight;
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  return part[0];
}

// item -> (block, plane, head), head fastest: one digest a thread block
struct kv_at { i64 b, p, h; };
__device__ __forceinline__ kv_at kv_item(i64 item, i64 np, i64 nh) {
  return {item / (nh * np), (item / nh) % np, item % nh};
}

// table: [planes][4] = (ptr, block stride, head stride, token stride), bytes
// params: (blocks, planes, heads, first head, tokens, words per token, plane-major)
// out: [blocks][planes][heads], or with plane-major [planes][blocks][heads]
extern "C" __global__ void kv_digest(const i64* table, const i64* ids, u64* out,
                                     const i64* params) {
  const i64 nb = params[0], np = params[1], nh = params[2];
  const kv_at at = kv_item(blockIdx.x, np, nh);
  if (at.b >= nb) return;
  __shared__ u64 part[128];
  const u64 d = kv_digest_of(table, ids, at.b, at.p, params[3] + at.h, params[4], params[5],
                             part);
  if (threadIdx.x == 0) out[params[6] ? (at.p * nb + at.b) * nh + at.h : blockIdx.x] = d;
}

// The same digests compared with the producer's: ``ids`` [nb], ``expect`` [nb][planes][heads],
// or with ``plane_major`` [planes][nb][heads] (a landing board's digest area's order). The
// first item that differs, in block-major order, is min-reduced in dev[0]; the grid's last
// block to finish (dev[1] counts them) hands it to the host (host[0], then the launch's
// ``seq`` in host[1], each behind a system fence: page-locked host memory the host polls) and
// leaves both device words as the next launch needs them (all ones, 0). So a check is two
// driver calls, the ids' and rows' upload and the launch, where it was seven (a memset, two
// uploads, the launch, a download, a synchronize, the context's query): on the poll that ends
// a push the check took 0.577 / 0.748 ms at `sample` / `full` with seven, 0.297-0.332 /
// 0.560-0.584 with two (bench/results/gpu_check_one_launch/: run1_stamps_82ecb4a/ and
// run3_two_calls_27260a1/ layerwise_*.json). No block returns early: the grid is the items.
extern "C" __global__ void kv_digest_check(const i64* table, const i64* ids, const u64* expect,
                                           u64* dev, volatile u64* host, u64 seq, i64 nb,
                                           i64 np, i64 nh, i64 h0, i64 tokens, i64 words,
                                           i64 plane_major) {
  const kv_at at = kv_item(blockIdx.x, np, nh);
  __shared__ u64 part[128];
  u64 want = 0;  // (loaded first: its round trip to host memory overlaps the digest)
  if (threadIdx.x == 0) want = expect[plane_major ? (at.p * nb + at.b) * nh + at.h : blockIdx.x];
  const u64 d = kv_digest_of(table, ids, at.b, at.p, h0 + at.h, tokens, words, part);
  if (threadIdx.x == 0) {
    if (d != want) atomicMin(&dev[0], (u64)blockIdx.x);
    __threadfence();
    if (atomicAdd(&dev[1], 1ull) == (u64)gridDim.x - 1) {
      host[0] = atomicExch(&dev[0], ~0ull);
      dev[1] = 0;
      __threadfence_system();
      host[1] = seq;
      __threadfence_system();
    }
  }
}
"""

THREADS = 128
_kernels: dict[tuple[int, str], Any] = {}
_failed: set[tuple[int, str]] = set()
_lock = threading.Lock()


def load(device: Any, name: str = "kv_digest") -> Any | None:
    """The compiled kernel ``name`` for ``device`` (a torch.device), or None where NVRTC
    can't."""
    import torch

    key = (int(device.index or 0), name)
    with _lock:
        if key in _kernels:
            return _kernels[key]
        if key in _failed:
            return None
        try:
            with torch.cuda.device(device):
                fn = torch.cuda._compile_kernel(SOURCE, name)
        except Exception as exc:  # no NVRTC, an old torch
            _failed.add(key)
            log.warning("integrity digest kernel %s unavailable (%s: %s); using torch ops",
                        name, type(exc).__name__, exc)
            return None
        _kernels[key] = fn
        return fn


class Table:
    """The planes' (pointer, block stride, head stride, token stride) rows on the device, built
    once per set of views (a request's digest then costs one small upload and one launch).

    Measured on one H200 (bench/results/integrity_overhead_cuda.json): this launch path costs
    about 0.25 ms of host time per digest (torch's compiled-kernel call and small uploads),
    more than the kernel itself; launching through the driver with pinned staging is the next
    step (docs/integrity.md)."""

    def __init__(self, views: list[Any]) -> None:
        import torch

        first = views[0]
        self.device = first.device
        self.planes = len(views)
        self.tokens, self.head_bytes = int(first.shape[2]), int(first.shape[3])
        self.heads = int(first.shape[1])
        self._fused: tuple[int, int, Any] | Literal[False] | None = None
        self._params: dict[tuple[int, ...], Any] = {}  # digest's, on the device, per stream
        self._checker: _Check | Literal[False] | None = None  # check()'s, made at first
        rows = []
        ok = self.head_bytes % 8 == 0
        for v in views:
            ptr = int(v.data_ptr())
            sb, sh, sn, sc = (int(s) for s in v.stride())
            ok = ok and sc == 1 and tuple(v.shape[1:]) == (self.heads, self.tokens,
                                                           self.head_bytes)
            ok = ok and (ptr | sh | sn | sb) % 8 == 0
            rows.append((ptr, sb, sh, sn))
        self.raw_rows = rows
        self.fn = load(self.device) if ok else None
        self.rows = torch.tensor(rows, dtype=torch.int64).to(self.device) if ok else None

    def fused(self, weights: Any) -> tuple[int, int, Any] | None:
        """(geometry, weights, keep-alive) device pointers for the cuda_ipc copy kernel's
        fused digest (kvlink.gpu.move ``kv_move_digest``): the views' rows with strides in
        32 bits and whole 16-byte vectors per head row, else None. Built once; ``weights``:
        kvlink.integrity's, ``[tokens x words]`` uint64."""
        if self._fused is None:
            self._fused = self._build_fused(weights) or False
        return self._fused if self._fused is not False else None

    def _build_fused(self, weights: Any) -> tuple[int, int, Any] | None:
        import numpy as np
        import torch

        if self.rows is None or self.head_bytes % 16:
            return None
        heads = self.heads
        geo = [heads, self.tokens, self.head_bytes, self.head_bytes // 8, 0, 0, 0, 0]
        for ptr, sb, sh, sn in self.raw_rows:
            sh = 0 if heads == 1 else sh
            if not (0 <= sh < 1 << 31 and 0 < sn < 1 << 31) or (ptr | sh | sn | sb) % 16:
                return None
            geo += [ptr, sb, sh, sn]
        g = torch.tensor(geo, dtype=torch.int64).to(self.device)
        w = torch.from_numpy(np.ascontiguousarray(weights).view(np.int64).reshape(-1).copy()
                             ).to(self.device)
        torch.cuda.synchronize(self.device)  # once, at the first fused READ
        return int(g.data_ptr()), int(w.data_ptr()), (g, w)

    def check(self, ids: Any, h0: int, expect: Any, plane_major: bool = False) -> int | None:
        """Compare the digests of every plane of blocks ``ids`` (int64 numpy), heads ``[h0,
        h0 + expect.shape[2])``, with ``expect`` (``[blocks, planes, heads]`` uint64 numpy,
        the producer's; ``[planes, blocks, heads]`` with ``plane_major``): the first item
        that differs, as ``(block x planes + plane) x heads + head``, -1 where none does;
        None where the kernel can't run (the caller digests and compares on the host). For
        bytes that have landed here (the transport's completion was seen): on a stream of
        its own, waited for."""
        if self.fn is None or self.rows is None or self._checker is False:
            return None
        if self._checker is None:
            try:
                self._checker = _Check(self)
            except Exception as exc:  # no kernel, no driver entry point
                log.warning("integrity check kernel unavailable (%s: %s); digests are "
                            "compared on the host", type(exc).__name__, exc)
                self._checker = False
                return None
        try:
            return self._checker.run(ids, h0, expect, plane_major)
        except RuntimeError as exc:  # a driver step refused, or no answer: the host compares
            log.warning("integrity check kernel failed (%s); digests are compared on the "
                        "host from now on", exc)
            self._checker = False
            return None

    def digest(self, ids: Any, h0: int, h1: int, planes: tuple[int, int] | None = None,
               plane_major: bool = False) -> Any | None:
        """``[blocks, planes, heads]`` int64 digests on the device, launched on the caller's
        current stream (after what it holds); None where the kernel can't take the views.
        ``planes``: only views ``[p0, p1)`` (a layer-wise push's range of layers);
        ``plane_major``: ``[planes, blocks, heads]`` instead (a landing board's digest area
        keeps them so: kvlink.landing). Its
        arguments go up from pinned memory: from pageable memory the driver may wait for the
        stream first, which would hold a layer-wise prefill's host loop behind its GPU."""
        import torch

        if self.fn is None or self.rows is None:
            return None
        p0, p1 = planes if planes is not None else (0, self.planes)
        nb, heads, count = int(ids.shape[0]), h1 - h0, p1 - p0
        # per stream: uploaded without a wait, they are there for that stream's later work
        # only (a layer-wise push asks the same for every range)
        key = (nb, count, heads, h0, plane_major,
               torch.cuda.current_stream(self.device).cuda_stream)
        params = self._params.get(key)
        if params is None:
            if len(self._params) > 64:
                self._params.clear()
            params = self._params[key] = torch.tensor(
                [nb, count, heads, h0, self.tokens, self.head_bytes // 8, int(plane_major)],
                dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        out = torch.empty(nb * count * heads, dtype=torch.int64, device=self.device)
        self.fn(grid=(nb * count * heads, 1, 1), block=(THREADS, 1, 1),
                args=[self.rows[p0:p1], ids, out, params])
        return out.view(count, nb, heads) if plane_major else out.view(nb, count, heads)


class _Check:
    """:meth:`Table.check`'s launch: ``kv_digest_check`` with every argument by value, through
    the driver on a stream of its own, the ids and the producer's rows uploaded in one copy
    from page-locked memory, the kernel's answer handed to host memory that this polls: two
    driver calls a check. (Before: seven — a memset, two uploads, the launch, a download, a
    synchronize, the context's query; the kernel's comment says what the check cost; through
    torch before that, 2-3x more again, bench/results/gpu_integrity_board_717bfb4/.) The
    rows are not read in place from host memory: a `full` check's 40,960 small reads over
    PCIe took 636.5 us cold against 259.4 uploaded (gpu_check_one_launch/
    run2_in_place_67b1fbc/landed_*--cold.json). A decode pays it on the poll that ends a
    push."""

    ARGS = 13  # table, ids, expect, dev, host, seq, blocks, planes, heads, h0, tokens, words,
    # plane-major
    #: how long a check's answer is polled for before the driver waits for it (the GIL let
    #: go): a check of a 4096-token request's every block takes ~0.2 ms on the device
    SPIN_S = 0.0005

    def __init__(self, table: Table) -> None:
        import torch

        from kvlink.gpu import ipc
        from kvlink.gpu.move import arg_block

        fn = load(table.device, "kv_digest_check")
        if fn is None:
            raise RuntimeError("kv_digest_check did not compile")
        self._fn, self._drv, self._table, self._ipc = fn.func, ipc.driver(), table, ipc
        self._device = int(table.device.index or 0)
        self._stream = torch.cuda.Stream(table.device)  # type: ignore[no-untyped-call]
        self._raw_stream = self._stream.cuda_stream
        self._vals, self._ptrs = arg_block(self.ARGS)
        # the kernel's reduction: (first differing item, blocks done), as a launch leaves them
        self._dev = torch.tensor([-1, 0], dtype=torch.int64, device=table.device)
        torch.cuda.synchronize(table.device)
        self._seq = 0
        self._mapped: dict[str, tuple[Any, int]] = {}  # name -> (mapping, its address)
        # page-locked until this check goes (its table with its planes: a worker's): a mapping
        # freed while registered would leave host_register a stale entry at its address
        weakref.finalize(self, _let_go, ipc, self._mapped)
        self._answer, at = self._page_locked("answer", 16)  # (first differing item, seq)
        self._vals[0], self._vals[3], self._vals[4] = (int(table.rows.data_ptr()),  # type: ignore[union-attr]
                                                       int(self._dev.data_ptr()), at)
        self._stage: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
        self._on_device: Any = None
        self._grow(4096)

    def _page_locked(self, name: str, nbytes: int) -> tuple[npt.NDArray[np.uint64], int]:
        """``nbytes`` of page-locked host memory mapped into the device, as uint64 words, and
        its device address; what ``name`` had before is let go (no check is in flight: each
        waits for its answer)."""
        import mmap

        buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        words = np.frombuffer(buf, dtype=np.uint64)
        words[:] = 0
        addr = int(words.ctypes.data)
        at = self._ipc.host_register(addr, len(buf))
        old = self._mapped.pop(name, None)
        self._mapped[name] = (buf, addr)
        if old is not None:
            self._ipc.host_unregister(old[1])
        return words, at

    def _grow(self, words: int) -> None:
        import torch

        self._stage, _ = self._page_locked("stage", 8 * words)
        self._on_device = torch.empty(words, dtype=torch.int64, device=self._table.device)

    def run(self, ids: Any, h0: int, expect: Any, plane_major: bool = False) -> int:
        """The first item of ``expect`` (``[blocks, planes, heads]``, or ``[planes, blocks,
        heads]`` with ``plane_major``) the landed bytes of blocks ``ids`` do not digest like,
        block-major; -1 where none."""
        t, drv = self._table, self._drv
        nb = int(ids.shape[0])
        heads = int(expect.shape[2])
        n = nb * t.planes * heads
        if nb + n > self._stage.shape[0]:
            self._grow(max(nb + n, 2 * self._stage.shape[0]))
        stage = self._stage
        stage[:nb] = ids
        stage[nb:nb + n].reshape(expect.shape)[...] = expect  # (one copy, in order)
        self._seq += 1
        seq, dev = self._seq, int(self._on_device.data_ptr())
        v = self._vals
        v[1], v[2], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12] = (
            dev, dev + 8 * nb, seq, nb, t.planes, heads, h0, t.tokens, t.head_bytes // 8,
            int(plane_major))
        s, up = self._raw_stream, 8 * (nb + n)
        rc = drv.cuMemcpyHtoDAsync(dev, stage.ctypes.data, up, s)
        if rc in _NOT_CURRENT:  # this thread's context is not the device's: made so, again
            self._ipc.ensure_context(self._device)
            rc = drv.cuMemcpyHtoDAsync(dev, stage.ctypes.data, up, s)
        drv.check(rc, "cuMemcpyHtoDAsync")
        drv.check(drv.cuLaunchKernel(self._fn, n, 1, 1, THREADS, 1, 1, 0, s, self._ptrs, None),
                  "cuLaunchKernel(kv_digest_check)")
        answer = self._answer
        give_up = time.perf_counter() + self.SPIN_S
        while answer[1] != seq:
            if time.perf_counter() > give_up:  # a long check: the driver waits (no GIL)
                drv.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
                if answer[1] != seq:  # (ended, and said nothing: its counts are off)
                    raise RuntimeError("kv_digest_check ended without its answer")
                break
        got = int(answer[0])
        return -1 if got == NO_MISMATCH else got


def _let_go(ipc: Any, mapped: dict[str, tuple[Any, int]]) -> None:
    """A check's page-locked mappings unregistered (its finalizer), before they are unmapped:
    they go with the last of their arrays."""
    for _, addr in mapped.values():
        with contextlib.suppress(Exception):  # (a context gone at exit: nothing to release)
            ipc.host_unregister(addr)
    mapped.clear()


#: cuLaunchKernel's answer where the calling thread's current context is none or another
#: device's (CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE): nothing was enqueued
_NOT_CURRENT = (201, 400)
NO_MISMATCH = (1 << 64) - 1
