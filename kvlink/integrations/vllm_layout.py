"""vLLM's per-layer KV cache tensors → :class:`KVCacheSpec` (no vLLM import here).

What ``register_kv_caches`` receives depends on the vLLM version and attention backend:

* up to ~0.11: ``(2, B, T, H, D)`` (FlashAttention, K/V split), ``(B, 2, T, H, D)`` (FlashInfer,
  K/V joined), a ``(K, V)`` pair, or MLA ``(B, T, L)`` — :meth:`KVCacheSpec.from_tensors` reads
  these as they are, any physical stride order;
* 0.32+ (RFC 42082 layouts): ``(B, H, N, C)`` per layer, where ``C`` packs K‖V of one (token,
  head) — or the MLA latent with ``H == 1`` — and the physical order of B, H, N is the layout's
  (``LBHNC``: head-major pages, ``LBNHC``: token-major pages, ...).

kvlink's layout model keeps K and V in separate planes, which a packed ``C`` is not. Until the
core grows a packed-plane mode (see docs/vllm.md), a packed cache is described exactly, byte for
byte, as one latent-like plane per layer whose page is the whole block (``H·N·C`` elements) —
or, when a block's heads are not adjacent in memory, one plane per (layer, head). The physical
page order is recorded in the spec's ``layout`` and the per-rank head count in its ``head_dim``,
so two caches that would interpret the bytes differently fail at handshake, naming both values.
Such a spec moves whole pages, so it serves equal TP sizes; other TP ratios are refused there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvlink.errors import LayoutError
from kvlink.layout import KVCacheSpec, Layout


@dataclasses.dataclass(frozen=True)
class DetectedLayout:
    spec: KVCacheSpec
    kind: str  # "split", "joined", "pair", "mla", "packed-block", "packed-head"
    description: str


def _unique_layers(kv_caches: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Layers in order, dropping the aliases of cross-layer KV sharing (same tensor twice)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name, t in kv_caches.items():
        first = t[0] if isinstance(t, (tuple, list)) else t
        key = (int(first.data_ptr()), tuple(first.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def _packed_views(t: Any, where: str) -> tuple[list[Any], str, Layout]:
    """Views describing one packed ``(B, H, N, C)`` layer as latent-like planes."""
    import torch

    nb, h, n, c = (int(s) for s in t.shape)
    sb, sh, sn, sc = (int(s) for s in t.stride())
    if sc != 1 and c > 1:
        raise LayoutError(f"{where}: content dim of {tuple(t.shape)} is not contiguous "
                          f"(strides {tuple(t.stride())})")
    hnd = (sn == c or n == 1) and (sh == n * c or h == 1)
    nhd = (sh == c or h == 1) and (sn == h * c or n == 1)
    page = h * n * c
    if (hnd or nhd) and (sb >= page or nb == 1):  # a block is one dense run: one plane/layer
        layout = Layout.HND if hnd and h > 1 else Layout.NHD
        view = torch.as_strided(t, (nb, n, h * c), (sb, h * c, 1), t.storage_offset())
        return [view], "packed-block", layout
    if (sn == c or n == 1) and (sb >= n * c or nb == 1):  # heads apart: one plane per head
        return ([torch.as_strided(t, (nb, n, c), (sb, c, 1), t.storage_offset() + i * sh)
                 for i in range(h)], "packed-head", Layout.HND)
    raise LayoutError(f"{where}: page (heads={h}, tokens={n}, content={c}) with element "
                      f"strides (block {sb}, head {sh}, token {sn}, content {sc}) is neither a "
                      "dense block nor dense per head")


def detect(kv_caches: Mapping[str, Any], *, total_kv_heads: int, tp_size: int, tp_rank: int,
           use_mla: bool) -> DetectedLayout:
    """Describe vLLM's caches; raises :class:`LayoutError` naming what it could not read."""
    layers = _unique_layers(kv_caches)
    if not layers:
        raise LayoutError("vLLM registered no KV cache tensors")
    first = layers[0][1]
    if isinstance(first, (tuple, list)) or first.dim() in (3, 5):
        spec = KVCacheSpec.from_tensors([t for _, t in layers], mla=use_mla or None,
                                        total_kv_heads=0 if use_mla else total_kv_heads,
                                        tp_size=tp_size, tp_rank=tp_rank)
        if isinstance(first, (tuple, list)):
            kind = "pair"
        elif first.dim() == 3:
            kind = "mla"
        else:
            kind = "split" if int(first.shape[0]) == 2 else "joined"
        desc = (f"{kind} {tuple(first[0].shape if kind == 'pair' else first.shape)} "
                f"{spec.layout.value}")
        return DetectedLayout(spec, kind, desc)
    if first.dim() != 4:
        raise LayoutError(f"{layers[0][0]}: cannot describe a KV cache tensor of shape "
                          f"{tuple(first.shape)}")
    views: list[Any] = []
    kinds, layouts = set(), set()
    for name, t in layers:
        if t.dim() != 4 or tuple(t.shape) != tuple(first.shape):
            raise LayoutError(f"{name}: shape {tuple(t.shape)} differs from "
                              f"{layers[0][0]} {tuple(first.shape)}")
        v, kind, layout = _packed_views(t, name)
        views += v
        kinds.add(kind)
        layouts.add(layout)
    if len(kinds) != 1 or len(layouts) != 1:
        raise LayoutError(f"KV cache layers mix layouts: {sorted(kinds)} {sorted(layouts)}")
    spec = KVCacheSpec.from_tensors(views, mla=True, tp_size=tp_size, tp_rank=tp_rank)
    spec = dataclasses.replace(spec, layout=layouts.pop())
    kind = kinds.pop()
    b, h, n, c = (int(s) for s in first.shape)
    desc = (f"{kind} (B={b}, H={h}, N={n}, C={c}) {spec.layout.value}-paged, "
            f"{'MLA latent' if use_mla else 'K|V packed'}; {spec.num_layers} plane(s) of "
            f"{spec.page_bytes} B pages")
    return DetectedLayout(spec, kind, desc)
