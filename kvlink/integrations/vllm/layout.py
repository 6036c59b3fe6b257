"""vLLM's per-layer KV cache tensors → :class:`KVCacheSpec`, its block ids → kernel pages (no
vLLM import here).

What ``register_kv_caches`` receives depends on the vLLM version and attention backend:

* up to ~0.11: ``(2, B, T, H, D)`` (FlashAttention, K/V split), ``(B, 2, T, H, D)`` (FlashInfer,
  K/V joined), a ``(K, V)`` pair, or MLA ``(B, T, L)`` — :meth:`KVCacheSpec.from_tensors` reads
  these as they are, any physical stride order;
* 0.32+ (RFC 42082 layouts): ``(B, H, N, C)`` per layer, where ``C`` packs K‖V of one (token,
  head) — or the MLA latent with ``H == 1`` — and the physical order of B, H, N is the layout's
  (``LBHNC``: head-major pages, ``LBNHC``: token-major pages, ...).

A packed cache is one plane per layer (``KVCacheSpec.kv_packed``) of ``H`` heads x ``N`` tokens
x ``C = 2·D``; the planner slices heads out of it like out of separate K and V planes, so every
TP pair the head mapper serves works (D ≥ P, P > D, replicated heads), in the layouts whose
block interior is a dense page: LBHNC and BLHNC (head-major), LBNHC and BLNHC (token-major).
MLA (``H == 1``, ``C`` = the latent) is the MLA spec, read from one replica.

Layouts whose heads are not adjacent inside a block (LHBNC: heads outermost; BHLNC: layers
between heads) are described exactly, one whole-page plane per (layer, head): equal TP only —
a TP pair that would need a head slice fails at handshake (``num_layers`` differs, both values
named) and at registration the log line says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import LayoutError
from kvlink.layout import KVCacheSpec


@dataclasses.dataclass(frozen=True)
class DetectedLayout:
    spec: KVCacheSpec
    kind: str  # "split", "joined", "pair", "mla", "packed", "packed-mla", "packed-head"
    description: str
    #: vLLM's own tensors as logical ``[layer][plane] (blocks, heads, tokens, dim)`` views, for
    #: integrity digests that do not trust ``spec`` (kvlink.integrity.tensor_planes); None:
    #: digest through the spec (the per-head planes of a heads-apart layout)
    planes: list[list[Any]] | None = None


def _logical(kind: str, t: Any) -> list[Any]:
    """One layer's planes as (blocks, heads, tokens, dim) views of vLLM's tensor."""
    if kind == "pair":
        return [x.permute(0, 2, 1, 3) for x in t]
    if kind == "split":
        return [t[kv].permute(0, 2, 1, 3) for kv in range(2)]
    if kind == "joined":
        return [t[:, kv].permute(0, 2, 1, 3) for kv in range(2)]
    if kind in ("mla", "packed-mla"):
        return [t[:, None] if t.dim() == 3 else t]
    return [t]  # packed: (B, H, N, C) already


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


def _dense_block(t: Any) -> bool:
    """True when each block's ``(H, N, C)`` page is one dense run (HND or NHD)."""
    nb, h, n, c = (int(s) for s in t.shape)
    sb, sh, sn, _ = (int(s) for s in t.stride())
    hnd = (sn == c or n == 1) and (sh == n * c or h == 1)
    nhd = (sh == c or h == 1) and (sn == h * c or n == 1)
    return (hnd or nhd) and (sb >= h * n * c or nb == 1)


def _head_planes(t: Any, where: str) -> list[Any]:
    """One ``(B, N, C)`` whole-page view per head, for layouts whose heads are apart."""
    import torch

    nb, h, n, c = (int(s) for s in t.shape)
    sb, sh, sn, sc = (int(s) for s in t.stride())
    if (sc != 1 and c > 1) or not ((sn == c or n == 1) and (sb >= n * c or nb == 1)):
        raise LayoutError(f"{where}: page (heads={h}, tokens={n}, content={c}) with element "
                          f"strides (block {sb}, head {sh}, token {sn}, content {sc}) is neither a "
                          "dense block nor dense per head")
    return [torch.as_strided(t, (nb, n, c), (sb, c, 1), t.storage_offset() + i * sh)
            for i in range(h)]


#: vLLM's names of one storage format (CacheConfig.cache_dtype: "fp8 (=fp8_e4m3)")
_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def cache_dtype_name(cache_dtype: str | None) -> str | None:
    """The spec's ``dtype`` for vLLM's ``cache_dtype``: None for ``"auto"`` (the tensors' own
    dtype, the model's), else the format's name (``"fp8_e5m2"``).

    vLLM keeps every quantised cache in a ``torch.uint8`` tensor (``fp8_e4m3``, ``fp8_e5m2``,
    ``int4_per_token_head``, nvfp4, ...), so the tensors' dtype cannot tell a prefill's
    e4m3 bytes from a decode's e5m2 ones: both sides said ``uint8``, the handshake matched,
    and the decode read every byte of the other format as its own. The name goes into the
    handshake's geometry, where a difference fails naming both.
    """
    if not cache_dtype or cache_dtype == "auto":
        return None
    return _CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype)


