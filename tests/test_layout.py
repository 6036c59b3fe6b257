"""KVCacheSpec byte ranges checked against the real memory of numpy arrays and torch tensors.

Every cache is filled with distinct values; the bytes at ``spec.page_extents(...)`` (read straight
from memory through :func:`kvlink.hostmem.view`) must equal the numpy slice of the logical
``(block, token, head, dim)`` page, in the page's physical order (token-major for NHD, head-major
for HND).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvlink.errors import BlockIdOutOfRange, LayoutError
from kvlink.hostmem import view
from kvlink.layout import KVCacheSpec, Layout
from kvlink.transport import RegionTable

NB, BS, H, D = 5, 4, 4, 3  # blocks, block size, heads, head dim (nb != 2: unambiguous)
LAYERS = 3

# A "plane getter" maps one layer's tensor (as handed to from_arrays) and kv to the logical
# (blocks, tokens, heads, dim) numpy view of that plane.
PlaneFn = Callable[[Any, int], np.ndarray]


def _np(t: Any) -> np.ndarray:
    """Numpy view (no copy) of a numpy array or CPU torch tensor; bf16 viewed as int16."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return np.asarray(t.numpy())
    return np.asarray(t)


def extent_bytes(ext: np.ndarray) -> bytes:
    return b"".join(bytes(view(int(a), int(n))) for a, n in zip(ext["addr"], ext["len"]))


def page_bytes_ref(plane: np.ndarray, block: int, h0: int, h1: int, layout: Layout) -> bytes:
    page = plane[block, :, h0:h1, :]  # (tokens, heads, dim)
    if layout is Layout.HND:
        page = page.transpose(1, 0, 2)  # heads-major in memory
    return np.ascontiguousarray(page).tobytes()


# ----------------------------------------------------------------------------- cache builders
def _fill_np(buf: np.ndarray) -> np.ndarray:
    buf[...] = np.arange(buf.size, dtype=np.int64).reshape(buf.shape).astype(buf.dtype)
    return buf


def np_split(layout: Layout, dtype: Any = np.float32) -> tuple[list[Any], PlaneFn]:
    """FlashAttention: (2, blocks, block_size, heads, dim), one buffer for all layers."""
    if layout is Layout.NHD:
        buf = _fill_np(np.empty((LAYERS, 2, NB, BS, H, D), dtype))
        layers = list(buf)
    else:
        buf = _fill_np(np.empty((LAYERS, 2, NB, H, BS, D), dtype))
        layers = [b.transpose(0, 1, 3, 2, 4) for b in buf]
    return layers, lambda t, kv: _np(t)[kv]


def np_joined(layout: Layout, dtype: Any = np.float32) -> tuple[list[Any], PlaneFn]:
    """FlashInfer: (blocks, 2, block_size, heads, dim); layers allocated separately."""
    if layout is Layout.NHD:
        layers = [_fill_np(np.empty((NB, 2, BS, H, D), dtype)) for _ in range(LAYERS)]
    else:
        layers = [_fill_np(np.empty((NB, 2, H, BS, D), dtype)).transpose(0, 1, 3, 2, 4)
                  for _ in range(LAYERS)]
    return layers, lambda t, kv: _np(t)[:, kv]


def np_pair(layout: Layout, dtype: Any = np.float32) -> tuple[list[Any], PlaneFn]:
    """Separate K and V tensors of (blocks, block_size, heads, dim)."""
    def one() -> np.ndarray:
        if layout is Layout.NHD:
            return _fill_np(np.empty((NB, BS, H, D), dtype))
        return _fill_np(np.empty((NB, H, BS, D), dtype)).transpose(0, 2, 1, 3)
    layers = [(one(), one()) for _ in range(LAYERS)]
    return layers, lambda t, kv: _np(t[kv])


def np_mla(layout: Layout, dtype: Any = np.float32) -> tuple[list[Any], PlaneFn]:
    buf = _fill_np(np.empty((LAYERS, NB, BS, 7), dtype))
    return list(buf), lambda t, kv: _np(t)[:, :, None, :]


