"""Deterministic KV contents, so a decode rank can verify every byte it received on its own.

Element (layer, K|V, prefill block, token, global head, dim) has a value derived from those
coordinates only, so the reference for a decode rank's head slice of any prefill block is
recomputed locally — the numpy equivalent of "build the full KV and re-shard it".

A cache on a GPU (``device="cuda:N"``) is a torch tensor there, filled and verified with torch
ops on the device (the same values bit for bit: :func:`pattern_torch` does the 32-bit
arithmetic of :func:`pattern` in int64 without overflow). Every element is compared as its
16-bit word, so every byte is checked; bf16 values are never compared as numbers (NaN != NaN).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import LayoutError
from kvlink.headmap import rank_heads
from kvlink.layout import KVCacheSpec, Layout

_C1 = np.uint32(2654435761)
_C2 = np.uint32(40503)


@dataclasses.dataclass(frozen=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8  # total across TP ranks
    head_dim: int = 128
    block_size: int = 16
    layout: str = "NHD"
    mla: bool = False
    dtype: str = "bfloat16"  # stored as 16-bit words; the demo moves bytes, not numbers

    def heads(self, tp: int, rank: int) -> tuple[int, int]:
        return (0, 1) if self.mla else rank_heads(self.kv_heads, tp, rank)

    def block_bytes(self, tp: int) -> int:
        _, h = self.heads(tp, 0)
        return self.layers * (1 if self.mla else 2) * self.block_size * h * self.head_dim * 2


def is_torch(x: object) -> bool:
    """A torch tensor (duck-typed: torch is not imported for a numpy cache)."""
    return hasattr(x, "data_ptr") and hasattr(x, "element_size")


def allocate(geo: Geometry, num_blocks: int, tp: int, rank: int,
             device: str = "cpu") -> tuple[Any, list[Any]]:
    """One buffer for the whole cache (one registered region), viewed as vLLM-shaped layers.

    ``device="cpu"``: a numpy buffer (no torch needed); ``"cuda:N"``: a torch tensor on that
    GPU (:func:`allocate_torch`)."""
    if device != "cpu":
        return allocate_torch(geo, num_blocks, tp, rank, device)
    _, h = geo.heads(tp, rank)
    per_layer = (1 if geo.mla else 2) * num_blocks * geo.block_size * h * geo.head_dim
    buf = np.empty(geo.layers * per_layer, dtype=np.uint16)
    buf.fill(0)  # touch every page now: first-touch page faults would otherwise be timed
    return buf, _views(geo, buf, num_blocks, h, per_layer, "transpose")


def allocate_torch(geo: Geometry, num_blocks: int, tp: int, rank: int,
                   device: str) -> tuple[Any, list[Any]]:
    """The cache as one zeroed torch int16 tensor on ``device`` (any torch device; the words
    are bf16 bit patterns, the spec says bfloat16), viewed as vLLM-shaped layers."""
    import torch

    _, h = geo.heads(tp, rank)
    per_layer = (1 if geo.mla else 2) * num_blocks * geo.block_size * h * geo.head_dim
    buf = torch.zeros(geo.layers * per_layer, dtype=torch.int16, device=device)
    return buf, _views(geo, buf, num_blocks, h, per_layer, "permute")


def _views(geo: Geometry, buf: Any, num_blocks: int, h: int, per_layer: int,
           transpose: str) -> list[Any]:
    bs, d = geo.block_size, geo.head_dim
    layers: list[Any] = []
    for i in range(geo.layers):
        flat = buf[i * per_layer : (i + 1) * per_layer]
        if geo.mla:
            layers.append(flat.reshape(num_blocks, bs, d))
        elif geo.layout == "HND":
            hnd = flat.reshape(2, num_blocks, h, bs, d)
            layers.append(getattr(hnd, transpose)(0, 1, 3, 2, 4))
        else:
            layers.append(flat.reshape(2, num_blocks, bs, h, d))
    return layers


def spec_of(geo: Geometry, layers: list[object], tp: int, rank: int) -> KVCacheSpec:
    spec = KVCacheSpec.from_arrays(layers, mla=geo.mla, total_kv_heads=1 if geo.mla else
                                   geo.kv_heads, tp_size=tp, tp_rank=rank, dtype=geo.dtype)
    if spec.layout_matters and spec.layout is not Layout(geo.layout):
        raise LayoutError(f"demo cache came out {spec.layout.value}, asked for {geo.layout}")
    return spec


def pattern(geo: Geometry, layer: int, kv: int, blocks: npt.NDArray[np.int64], head0: int,
            nheads: int) -> npt.NDArray[np.uint16]:
    """Reference contents (blocks, tokens, heads, dim) of the given prefill blocks."""
    b = blocks.astype(np.uint32)[:, None, None]
    t = np.arange(geo.block_size, dtype=np.uint32)[None, :, None]
    h = np.arange(head0, head0 + nheads, dtype=np.uint32)[None, None, :]
    key = np.uint32((layer * 2 + kv) * 1000003) + b * np.uint32(7919) + t * np.uint32(131) \
        + h * np.uint32(31)
    d = np.arange(geo.head_dim, dtype=np.uint32) * _C2
    val = (key[..., None] * _C1 + d) >> np.uint32(13)
    out: npt.NDArray[np.uint16] = val.astype(np.uint16)
    return out


_M32 = 0xFFFFFFFF


def pattern_torch(geo: Geometry, layer: int, kv: int, blocks: Any, head0: int,
                  nheads: int) -> Any:
    """:func:`pattern` as a torch int16 tensor on ``blocks``' device (a torch int64 tensor of
    prefill block ids): the same 16-bit words. uint32 arithmetic is done in int64 on values
    below 2**32, the one product that could overflow split in 16-bit halves."""
    import torch

    dev, i64 = blocks.device, torch.int64
    b = blocks.to(i64)[:, None, None]
    t = torch.arange(geo.block_size, dtype=i64, device=dev)[None, :, None]
    h = torch.arange(head0, head0 + nheads, dtype=i64, device=dev)[None, None, :]
    key = ((((layer * 2 + kv) * 1000003) & _M32) + (b & _M32) * 7919 + t * 131 + h * 31) & _M32
    c1 = int(_C1)
    key_c1 = ((((key >> 16) * c1) & 0xFFFF) << 16) + (key & 0xFFFF) * c1  # key * C1, mod 2**32
    d = (torch.arange(geo.head_dim, dtype=i64, device=dev) * int(_C2)) & _M32
    val = (((key_c1 & _M32)[..., None] + d) & _M32) >> 13
    word = val & 0xFFFF
    return (word - ((word >> 15) << 16)).to(torch.int16)  # the same bits, as int16


def planes(geo: Geometry, layer_view: Any) -> list[Any]:
    """Logical (blocks, tokens, heads, dim) views of one layer's planes."""
    if is_torch(layer_view):
        return [layer_view.unsqueeze(2)] if geo.mla else [layer_view[0], layer_view[1]]
    arr = np.asarray(layer_view)
    if geo.mla:
        return [arr[:, :, None, :]]
    return [arr[0], arr[1]]


