"""Deterministic KV contents, so a decode rank can verify every byte it received on its own.

Element (layer, K|V, prefill block, token, global head, dim) has a value derived from those
coordinates only, so the reference for a decode rank's head slice of any prefill block is
recomputed locally — the numpy equivalent of "build the full KV and re-shard it".
"""

from __future__ import annotations

import dataclasses

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


def allocate(geo: Geometry, num_blocks: int, tp: int, rank: int) -> tuple[np.ndarray, list[object]]:
    """One buffer for the whole cache (one registered region), viewed as vLLM-shaped layers."""
    _, h = geo.heads(tp, rank)
    bs, d = geo.block_size, geo.head_dim
    per_layer = (1 if geo.mla else 2) * num_blocks * bs * h * d
    buf = np.empty(geo.layers * per_layer, dtype=np.uint16)
    buf.fill(0)  # touch every page now: first-touch page faults would otherwise be timed
    layers: list[object] = []
    for i in range(geo.layers):
        flat = buf[i * per_layer : (i + 1) * per_layer]
        if geo.mla:
            layers.append(flat.reshape(num_blocks, bs, d))
        elif geo.layout == "HND":
            layers.append(flat.reshape(2, num_blocks, h, bs, d).transpose(0, 1, 3, 2, 4))
        else:
            layers.append(flat.reshape(2, num_blocks, bs, h, d))
    return buf, layers


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


def planes(geo: Geometry, layer_view: object) -> list[np.ndarray]:
    """Logical (blocks, tokens, heads, dim) views of one layer's planes."""
    arr = np.asarray(layer_view)
    if geo.mla:
        return [arr[:, :, None, :]]
    return [arr[0], arr[1]]


def fill(geo: Geometry, layers: list[object], tp: int, rank: int, chunk: int = 64) -> None:
    head0, nheads = geo.heads(tp, rank)
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            for b0 in range(0, plane.shape[0], chunk):
                ids = np.arange(b0, min(b0 + chunk, plane.shape[0]), dtype=np.int64)
                plane[b0 : b0 + len(ids)] = pattern(geo, li, kv, ids, head0, nheads)


def verify(geo: Geometry, layers: list[object], tp: int, rank: int,
           local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64]) -> int:
    """Number of mismatching elements in the local blocks against the prefill reference."""
    head0, nheads = geo.heads(tp, rank)
    bad = 0
    for li, lv in enumerate(layers):
        for kv, plane in enumerate(planes(geo, lv)):
            got = plane[local_ids]
            bad += int(np.count_nonzero(got != pattern(geo, li, kv, remote_ids, head0, nheads)))
    return bad