def _fill_torch(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bfloat16:
        vals = torch.arange(t.numel(), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        vals = torch.arange(t.numel(), dtype=torch.float32).to(t.dtype)
    t.view(-1).copy_(vals)
    return t


def torch_split(layout: Layout, dtype: Any = torch.float32) -> tuple[list[Any], PlaneFn]:
    if layout is Layout.NHD:
        buf = _fill_torch(torch.empty((LAYERS, 2, NB, BS, H, D), dtype=dtype))
        layers = list(buf.unbind(0))
    else:
        buf = _fill_torch(torch.empty((LAYERS, 2, NB, H, BS, D), dtype=dtype))
        layers = [b.permute(0, 1, 3, 2, 4) for b in buf.unbind(0)]
    return layers, lambda t, kv: _np(t)[kv]


def torch_joined(layout: Layout, dtype: Any = torch.float32) -> tuple[list[Any], PlaneFn]:
    if layout is Layout.NHD:
        layers = [_fill_torch(torch.empty((NB, 2, BS, H, D), dtype=dtype))
                  for _ in range(LAYERS)]
    else:
        layers = [_fill_torch(torch.empty((NB, 2, H, BS, D), dtype=dtype)).permute(0, 1, 3, 2, 4)
                  for _ in range(LAYERS)]
    return layers, lambda t, kv: _np(t)[:, kv]


def torch_pair(layout: Layout, dtype: Any = torch.float32) -> tuple[list[Any], PlaneFn]:
    def one() -> torch.Tensor:
        if layout is Layout.NHD:
            return _fill_torch(torch.empty((NB, BS, H, D), dtype=dtype))
        return _fill_torch(torch.empty((NB, H, BS, D), dtype=dtype)).permute(0, 2, 1, 3)
    layers = [(one(), one()) for _ in range(LAYERS)]
    return layers, lambda t, kv: _np(t[kv])


def torch_mla(layout: Layout, dtype: Any = torch.float32) -> tuple[list[Any], PlaneFn]:
    buf = _fill_torch(torch.empty((LAYERS, NB, BS, 7), dtype=dtype))
    return list(buf.unbind(0)), lambda t, kv: _np(t)[:, :, None, :]


BUILDERS = {
    "np-split": np_split, "np-joined": np_joined, "np-pair": np_pair, "np-mla": np_mla,
    "torch-split": torch_split, "torch-joined": torch_joined, "torch-pair": torch_pair,
    "torch-mla": torch_mla,
}


def _check_all_pages(spec: KVCacheSpec, layers: list[Any], plane: PlaneFn) -> int:
    """Compare every (layer, block, kv, head range) against numpy; returns the pages checked."""
    checked = 0
    table = RegionTable(spec.regions)
    for li, t in enumerate(layers):
        for kv in range(spec.num_kv):
            p = plane(t, kv)
            for block in range(spec.num_blocks):
                for h0 in range(spec.num_kv_heads):
                    for h1 in range(h0 + 1, spec.num_kv_heads + 1):
                        ext = spec.page_extents(li, block, kv, heads=(h0, h1))
                        table.locate(ext)  # inside the registered regions
                        want = page_bytes_ref(p, block, h0, h1, spec.layout)
                        assert extent_bytes(ext) == want, (li, block, kv, h0, h1)
                        contiguous = (spec.layout is Layout.HND or spec.block_size == 1
                                      or (h0, h1) == (0, spec.num_kv_heads))
                        assert ext.shape[0] == (1 if contiguous else spec.block_size)
                        checked += 1
                # default heads = all heads
                assert extent_bytes(spec.page_extents(li, block, kv)) == page_bytes_ref(
                    p, block, 0, spec.num_kv_heads, spec.layout)
    return checked


# ----------------------------------------------------------------------------- page bytes
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND], ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_page_extents_match_memory(kind: str, layout: Layout) -> None:
    layers, plane = BUILDERS[kind](layout)
    spec = KVCacheSpec.from_arrays(layers)
    mla = kind.endswith("mla")
    assert spec.mla is mla
    assert spec.num_kv == (1 if mla else 2)
    assert spec.num_layers == LAYERS
    assert spec.num_blocks == NB
    assert spec.block_size == BS
    assert spec.num_kv_heads == (1 if mla else H)
    assert spec.head_dim == (7 if mla else D)
    assert spec.itemsize == 4
    assert spec.dtype == "float32"
    assert spec.layout is (Layout.NHD if mla else layout)
    assert _check_all_pages(spec, layers, plane) > 0


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND], ids=lambda x: x.value)
@pytest.mark.parametrize("kind", ["torch-split", "torch-joined", "torch-pair", "torch-mla"])
def test_page_extents_bf16_torch(kind: str, layout: Layout) -> None:
    layers, plane = BUILDERS[kind](layout, torch.bfloat16)
    spec = KVCacheSpec.from_tensors({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
    assert (spec.dtype, spec.itemsize) == ("bfloat16", 2)
    _check_all_pages(spec, layers, plane)


def test_block_size_one_and_single_head() -> None:
    """Degenerate pages (one token, one head) are still addressed correctly."""
    buf = _fill_np(np.empty((2, 2, 6, 1, 1, 5), np.float16))
    layers = list(buf)
    spec = KVCacheSpec.from_arrays(layers)
    assert (spec.block_size, spec.num_kv_heads, spec.itemsize) == (1, 1, 2)
    _check_all_pages(spec, layers, lambda t, kv: t[kv])


def test_explicit_dtype_name_overrides() -> None:
    layers, _ = np_split(Layout.NHD, np.uint16)
    spec = KVCacheSpec.from_arrays(layers, dtype="bfloat16", total_kv_heads=8, tp_size=2,
                                   tp_rank=1)
    assert (spec.dtype, spec.itemsize) == ("bfloat16", 2)
    assert (spec.total_kv_heads, spec.tp_size, spec.tp_rank) == (8, 2, 1)
    assert spec.geometry()["total_kv_heads"] == 8


# ----------------------------------------------------------------------------- ambiguity
@pytest.mark.parametrize("kv_dim", [0, 1])
def test_two_blocks_needs_kv_dim(kv_dim: int) -> None:
    buf = _fill_np(np.empty((2, 2, BS, H, D), np.float32))
    with pytest.raises(LayoutError, match=r"ambiguous.*kv_dim"):
        KVCacheSpec.from_arrays([buf])
    spec = KVCacheSpec.from_arrays([buf], kv_dim=kv_dim)
    assert spec.num_blocks == 2
    plane: PlaneFn = (lambda t, kv: t[kv]) if kv_dim == 0 else (lambda t, kv: t[:, kv])
    _check_all_pages(spec, [buf], plane)


def test_kv_dim_must_index_a_pair() -> None:
    buf = np.zeros((2, NB, BS, H, D), np.float32)
    with pytest.raises(LayoutError, match="kv_dim=1"):
        KVCacheSpec.from_arrays([buf], kv_dim=1)


# ----------------------------------------------------------------------------- regions
def _spans(layers: list[Any]) -> list[tuple[int, int]]:
    out = []
    for t in layers:
        for x in (t if isinstance(t, tuple) else (t,)):
            a = _np(x)
            base = a.__array_interface__["data"][0]
            out.append((base, base + a.nbytes))
    return out


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_regions_cover_every_tensor(kind: str) -> None:
    layers, _ = BUILDERS[kind](Layout.HND)
    spec = KVCacheSpec.from_arrays(layers)
    spans = _spans(layers)
    for a, b in spans:  # every tensor byte inside exactly one region
        inside = [r for r in spec.regions if r.addr <= a and b <= r.addr + r.nbytes]
        assert len(inside) == 1
    # regions hold nothing but tensor bytes (the tensors of one cache never overlap)
    assert sum(r.nbytes for r in spec.regions) == sum(b - a for a, b in spans)
    assert all(r.device == "cpu" for r in spec.regions)
    starts = sorted((r.addr, r.addr + r.nbytes) for r in spec.regions)
    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(starts))  # disjoint, not adjacent


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND], ids=lambda x: x.value)
def test_views_of_one_buffer_merge_into_one_region(layout: Layout) -> None:
    for builder in (np_split, np_mla):
        layers, _ = builder(layout)
        spec = KVCacheSpec.from_arrays(layers)
        buf = layers[0]
        while buf.base is not None:
            buf = buf.base
        assert len(spec.regions) == 1
        assert spec.regions[0].addr == buf.__array_interface__["data"][0]
        assert spec.regions[0].nbytes == buf.nbytes
    # torch: layers as views of one storage
    tlayers, _ = torch_split(layout)
    spec = KVCacheSpec.from_tensors(tlayers)
    assert len(spec.regions) == 1
    assert spec.regions[0].nbytes == LAYERS * 2 * NB * BS * H * D * 4