def fill(geo: Geometry, layers: list[Any], tp: int, rank: int, chunk: int = 64) -> None:
    head0, nheads = geo.heads(tp, rank)
    if layers and is_torch(layers[0]):
        _fill_torch(geo, layers, head0, nheads)
        return
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            for b0 in range(0, plane.shape[0], chunk):
                ids = np.arange(b0, min(b0 + chunk, plane.shape[0]), dtype=np.int64)
                plane[b0 : b0 + len(ids)] = pattern(geo, li, kv, ids, head0, nheads)


def _fill_torch(geo: Geometry, layers: list[Any], head0: int, nheads: int) -> None:
    import torch

    per_block = geo.block_size * nheads * geo.head_dim
    chunk = max(1, (1 << 24) // per_block)  # int64 temporaries of 128 MiB at most
    dev = layers[0].device
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            for b0 in range(0, plane.shape[0], chunk):
                ids = torch.arange(b0, min(b0 + chunk, plane.shape[0]), dtype=torch.int64,
                                   device=dev)
                plane[b0 : b0 + len(ids)] = pattern_torch(geo, li, kv, ids, head0, nheads)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def verify(geo: Geometry, layers: list[Any], tp: int, rank: int,
           local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64]) -> int:
    """Number of mismatching elements in the local blocks against the prefill reference."""
    head0, nheads = geo.heads(tp, rank)
    if layers and is_torch(layers[0]):
        return _verify_torch(geo, layers, head0, nheads, local_ids, remote_ids)
    bad = 0
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            got = plane[local_ids]
            bad += int(np.count_nonzero(got != pattern(geo, li, kv, remote_ids, head0, nheads)))
    return bad


def _verify_torch(geo: Geometry, layers: list[Any], head0: int, nheads: int,
                  local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64]) -> int:
    """:func:`verify` on the tensors' device: one host sync per call (the count)."""
    import torch

    dev = layers[0].device
    local = torch.as_tensor(np.ascontiguousarray(local_ids), dtype=torch.int64).to(dev)
    remote = torch.as_tensor(np.ascontiguousarray(remote_ids), dtype=torch.int64).to(dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            got = plane.index_select(0, local)
            bad += torch.count_nonzero(got != pattern_torch(geo, li, kv, remote, head0, nheads))
    return int(bad.item())
