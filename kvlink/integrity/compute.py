"""Digests of a request's blocks: ``[blocks, layers, planes, heads]`` values over logical
byte views of the caches (:func:`spec_planes` from kvlink's description, :func:`tensor_planes`
from the framework's own tensors), on the host or on the device where the planes are; taken
now, or enqueued now and read later (:func:`digest_later`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.integrity.device import (
    CudaBytes,
    cuda_digest,
    device_table,
    on_gpu,
    torch_plane,
    upload,
)
from kvlink.integrity.host import native_digest, numpy_plane
from kvlink.integrity.weights import U64, Planes, weights
from kvlink.layout import KVCacheSpec, Layout


def digest(planes: Planes, block_ids: npt.ArrayLike,
           heads: tuple[int, int] | None = None) -> U64:
    """``[blocks, layers, planes, heads]`` digests of heads ``[h0, h1)`` (rank-local; default
    all) of ``block_ids``. ``planes`` are logical byte views (:func:`spec_planes`,
    :func:`tensor_planes`): numpy arrays are hashed with numpy, torch tensors with torch on
    their device (only the digests are copied back)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    first = planes[0][0]
    h0, h1 = heads if heads is not None else (0, int(first.shape[1]))
    out = np.empty((ids.shape[0], len(planes), len(planes[0]), h1 - h0), dtype=np.uint64)
    if ids.shape[0] == 0 or h1 <= h0:
        return out
    if on_gpu(planes):
        fused = cuda_digest(planes, ids, h0, h1)
        if fused is not None:
            out[...] = fused
            return out
    elif isinstance(first, np.ndarray) and native_digest(planes, ids, h0, h1, out):
        return out  # (torch's host tensors, a vLLM CPU cache's, take torch's path below)
    hashing = numpy_plane if isinstance(first, np.ndarray) else torch_plane
    for layer, per_layer in enumerate(planes):
        for kv, view in enumerate(per_layer):
            out[:, layer, kv] = hashing(view, ids, h0, h1)
    return out


def spec_planes(spec: KVCacheSpec) -> Planes:
    """Logical views of this process's memory as ``spec`` describes it. A digest over them
    checks the bytes kvlink moved against that description; :func:`tensor_planes` (the
    framework's own tensors) also catches a description that is wrong."""
    sh, st = _strides(spec)
    shape = (spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_bytes)
    cuda = spec.device.startswith("cuda")
    out: list[list[Any]] = []
    for layer in range(spec.num_layers):
        row: list[Any] = []
        for kv in range(spec.num_kv):
            base, stride, span = _plane_geometry(spec, layer, kv)
            if cuda:
                import torch

                dev = torch.as_tensor(CudaBytes(base, span), device=torch.device(spec.device))
                row.append(torch.as_strided(dev, shape, (stride, sh, st, 1)))
            else:
                host = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base))
                row.append(np.lib.stride_tricks.as_strided(host, shape, (stride, sh, st, 1),
                                                           writeable=False))
        out.append(row)
    return out


def tensor_planes(layers: Sequence[Sequence[Any]]) -> Planes:
    """Logical byte views of a framework's own ``[layer][plane] (blocks, heads, tokens, dim)``
    tensors (any strides; torch or numpy): the content the model reads, independent of how
    kvlink described the memory."""
    out: list[list[Any]] = []
    for per_layer in layers:
        row: list[Any] = []
        for t in per_layer:
            if isinstance(t, np.ndarray):
                row.append(_bytes_np(t))
            else:
                row.append(_bytes_torch(t))
        out.append(row)
    return out


def first_mismatch(want: U64, got: U64) -> tuple[int, int, int, int] | None:
    """(block position, layer, plane, head) of the first differing digest, or None."""
    if want.shape != got.shape:
        raise ValueError(f"digest shapes differ: {want.shape} vs {got.shape}")
    if np.array_equal(want, got):
        return None
    bad = np.argwhere(want != got)
    if not bad.size:
        return None
    b, layer, kv, head = (int(x) for x in bad[0])
    return b, layer, kv, head



def _strides(spec: KVCacheSpec) -> tuple[int, int]:
    """(head stride, token stride) in bytes inside one page."""
    hb, n, h = spec.head_bytes, spec.block_size, spec.num_kv_heads
    if spec.layout is Layout.HND or h == 1:
        return n * hb, hb
    return hb, h * hb


def _plane_geometry(spec: KVCacheSpec, layer: int, kv: int) -> tuple[int, int, int]:
    base = int(spec.plane_base[layer, kv])
    stride = int(spec.block_stride[layer, kv])
    span = (spec.num_blocks - 1) * stride + spec.page_bytes
    return base, stride, span