def test_views_with_gaps_stay_separate_regions() -> None:
    per = 2 * NB * BS * H * D
    buf = np.zeros(LAYERS * (per + 8), np.float32)
    layers = [buf[i * (per + 8): i * (per + 8) + per].reshape(2, NB, BS, H, D)
              for i in range(LAYERS)]
    spec = KVCacheSpec.from_arrays(layers)
    assert len(spec.regions) == LAYERS
    assert [r.nbytes for r in spec.regions] == [per * 4] * LAYERS


def test_pair_kv_adjacent_in_one_buffer_merge() -> None:
    buf = np.zeros((LAYERS, 2, NB, BS, H, D), np.float32)
    layers = [(b[0], b[1]) for b in buf]
    spec = KVCacheSpec.from_arrays(layers)
    assert len(spec.regions) == 1 and spec.regions[0].nbytes == buf.nbytes


# ----------------------------------------------------------------------------- errors
def test_non_dense_page_names_strides() -> None:
    padded = np.zeros((2, NB, BS, H, D + 1), np.float32)[..., :D]  # head stride 16, not 12
    with pytest.raises(LayoutError) as ei:
        KVCacheSpec.from_arrays([padded])
    msg = str(ei.value)
    s = padded.strides
    assert f"({s[2]}, {s[3]}, {s[4]})" in msg and "layer 0" in msg