def detect(kv_caches: Mapping[str, Any], *, total_kv_heads: int, tp_size: int, tp_rank: int,
           use_mla: bool, cache_dtype: str | None = None) -> DetectedLayout:
    """Describe vLLM's caches; raises :class:`LayoutError` naming what it could not read.

    ``cache_dtype``: vLLM's ``CacheConfig.cache_dtype`` (see :func:`cache_dtype_name`)."""
    dtype = cache_dtype_name(cache_dtype)
    layers = _unique_layers(kv_caches)
    if not layers:
        raise LayoutError("vLLM registered no KV cache tensors")
    first = layers[0][1]
    if isinstance(first, (tuple, list)) or first.dim() in (3, 5):
        spec = KVCacheSpec.from_tensors([t for _, t in layers], mla=use_mla or None,
                                        total_kv_heads=0 if use_mla else total_kv_heads,
                                        tp_size=tp_size, tp_rank=tp_rank, dtype=dtype)
        if isinstance(first, (tuple, list)):
            kind = "pair"
        elif first.dim() == 3:
            kind = "mla"
        else:
            kind = "split" if int(first.shape[0]) == 2 else "joined"
        desc = (f"{kind} {tuple(first[0].shape if kind == 'pair' else first.shape)} "
                f"{spec.layout.value}")
        return DetectedLayout(spec, kind, desc, [_logical(kind, t) for _, t in layers])
    if first.dim() != 4:
        raise LayoutError(f"{layers[0][0]}: cannot describe a KV cache tensor of shape "
                          f"{tuple(first.shape)}")
    for name, t in layers:
        if t.dim() != 4 or tuple(t.shape) != tuple(first.shape):
            raise LayoutError(f"{name}: shape {tuple(t.shape)} differs from "
                              f"{layers[0][0]} {tuple(first.shape)}")
    b, h, n, c = (int(s) for s in first.shape)
    dense = {_dense_block(t) for _, t in layers}
    if len(dense) != 1:
        raise LayoutError("KV cache layers mix dense and head-strided pages")
    if dense.pop():
        if use_mla:
            if h != 1:
                raise LayoutError(f"{layers[0][0]}: an MLA cache has one latent per token, got "
                                  f"{h} heads in {tuple(first.shape)}")
            spec = KVCacheSpec.from_tensors([t[:, 0] for _, t in layers], mla=True,
                                            tp_size=tp_size, tp_rank=tp_rank, dtype=dtype)
            return DetectedLayout(spec, "packed-mla", f"MLA (B={b}, 1, N={n}, L={c})",
                                  [[t] for _, t in layers])
        spec = KVCacheSpec.from_tensors([t for _, t in layers], kv_packed=True,
                                        total_kv_heads=total_kv_heads, tp_size=tp_size,
                                        tp_rank=tp_rank, dtype=dtype)
        return DetectedLayout(spec, "packed", f"K|V packed (B={b}, H={h}, N={n}, C={c}) "
                              f"{spec.layout.value} pages; any TP pair",
                              [[t] for _, t in layers])
    views = [v for name, t in layers for v in _head_planes(t, name)]
    spec = KVCacheSpec.from_tensors(views, mla=True, tp_size=tp_size, tp_rank=tp_rank,
                                    dtype=dtype)
    desc = (f"packed-head (B={b}, H={h}, N={n}, C={c}), heads apart inside a block: "
            f"{spec.num_layers} whole-page planes, equal TP only")
    return DetectedLayout(spec, "packed-head", desc)


def layer_ranges(kv_caches: Mapping[str, Any], num_layers: int) -> dict[str, tuple[int, int]]:
    """vLLM layer name -> the kvlink layers ``[start, stop)`` of its KV cache tensor in the
    spec :func:`detect` made of the same caches (a heads-apart layout has several per vLLM
    layer; a name sharing another's tensor, cross-layer KV sharing, gets that one's). What a
    layer-wise push posts once vLLM says the layer's attention ran (``save_kv_layer``)."""
    unique = _unique_layers(kv_caches)
    if not unique or num_layers % len(unique):
        raise LayoutError(f"{num_layers} kvlink layers do not split over {len(unique)} vLLM "
                          "KV cache tensors")
    per = num_layers // len(unique)

    def key(t: Any) -> tuple[int, tuple[int, ...]]:
        first = t[0] if isinstance(t, (tuple, list)) else t
        return int(first.data_ptr()), tuple(first.shape)

    index = {key(t): i for i, (_, t) in enumerate(unique)}
    return {name: (index[key(t)] * per, index[key(t)] * per + per)
            for name, t in kv_caches.items()}


def expand_blocks(ids: tuple[int, ...] | list[int], ratio: int) -> npt.NDArray[np.int64]:
    """Scheduler block ids -> kernel block ids (vLLM may split a block into ``ratio`` pages)."""
    a = np.asarray(ids, dtype=np.int64)
    if ratio == 1:
        return a
    return (a[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)
