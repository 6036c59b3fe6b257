"""KVCacheSpec: one worker's KV cache as byte geometry.

The cache is modelled as *planes*: one page array per (layer, K|V) — a single plane per layer
for MLA (the latent) and for vLLM >= 0.32's packed caches (``kv_packed``: K‖V of one (token,
head) side by side in the content dim, RFC 42082). A page is one block of ``block_size`` tokens
for the heads this rank holds, stored NHD (token-major) or HND (head-major); ``head_dim`` is what
one (token, head) holds in one plane, so ``2·D`` for a packed cache. Every byte kvlink moves is
addressed as ``plane_base[layer, kv] + block_id * block_stride[layer, kv] + offset-in-page``;
this is enough to describe vLLM's FlashAttention (K/V split: ``(2, blocks, ...)``), FlashInfer
(K/V joined per block: ``(blocks, 2, ...)``), separate K and V tensors, MLA and the packed
``(B, H, N, C)`` caches of every layout with dense pages, whatever the physical stride order —
which is read from the strides, never assumed from the shape.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import BlockIdOutOfRange, LayoutError
from kvlink.transport import Extents, Region, make_extents

_BUILTIN_MAX = 2048  # ids checked through a memoryview up to this many (check_block_ids)


class Layout(str, enum.Enum):
    NHD = "NHD"  # page = [token][head][dim]: a head slice is block_size strided pieces
    HND = "HND"  # page = [head][token][dim]: a head slice is one contiguous piece


_DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float64": 8,
}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What kvlink needs of a tensor: pointer, logical shape, byte strides, dtype, device."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    dtype: str
    device: str

    @classmethod
    def of(cls, t: Any) -> ArrayInfo:
        if isinstance(t, np.ndarray):
            return cls(
                ptr=int(t.__array_interface__["data"][0]), shape=tuple(t.shape),
                strides=tuple(int(s) for s in t.strides), itemsize=t.itemsize,
                dtype=t.dtype.name, device="cpu",
            )
        if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch.Tensor, duck-typed
            es = int(t.element_size())
            dev = t.device
            device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
            return cls(
                ptr=int(t.data_ptr()), shape=tuple(int(s) for s in t.shape),
                strides=tuple(int(s) * es for s in t.stride()), itemsize=es,
                dtype=str(t.dtype).removeprefix("torch."), device=device,
            )
        raise LayoutError(f"unsupported KV cache array type {type(t).__name__}")

    def span(self) -> tuple[int, int]:
        """[start, end) byte range this (possibly strided) view touches."""
        if any(s == 0 for s in self.shape):
            return self.ptr, self.ptr
        lo = self.ptr + sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        hi = self.ptr + sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0)
        return lo, hi + self.itemsize


def check_in_range(ids: npt.NDArray[Any], count: int, side: str) -> None:
    """Raise BlockIdOutOfRange naming the first of ``ids`` outside [0, ``count``) (a slow
    path: where a cheaper check, or the device, found one)."""
    bad = np.flatnonzero((ids < 0) | (ids >= count))
    if bad.size:
        raise BlockIdOutOfRange(f"{side} block id {int(ids[bad[0]])} (position {int(bad[0])}) "
                                f"is out of range [0, {count})")


@dataclasses.dataclass(frozen=True, eq=False)
class KVCacheSpec:
    """Byte geometry of one worker's KV cache (see module docstring)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # heads this rank holds (1 for MLA)
    head_dim: int  # per-head dim; the latent dim for MLA
    dtype: str
    itemsize: int
    layout: Layout
    mla: bool
    regions: tuple[Region, ...]
    plane_base: npt.NDArray[np.uint64]  # [num_layers, num_kv] absolute address of block 0
    block_stride: npt.NDArray[np.uint64]  # [num_layers, num_kv] bytes between blocks
    total_kv_heads: int = 0  # across all TP ranks (0 -> num_kv_heads)
    tp_size: int = 1
    tp_rank: int = 0
    kv_packed: bool = False  # one plane per layer, content = K‖V; heads sliced like K/V planes

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim",
                     "itemsize"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        known = _DTYPE_SIZES.get(self.dtype)
        if known is not None and known != self.itemsize:
            raise LayoutError(f"dtype {self.dtype} has itemsize {known}, got {self.itemsize}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutError(
                f"MLA caches hold one latent per token, got {self.num_kv_heads} heads")
        if self.kv_packed and (self.mla or self.head_dim % 2):
            raise LayoutError(f"a packed K|V plane needs an even content dim and no MLA, got "
                              f"head_dim={self.head_dim} mla={self.mla}")
        want = (self.num_layers, self.num_kv)
        if self.plane_base.shape != want or self.block_stride.shape != want:
            raise LayoutError(f"plane arrays must have shape {want}, got {self.plane_base.shape}")
        if np.any(self.block_stride < self.page_bytes):
            raise LayoutError(
                f"block stride {int(self.block_stride.min())} B is smaller than a page "
                f"({self.page_bytes} B): pages would overlap"
            )

    def layers(self, start: int, stop: int) -> KVCacheSpec:
        """The same cache restricted to layers ``[start, stop)`` (a layer-wise push plans one
        range at a time); the regions stay whole (they are what is registered)."""
        if not 0 <= start < stop <= self.num_layers:
            raise LayoutError(f"layer range [{start}, {stop}) outside [0, {self.num_layers})")
        return dataclasses.replace(self, num_layers=stop - start,
                                   plane_base=self.plane_base[start:stop],
                                   block_stride=self.block_stride[start:stop])

    # ------------------------------------------------------------------ derived geometry
    @property
    def num_kv(self) -> int:
        """Planes per layer: 2 (K and V), or 1 (MLA latent, packed K‖V)."""
        return 1 if self.mla or self.kv_packed else 2

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one plane."""
        return self.block_size * self.num_kv_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for across all layers and planes."""
        return self.page_bytes * self.num_layers * self.num_kv

    @property
    def device(self) -> str:
        return self.regions[0].device if self.regions else "cpu"

    def check_block_ids(self, ids: npt.ArrayLike, side: str = "local") -> npt.NDArray[np.int64]:
        """Block ids as int64, bounds-checked: the guard before anything is posted."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise BlockIdOutOfRange(f"{side} block ids must be 1-D, got shape {arr.shape}")
        if not arr.size:
            return arr.astype(np.int64, copy=False)
        if arr.dtype.kind not in "iu":
            raise BlockIdOutOfRange(f"{side} block ids must be integers, got dtype {arr.dtype}")
        out = arr.astype(np.int64, copy=False)
        # one reduction on every request's path: a negative id wraps to a huge unsigned one.
        # A request's few hundred ids through the buffer protocol: where the code has gone
        # cold since the last request numpy's reduction costs more than the builtin's loop
        # (bench/results/cold_calls.json: 26 against 17 us); past a few thousand ids, less
        if (max(out.data.cast("B").cast("Q")) if out.shape[0] <= _BUILTIN_MAX
                and out.flags.c_contiguous else int(out.view(np.uint64).max())
                ) >= self.num_blocks:
            check_in_range(arr, self.num_blocks, side)
        return out

    def page_extents(self, layer: int, block: int, kv: int = 0,
                     heads: tuple[int, int] | None = None) -> Extents:
        """Byte ranges of heads [h0, h1) (rank-local) of one page; the reference for tests."""
        self.check_block_ids([block])
        h0, h1 = heads if heads is not None else (0, self.num_kv_heads)
        if not 0 <= h0 < h1 <= self.num_kv_heads:
            raise LayoutError(f"head range [{h0}, {h1}) outside [0, {self.num_kv_heads})")
        base = int(self.plane_base[layer, kv]) + block * int(self.block_stride[layer, kv])
        hb = self.head_bytes
        if self.layout is Layout.HND or (h0 == 0 and h1 == self.num_kv_heads):
            start = h0 * self.block_size * hb if self.layout is Layout.HND else 0
            return make_extents([base + start], [(h1 - h0) * self.block_size * hb])
        tok = np.arange(self.block_size, dtype=np.uint64)
        return make_extents(base + (tok * self.num_kv_heads + h0) * hb, (h1 - h0) * hb)

    @property
    def layout_matters(self) -> bool:
        """With one head per page, NHD and HND are the same bytes: the layout is free."""
        return self.num_kv_heads > 1

    def geometry(self) -> dict[str, Any]:
        """Everything two sides must agree on to exchange blocks (input of the compat hash)."""
        return {
            "num_layers": self.num_layers, "block_size": self.block_size,
            "head_dim": self.head_dim, "dtype": self.dtype,
            "layout": self.layout.value if self.layout_matters else "any",
            "mla": self.mla, "kv_packed": self.kv_packed,
            "total_kv_heads": self.total_kv_heads,
        }

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, Any] | Sequence[Any],
        *,
        mla: bool | None = None,
        kv_dim: int | None = None,
        total_kv_heads: int = 0,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: str | None = None,
        kv_packed: bool = False,
    ) -> KVCacheSpec:
        """Describe caches the way vLLM hands them over: one tensor (or a (K, V) pair) per layer.

        Accepted per layer (torch tensors or numpy arrays, any physical stride order):
        ``(2, blocks, block_size, heads, dim)`` K/V split, ``(blocks, 2, block_size, heads, dim)``
        K/V joined, a ``(K, V)`` pair of ``(blocks, block_size, heads, dim)``, or MLA
        ``(blocks, block_size, latent)``. ``kv_dim`` disambiguates when blocks == 2. With
        ``kv_packed``: vLLM >= 0.32's ``(blocks, heads, block_size, 2·dim)`` per layer, K‖V in
        the last dim, pages head-major (LBHNC, BLHNC) or token-major (LBNHC, BLNHC).
        """
        layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        if not layers:
            raise LayoutError("no KV cache tensors given")
        if kv_packed and mla:
            raise LayoutError("kv_packed and mla exclude each other (an MLA page is one latent)")
        parsed = [_parse_packed(i, t) if kv_packed else _parse_layer(i, t, mla, kv_dim)
                  for i, t in enumerate(layers)]
        first = parsed[0]
        for i, p in enumerate(parsed[1:], start=1):
            if p.key() != first.key():
                raise LayoutError(
                    f"layer {i} geometry {p.key()} differs from layer 0 {first.key()}")
        devices = {p.device for p in parsed}
        if len(devices) != 1:
            raise LayoutError(f"KV cache layers live on different devices: {sorted(devices)}")
        spans = [s for p in parsed for s in p.spans]
        regions = tuple(Region(a, b - a, first.device) for a, b in _union(spans))
        return cls(
            num_layers=len(parsed), num_blocks=first.num_blocks, block_size=first.block_size,
            num_kv_heads=first.heads, head_dim=first.head_dim, dtype=dtype or first.dtype,
            itemsize=first.itemsize, layout=first.layout, mla=first.mla, regions=regions,
            plane_base=np.array([p.bases for p in parsed], dtype=np.uint64),
            block_stride=np.array([p.strides for p in parsed], dtype=np.uint64),
            total_kv_heads=total_kv_heads, tp_size=tp_size, tp_rank=tp_rank,
            kv_packed=kv_packed,
        )

    from_arrays = from_tensors


@dataclasses.dataclass
class _Layer:
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    itemsize: int
    dtype: str
    device: str
    layout: Layout
    mla: bool
    bases: list[int]
    strides: list[int]
    spans: list[tuple[int, int]]

    def key(self) -> tuple[Any, ...]:
        return (self.num_blocks, self.block_size, self.heads, self.head_dim, self.dtype,
                self.layout, self.mla)


def _page_layout(info: ArrayInfo, dims: tuple[int, int, int], where: str) -> Layout:
    """NHD or HND from the byte strides of the (token, head, dim) dims; the page must be dense."""
    (bs, h, d), es = (info.shape[i] for i in dims), info.itemsize
    s_tok, s_head, s_dim = (info.strides[i] for i in dims)
    if s_dim != es and d > 1:
        raise LayoutError(f"{where}: head dim is not contiguous (stride {s_dim} B, itemsize {es})")
    nhd_exact = s_head == d * es and s_tok == h * d * es
    hnd_exact = s_tok == d * es and s_head == bs * d * es
    if hnd_exact and not nhd_exact:
        return Layout.HND
    if nhd_exact:
        return Layout.NHD
    # size-1 dims may carry any stride: fall back to rules that ignore them
    if (s_head == d * es or h == 1) and (s_tok == h * d * es or bs == 1):
        return Layout.NHD
    if (s_tok == d * es or bs == 1) and (s_head == bs * d * es or h == 1):
        return Layout.HND
    raise LayoutError(
        f"{where}: page of shape (tokens={bs}, heads={h}, dim={d}) with byte strides "
        f"({s_tok}, {s_head}, {s_dim}) is neither dense NHD nor dense HND"
    )


def _parse_packed(i: int, t: Any) -> _Layer:
    """One packed ``(B, H, N, C)`` layer: a single plane whose (token, head) content is K‖V."""
    where = f"layer {i}"
    info = ArrayInfo.of(t)
    if len(info.shape) != 4:
        raise LayoutError(f"{where}: a packed K|V cache is (blocks, heads, tokens, content), "
                          f"got shape {info.shape}")
    nb, h, bs, c = info.shape
    if info.strides[0] <= 0 and nb > 1:
        raise LayoutError(f"{where}: block stride {info.strides[0]} B is not positive")
    if c % 2:
        raise LayoutError(f"{where}: packed content dim {c} is not K‖V (odd)")
    layout = _page_layout(info, (2, 1, 3), where)
    return _Layer(nb, bs, h, c, info.itemsize, info.dtype, info.device, layout, False,
                  [info.ptr], [info.strides[0]], [info.span()])


def _parse_layer(i: int, t: Any, mla: bool | None, kv_dim: int | None) -> _Layer:
    where = f"layer {i}"
    if isinstance(t, (tuple, list)):
        if len(t) != 2:
            raise LayoutError(f"{where}: expected a (K, V) pair, got {len(t)} tensors")
        k, v = ArrayInfo.of(t[0]), ArrayInfo.of(t[1])
        if k.shape != v.shape or k.strides != v.strides or len(k.shape) != 4:
            raise LayoutError(f"{where}: K {k.shape} and V {v.shape} must be equal 4-D tensors")
        if k.strides[0] <= 0 and k.shape[0] > 1:
            raise LayoutError(f"{where}: block stride {k.strides[0]} B is not positive")
        layout = _page_layout(k, (1, 2, 3), where)
        nb, bs, h, d = k.shape
        return _Layer(nb, bs, h, d, k.itemsize, k.dtype, k.device, layout, False,
                      [k.ptr, v.ptr], [k.strides[0]] * 2, [k.span(), v.span()])
    info = ArrayInfo.of(t)
    nd = len(info.shape)
    if nd == 3 and mla is not False:
        nb, bs, d = info.shape
        if info.strides[0] <= 0 and nb > 1:
            raise LayoutError(f"{where}: block stride {info.strides[0]} B is not positive")
        if info.strides[2] != info.itemsize or (bs > 1 and info.strides[1] != d * info.itemsize):
            raise LayoutError(f"{where}: MLA page (tokens={bs}, latent={d}) is not dense")
        return _Layer(nb, bs, 1, d, info.itemsize, info.dtype, info.device, Layout.NHD, True,
                      [info.ptr], [info.strides[0]], [info.span()])
    if nd != 5 or mla:
        raise LayoutError(
            f"{where}: cannot describe a tensor of shape {info.shape} "
            "(expected (2,B,T,H,D), (B,2,T,H,D), a (K,V) pair, or MLA (B,T,L))"
        )
    if kv_dim is None:
        if info.shape[0] == 2 and info.shape[1] != 2:
            kv_dim = 0
        elif info.shape[1] == 2 and info.shape[0] != 2:
            kv_dim = 1
        else:
            raise LayoutError(f"{where}: shape {info.shape} is ambiguous; pass kv_dim=0 or 1")
    if kv_dim not in (0, 1) or info.shape[kv_dim] != 2:
        raise LayoutError(f"{where}: kv_dim={kv_dim} does not index a size-2 dim of {info.shape}")
    blk_dim = 1 - kv_dim
    if info.strides[blk_dim] <= 0 and info.shape[blk_dim] > 1:
        raise LayoutError(f"{where}: block stride {info.strides[blk_dim]} B is not positive")
    layout = _page_layout(info, (2, 3, 4), where)
    nb = info.shape[blk_dim]
    _, _, bs, h, d = info.shape
    s_kv = info.strides[kv_dim]
    return _Layer(nb, bs, h, d, info.itemsize, info.dtype, info.device, layout, False,
                  [info.ptr, info.ptr + s_kv], [info.strides[blk_dim]] * 2, [info.span()])


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping/adjacent byte spans: layers may be views of one big allocation."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r}; known: {', '.join(_DTYPE_SIZES)}") from None