def test_strided_head_dim_names_stride() -> None:
    strided = np.zeros((2, NB, BS, H, 2 * D), np.float32)[..., ::2]
    with pytest.raises(LayoutError, match=r"stride 8 B, itemsize 4"):
        KVCacheSpec.from_arrays([strided])


def test_token_and_head_swapped_in_memory_rejected() -> None:
    """Tokens strided by a whole block: neither NHD nor HND; the message names the strides."""
    phys = np.zeros((2, BS, NB, H, D), np.float32)  # block dim inside the token dim
    bad = phys.transpose(0, 2, 1, 3, 4)
    with pytest.raises(LayoutError, match=rf"\({bad.strides[2]}, {bad.strides[3]}, 4\)"):
        KVCacheSpec.from_arrays([bad])


def test_overlapping_pages_rejected() -> None:
    page = np.zeros((2, 1, BS, H, D), np.float32)
    broadcast = np.broadcast_to(page, (2, NB, BS, H, D))  # block stride 0: every block aliases
    with pytest.raises(LayoutError, match="block stride 0 B"):
        KVCacheSpec.from_arrays([broadcast])


def test_layer_mismatch_and_bad_shapes() -> None:
    a = np.zeros((2, NB, BS, H, D), np.float32)
    b = np.zeros((2, NB + 1, BS, H, D), np.float32)
    with pytest.raises(LayoutError, match="layer 1 geometry"):
        KVCacheSpec.from_arrays([a, b])
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        KVCacheSpec.from_arrays([])
    with pytest.raises(LayoutError, match=r"shape \(3, 4\)"):
        KVCacheSpec.from_arrays([np.zeros((3, 4), np.float32)])
    with pytest.raises(LayoutError, match=r"\(K, V\) pair, got 3"):
        KVCacheSpec.from_arrays([(a[0], a[1], a[0])])
    with pytest.raises(LayoutError, match="must be equal"):
        KVCacheSpec.from_arrays([(a[0], b[0])])
    with pytest.raises(LayoutError, match="unsupported"):
        KVCacheSpec.from_arrays(["not a tensor"])


@pytest.mark.parametrize("bad", [NB, NB + 7, -1])
def test_block_id_out_of_range_names_id_and_range(bad: int) -> None:
    layers, _ = np_split(Layout.NHD)
    spec = KVCacheSpec.from_arrays(layers)
    with pytest.raises(BlockIdOutOfRange) as ei:
        spec.page_extents(0, bad, 0)
    assert f"block id {bad}" in str(ei.value) and f"[0, {NB})" in str(ei.value)
    with pytest.raises(BlockIdOutOfRange) as ei:
        spec.check_block_ids([0, 1, bad, 2], side="remote")
    msg = str(ei.value)
    assert f"remote block id {bad} (position 2)" in msg and f"[0, {NB})" in msg
    with pytest.raises(BlockIdOutOfRange, match="1-D"):
        spec.check_block_ids([[0, 1]])
    with pytest.raises(BlockIdOutOfRange, match="integers"):
        spec.check_block_ids([0.0, 1.0])
    assert spec.check_block_ids([]).dtype == np.int64


def test_head_range_checked() -> None:
    layers, _ = np_split(Layout.NHD)
    spec = KVCacheSpec.from_arrays(layers)
    for heads in ((0, H + 1), (2, 2), (-1, 1)):
        with pytest.raises(LayoutError, match="head range"):
            spec.page_extents(0, 0, 0, heads=heads)


# ----------------------------------------------------------------------------- known bugs
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_hnd_single_head_is_reported_hnd(lib: str) -> None:
    if lib == "numpy":
        t: Any = np.zeros((2, NB, 1, BS, D), np.float32).transpose(0, 1, 3, 2, 4)
    else:
        t = torch.zeros((2, NB, 1, BS, D)).permute(0, 1, 3, 2, 4)
    assert KVCacheSpec.from_arrays([t]).layout is Layout.HND


def test_negative_block_stride_is_a_layout_error() -> None:
    reversed_blocks = np.zeros((2, NB, BS, H, D), np.float32)[:, ::-1]
    with pytest.raises(LayoutError):
        KVCacheSpec.from_arrays([reversed_blocks])


def test_huge_block_id_is_named_verbatim() -> None:
    layers, _ = np_split(Layout.NHD)
    spec = KVCacheSpec.from_arrays(layers)
    with pytest.raises(BlockIdOutOfRange, match=str(2**64 - 1)):
        spec.check_block_ids(np.array([2**64 - 1], dtype=np.uint64))