def _bytes_np(t: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """(B, H, N, D) of any dtype -> (B, H, N, D·itemsize) uint8: a view when D is dense."""
    if t.strides[-1] != t.itemsize and t.shape[-1] > 1:
        t = np.ascontiguousarray(t)
    return t.view(np.uint8)


def _bytes_torch(t: Any) -> Any:
    import torch

    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t.view(torch.uint8)


def fold(d: U64) -> U64:
    """``[k, L, P, H]`` -> ``[k, 1, 1, H]``: a weighted sum over (layer, plane) with odd
    weights, so a change in one layer still changes the fold (a verdict too large otherwise)."""
    k, layers, planes, heads = d.shape
    w = weights(layers, planes).reshape(1, layers, planes, 1)
    with np.errstate(over="ignore"):
        return np.asarray((d * w).sum(axis=(1, 2), dtype=np.uint64)).reshape(k, 1, 1, heads)


class Later:
    """Digests taken now and read later (:func:`digest_later`): on a GPU, their copy to the
    host's page-locked memory, enqueued on the caller's stream behind the kernel, and an event
    after it; on the host, the values themselves. ``plane_major``: the values are kept
    ``[layers x planes, blocks, heads]`` (a landing board's digest area)."""

    __slots__ = ("_event", "_plane_major", "_shape", "_values")

    def __init__(self, values: Any, shape: tuple[int, ...], event: Any = None,
                 plane_major: bool = False) -> None:
        self._values, self._shape, self._event = values, shape, event
        self._plane_major = plane_major

    def result(self) -> U64:
        """The ``[blocks, layers, planes, heads]`` digests, once landed (a GPU's: waiting for
        its copy, where the stream has not reached it yet)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._values = np.asarray(self._values.numpy()).view(np.uint64)
        got = np.asarray(self._values)
        if self._plane_major:
            k, layers, planes, heads = self._shape
            got = got.reshape(layers, planes, k, heads).transpose(2, 0, 1, 3)
        return got.reshape(self._shape)


def digest_later(planes: Planes, block_ids: npt.NDArray[np.int64], layers: tuple[int, int],
                 on_device: Any = None, into: U64 | None = None) -> Later:
    """:func:`digest` of layers ``[start, stop)`` of ``block_ids`` (every head), taken now and
    read by :meth:`Later.result`. GPU planes: one kernel on the caller's current stream —
    after the work that wrote those layers — and its digests' copy to page-locked host
    memory, with no wait on the host (a layer-wise push takes a range's digests as the
    forward goes on); ``on_device``: the ids already there (a push's, uploaded once for all
    its ranges). Host planes: computed now. ``into``: where they go, ``[(stop - start) x
    planes, blocks, heads]`` words (plane by plane: a landing board's digest area,
    kvlink.landing) — page-locked memory for GPU planes — instead of memory of their own."""
    ids = np.asarray(block_ids, dtype=np.int64)
    start, stop = layers
    first = planes[0][0]
    per = len(planes[0])
    shape = (ids.shape[0], stop - start, per, int(first.shape[1]))
    if on_gpu(planes) and ids.size:
        import torch

        table = device_table(planes)
        dev = on_device if on_device is not None else upload(ids, table.device)
        out = table.digest(dev, 0, shape[3], (start * per, stop * per), into is not None)
        if out is not None:
            host = (torch.empty(out.shape, dtype=out.dtype, pin_memory=True) if into is None
                    else torch.from_numpy(into.view(np.int64)))
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return Later(host, shape, event, into is not None)
    d = digest(planes[start:stop], ids)
    if into is not None:
        into_plane_major(into, d)
    return Later(d, shape)


def into_plane_major(place: U64, d: U64) -> None:
    """``[k, layers, planes, heads]`` digests into ``place``, a landing board's digest area
    (``[layers x planes, k, heads]``: kvlink.landing)."""
    place[...] = d.transpose(1, 2, 0, 3).reshape(place.shape)


_SIDE: dict[Any, Any] = {}  # device -> the stream a check of landed bytes digests on


def landed(planes: Planes, ids: npt.NDArray[np.int64], heads: tuple[int, int]) -> U64:
    """:func:`digest` of bytes that have landed here. On a GPU, on a stream of our own: the
    transport's completion was seen on the host, so the bytes are in memory, and whatever the
    caller queued on its own stream (a forward in flight) is not waited for — the producer's
    digests stay on the caller's stream, behind the forward that wrote the KV."""
    if not on_gpu(planes):
        return digest(planes, ids, heads)
    import torch

    device = planes[0][0].device
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        return digest(planes, ids, heads)
