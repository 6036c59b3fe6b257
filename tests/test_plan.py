"""plan_transfer against a numpy reference: copying the planned extents must give exactly the bytes
of a block-by-block numpy copy, and touch nothing else.

Caches are real numpy buffers (with guard bytes around every allocation); copies are done with
``ctypes.memmove`` on the planned addresses, as a CPU transport would.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink.compat import check_compatible
from kvlink.errors import BlockIdOutOfRange, IncompatibleSpecError
from kvlink.headmap import HeadRead, map_heads, rank_heads
from kvlink.layout import KVCacheSpec
from kvlink.plan import Plan, coalesce, plan_transfer
from kvlink.transport import EXTENT_DTYPE, RegionTable

GUARD = 64  # bytes around every allocation; they must never change
KINDS = ("split", "joined", "pair", "mla")


@dataclasses.dataclass(frozen=True)
class Geo:
    layers: int
    blocks: int
    block_size: int
    heads: int  # heads this rank holds (1 for MLA)
    dim: int
    layout: str  # "NHD" | "HND"
    kind: str  # split | joined | pair | mla
    itemsize: int = 2
    one_buffer: bool = True

    @property
    def kvn(self) -> int:
        return 1 if self.kind == "mla" else 2

    @property
    def per_layer(self) -> int:  # elements
        return self.kvn * self.blocks * self.block_size * self.heads * self.dim

    def with_blocks(self, blocks: int) -> Geo:
        return dataclasses.replace(self, blocks=blocks)


@dataclasses.dataclass
class Cache:
    geo: Geo
    bufs: list[np.ndarray]  # flat uint8 allocations, guard bytes included
    tensors: list[Any]
    planes: list[list[np.ndarray]]  # [layer][kv] -> logical (blocks, tokens, heads, dim)
    spec: KVCacheSpec

    def snapshot(self) -> list[np.ndarray]:
        return [b.copy() for b in self.bufs]


def _dtype(itemsize: int) -> np.dtype[Any]:
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize])


def _page(flat: np.ndarray, g: Geo, lead: tuple[int, ...]) -> np.ndarray:
    """View ``flat`` as lead + (tokens, heads, dim), physically NHD or HND."""
    bs, h, d = g.block_size, g.heads, g.dim
    if g.layout == "NHD":
        return flat.reshape(*lead, bs, h, d)
    n = len(lead)
    return flat.reshape(*lead, h, bs, d).transpose(*range(n), n + 1, n, n + 2)


def carve(bufs: list[np.ndarray], g: Geo) -> tuple[list[Any], list[list[np.ndarray]]]:
    """vLLM-shaped layer tensors and logical planes over the given flat buffers."""
    dt, nb, per = _dtype(g.itemsize), g.blocks, g.per_layer
    tensors: list[Any] = []
    planes: list[list[np.ndarray]] = []
    for i in range(g.layers):
        if g.one_buffer:
            elems = bufs[0][GUARD:-GUARD].view(dt)
            flat = elems[i * per:(i + 1) * per]
        else:
            flat = bufs[i][GUARD:-GUARD].view(dt)
        if g.kind == "split":
            t = _page(flat, g, (2, nb))
            tensors.append(t)
            planes.append([t[0], t[1]])
        elif g.kind == "joined":
            t = _page(flat, g, (nb, 2))
            tensors.append(t)
            planes.append([t[:, 0], t[:, 1]])
        elif g.kind == "pair":
            k, v = _page(flat[:per // 2], g, (nb,)), _page(flat[per // 2:], g, (nb,))
            tensors.append((k, v))
            planes.append([k, v])
        else:
            t = flat.reshape(nb, g.block_size, g.dim)
            tensors.append(t)
            planes.append([t[:, :, None, :]])
    return tensors, planes


def make_cache(g: Geo, rng: np.random.Generator, *, total_heads: int = 0, tp: int = 1,
               rank: int = 0) -> Cache:
    nbytes = g.per_layer * g.itemsize
    sizes = [g.layers * nbytes] if g.one_buffer else [nbytes] * g.layers
    bufs = [rng.integers(0, 256, n + 2 * GUARD, dtype=np.uint8) for n in sizes]
    tensors, planes = carve(bufs, g)
    spec = KVCacheSpec.from_arrays(tensors, mla=g.kind == "mla", total_kv_heads=total_heads,
                                   tp_size=tp, tp_rank=rank)
    return Cache(g, bufs, tensors, planes, spec)


def apply(plan: Plan, local: Cache, remote: Cache) -> None:
    """READ: copy every remote extent onto its local extent."""
    assert plan.local.dtype == EXTENT_DTYPE and plan.remote.dtype == EXTENT_DTYPE
    assert np.array_equal(plan.local["len"], plan.remote["len"])
    RegionTable(local.spec.regions).locate(plan.local, "local extent")
    RegionTable(remote.spec.regions).locate(plan.remote, "remote extent")
    for la, ra, n in zip(plan.local["addr"].tolist(), plan.remote["addr"].tolist(),
                         plan.local["len"].tolist()):
        ctypes.memmove(la, ra, n)


def assert_disjoint(ext: np.ndarray) -> None:
    order = np.argsort(ext["addr"])
    a, n = ext["addr"][order], ext["len"][order]
    assert np.all(a[:-1] + n[:-1] <= a[1:]), "local extents overlap"


def reference_copy(local: Cache, remote: Cache, lids: np.ndarray, rids: np.ndarray,
                   heads: tuple[int, int, int] | None = None) -> list[np.ndarray]:
    """Expected local buffers: numpy block copy (``heads``: local h0, remote h0, count)."""
    expected = local.snapshot()
    _, planes = carve(expected, local.geo)
    for layer in range(local.geo.layers):
        for kv in range(local.geo.kvn):
            if heads is None:
                planes[layer][kv][lids] = remote.planes[layer][kv][rids]
            else:
                lh, rh, c = heads
                planes[layer][kv][lids, :, lh:lh + c] = remote.planes[layer][kv][rids, :, rh:rh + c]
    return expected


def assert_same(bufs: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for got, want in zip(bufs, expected):
        assert got[:GUARD].tobytes() == want[:GUARD].tobytes(), "guard bytes before changed"
        assert got[-GUARD:].tobytes() == want[-GUARD:].tobytes(), "guard bytes after changed"
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} bytes differ, first at offset {bad[:5]}"


# ----------------------------------------------------------------------------- strategies
@st.composite
def geometries(draw: st.DrawFn) -> Geo:
    kind = draw(st.sampled_from(KINDS))
    return Geo(
        layers=draw(st.integers(1, 4)),
        blocks=draw(st.integers(4, 40)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        heads=1 if kind == "mla" else draw(st.integers(1, 4)),
        dim=draw(st.sampled_from([1, 2, 8])),
        layout="NHD" if kind == "mla" else draw(st.sampled_from(["NHD", "HND"])),
        kind=kind,
        itemsize=draw(st.sampled_from([1, 2, 4])),
        one_buffer=draw(st.booleans()),
    )


@st.composite
def block_ids(draw: st.DrawFn, nb: int, n: int) -> np.ndarray:
    """n distinct ids of [0, nb): shuffled runs (some reversed), or a random permutation."""
    if draw(st.integers(0, 4)) == 0:
        ids = draw(st.permutations(range(nb)))
    else:
        cuts = draw(st.lists(st.integers(1, nb - 1), max_size=5, unique=True))
        bounds = [0, *sorted(cuts), nb]
        runs = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
        runs = draw(st.permutations(runs))
        flip = draw(st.lists(st.booleans(), min_size=len(runs), max_size=len(runs)))
        ids = [i for r, f in zip(runs, flip) for i in (r[::-1] if f else r)]
    skip = draw(st.integers(0, nb - n))
    return np.array(ids[skip:skip + n], dtype=np.int64)


@st.composite
def transfers(draw: st.DrawFn) -> tuple[Geo, Geo, np.ndarray, np.ndarray, int]:
    g = draw(geometries())
    rg = dataclasses.replace(g.with_blocks(draw(st.integers(4, 40))),
                             one_buffer=draw(st.booleans()))
    n = draw(st.integers(0, min(g.blocks, rg.blocks)))
    lids = draw(block_ids(g.blocks, n))
    rids = draw(block_ids(rg.blocks, n))
    seed = draw(st.integers(0, 2**32 - 1))
    return g, rg, lids, rids, seed


def _garbage_alloc(made: list[np.ndarray]) -> Any:
    """An extent allocator (as Transport.extents) whose arrays start as garbage, so a record
    the planner forgot to write shows; keeps what it made."""
    def alloc(n: int) -> np.ndarray:
        out = np.frombuffer(np.random.default_rng(n).bytes(16 * n), dtype=EXTENT_DTYPE).copy()
        made.append(out)
        return out
    return alloc


# ----------------------------------------------------------------------------- properties
@settings(max_examples=120, deadline=None)
@given(transfers())
def test_plan_copy_equals_numpy_block_copy(case: tuple[Geo, Geo, np.ndarray, np.ndarray, int]
                                           ) -> None:
    g, rg, lids, rids, seed = case
    rng = np.random.default_rng(seed)
    local, remote = make_cache(g, rng), make_cache(rg, rng)
    made: list[np.ndarray] = []
    plan = plan_transfer(local.spec, remote.spec, lids, rids, alloc=_garbage_alloc(made))
    assert plan.local is made[0] and plan.remote is made[1]  # built in the caller's arrays
    assert plan.nbytes == lids.size * local.spec.block_bytes
    assert plan.raw_descriptors == g.layers * g.kvn * lids.size
    assert plan.descriptors <= plan.raw_descriptors
    assert_disjoint(plan.local)
    expected = reference_copy(local, remote, lids, rids)
    remote_before = remote.snapshot()
    apply(plan, local, remote)
    assert_same(local.bufs, expected)
    assert_same(remote.bufs, remote_before)  # READ never writes the source


@settings(max_examples=60, deadline=None)
@given(geometries(), st.data())
def test_contiguous_ids_coalesce_to_one_extent_per_plane(g: Geo, data: st.DataObject) -> None:
    rg = g.with_blocks(data.draw(st.integers(4, 40), label="remote blocks"))
    n = data.draw(st.integers(1, min(g.blocks, rg.blocks) - 1), label="n")  # never a full plane
    a = data.draw(st.integers(0, g.blocks - n), label="local start")
    b = data.draw(st.integers(0, rg.blocks - n), label="remote start")
    rng = np.random.default_rng(0)
    local, remote = make_cache(g, rng), make_cache(rg, rng)
    lids, rids = np.arange(a, a + n), np.arange(b, b + n)
    plan = plan_transfer(local.spec, remote.spec, lids, rids)
    # split and (K, V) pairs: one extent per (layer, plane); joined: K and V of a block are
    # neighbours, so a run is one extent per layer; MLA: one plane per layer
    per_layer = 1 if g.kind in ("joined", "mla") else 2
    assert plan.descriptors == g.layers * per_layer
    assert np.all(plan.local["len"] == plan.nbytes // plan.descriptors)
    expected = reference_copy(local, remote, lids, rids)
    apply(plan, local, remote)
    assert_same(local.bufs, expected)


def test_split_contiguous_is_layers_times_two_extents() -> None:
    g = Geo(layers=3, blocks=12, block_size=4, heads=2, dim=8, layout="NHD", kind="split")
    rng = np.random.default_rng(1)
    local, remote = make_cache(g, rng), make_cache(g.with_blocks(20), rng)
    plan = plan_transfer(local.spec, remote.spec, np.arange(2, 9), np.arange(10, 17))
    assert plan.descriptors == 3 * 2 and plan.raw_descriptors == 3 * 2 * 7
    # non-contiguous on one side: nothing to merge
    plan = plan_transfer(local.spec, remote.spec, np.arange(2, 9)[::-1], np.arange(10, 17))
    assert plan.descriptors == plan.raw_descriptors


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    la = np.array([0, 4, 8, 16, 20], dtype=np.uint64)
    ra = np.array([100, 104, 200, 204, 208], dtype=np.uint64)
    lo, re = coalesce(la, ra, 4)
    assert lo["addr"].tolist() == [0, 8, 16] and re["addr"].tolist() == [100, 200, 204]
    assert lo["len"].tolist() == [8, 4, 8] and re["len"].tolist() == [8, 4, 8]
    lo, re = coalesce(np.empty(0, np.uint64), np.empty(0, np.uint64), 4)
    assert lo.shape == re.shape == (0,) and lo.dtype == EXTENT_DTYPE


# ----------------------------------------------------------------------------- heterogeneous TP
def _heads(h: int, tp: int, rank: int, mla: bool) -> tuple[int, int]:
    return (0, 1) if mla else rank_heads(h, tp, rank)


TP_CASES = [  # (prefill tp, decode tp, total kv heads, mla)
    (1, 2, 4, False), (2, 1, 4, False), (2, 4, 8, False), (2, 4, 4, False), (4, 2, 8, False),
    (8, 2, 4, False), (1, 8, 2, False), (4, 8, 4, False), (2, 2, 4, False),
    (2, 4, 1, True), (4, 2, 1, True), (1, 3, 1, True),
]


def _tp_params(plan: bool) -> list[Any]:
    out = []
    for ptp, dtp, h, mla in TP_CASES:
        for layout in (["NHD"] if mla else ["NHD", "HND"]):
            for kind in (["mla"] if mla else ["split", "joined", "pair"]):
                out.append(pytest.param(ptp, dtp, h, layout, kind,
                                        id=f"{ptp}to{dtp}-h{h}-{layout}-{kind}"))
    return out


def _build_tp(ptp: int, dtp: int, h: int, layout: str, kind: str
              ) -> tuple[list[list[np.ndarray]], list[Cache], list[Cache], np.random.Generator]:
    mla = kind == "mla"
    rng = np.random.default_rng(ptp * 1000 + dtp * 10 + h)
    pg = Geo(layers=2, blocks=9, block_size=4, heads=1, dim=3, layout=layout, kind=kind)
    full = [[rng.integers(0, 2**16, (pg.blocks, pg.block_size, 1 if mla else h, pg.dim),
                          dtype=np.uint16) for _ in range(pg.kvn)] for _ in range(pg.layers)]
    th = 1 if mla else h
    prefill = []
    for r in range(ptp):
        h0, hc = _heads(h, ptp, r, mla)
        c = make_cache(dataclasses.replace(pg, heads=hc), rng, total_heads=th, tp=ptp, rank=r)
        for layer in range(pg.layers):
            for kv in range(pg.kvn):
                c.planes[layer][kv][...] = full[layer][kv][:, :, h0:h0 + hc]
        prefill.append(c)
    decode = [make_cache(dataclasses.replace(pg, blocks=11, heads=_heads(h, dtp, r, mla)[1]),
                         rng, total_heads=th, tp=dtp, rank=r) for r in range(dtp)]
    return full, prefill, decode, rng


@pytest.mark.parametrize(("ptp", "dtp", "h", "layout", "kind"), _tp_params(plan=True))
def test_heterogeneous_tp_equals_numpy_reshard(ptp: int, dtp: int, h: int, layout: str,
                                               kind: str) -> None:
    mla = kind == "mla"
    full, prefill, decode, rng = _build_tp(ptp, dtp, h, layout, kind)
    n = 6
    rids = rng.permutation(prefill[0].geo.blocks)[:n]
    lids = rng.permutation(decode[0].geo.blocks)[:n]
    prefill_before = [c.snapshot() for c in prefill]
    for d, cache in enumerate(decode):
        h0, hc = _heads(h, dtp, d, mla)
        expected = cache.snapshot()
        _, planes = carve(expected, cache.geo)
        for layer in range(cache.geo.layers):
            for kv in range(cache.geo.kvn):  # numpy re-shard of the full reference
                planes[layer][kv][lids] = full[layer][kv][rids][:, :, h0:h0 + hc]
        reads = map_heads(dtp, d, ptp, h, mla=mla)
        assert sum(r.count for r in reads) == hc
        for read in reads:
            src = prefill[read.remote_rank]
            made: list[np.ndarray] = []
            plan = plan_transfer(cache.spec, src.spec, lids, rids, read, _garbage_alloc(made))
            assert plan.local is made[0] and plan.remote is made[1]
            apply(plan, cache, src)
        assert_same(cache.bufs, expected)
    for c, before in zip(prefill, prefill_before):
        assert_same(c.bufs, before)


@pytest.mark.parametrize(("ptp", "dtp", "h", "layout", "kind"), _tp_params(plan=False))
def test_heterogeneous_tp_passes_handshake_check(ptp: int, dtp: int, h: int, layout: str,
                                                 kind: str) -> None:
    _, prefill, decode, _ = _build_tp(ptp, dtp, h, layout, kind)
    for d in decode:
        for p in prefill:
            check_compatible(d.spec.geometry(), p.spec.geometry(), dtp, ptp)


def test_partial_heads_nhd_pieces_per_token() -> None:
    """TP2 -> TP1, NHD: each remote rank contributes one piece per token (heads interleave)."""
    _, prefill, decode, _ = _build_tp(2, 1, 4, "NHD", "split")
    (read0, read1) = map_heads(1, 0, 2, 4)
    assert (read0.remote_rank, read0.local_start, read1.remote_rank, read1.local_start) == \
        (0, 0, 1, 2)
    plan = plan_transfer(decode[0].spec, prefill[1].spec, [3, 4], [5, 6], read1)
    bs, hb = 4, 3 * 2
    assert plan.raw_descriptors == 2 * 2 * 2 * bs
    assert np.all(plan.local["len"] == 2 * hb)  # nothing merges: local tokens are 4 heads apart
    # HND: one piece per page instead
    _, prefill, decode, _ = _build_tp(2, 1, 4, "HND", "split")
    plan = plan_transfer(decode[0].spec, prefill[1].spec, [3, 4], [5, 6], read1)
    assert plan.raw_descriptors == 2 * 2 * 2 and np.all(plan.local["len"] == 2 * bs * hb)


# ----------------------------------------------------------------------------- errors
def _pair() -> tuple[Cache, Cache]:
    g = Geo(layers=2, blocks=6, block_size=2, heads=2, dim=2, layout="NHD", kind="split")
    rng = np.random.default_rng(7)
    return make_cache(g, rng), make_cache(g.with_blocks(5), rng)


def test_mismatched_id_lengths() -> None:
    local, remote = _pair()
    with pytest.raises(BlockIdOutOfRange, match="3 local block ids but 2 remote block ids"):
        plan_transfer(local.spec, remote.spec, [0, 1, 2], [0, 1])


@pytest.mark.parametrize(("lids", "rids", "msg"), [
    ([0, 6], [0, 1], r"local block id 6 \(position 1\) is out of range \[0, 6\)"),
    ([0, 1], [5, 0], r"remote block id 5 \(position 0\) is out of range \[0, 5\)"),
    ([-1, 1], [0, 1], r"local block id -1"),
    ([0, 1], [0, -3], r"remote block id -3"),
])
def test_out_of_range_ids(lids: list[int], rids: list[int], msg: str) -> None:
    local, remote = _pair()
    with pytest.raises(BlockIdOutOfRange, match=msg):
        plan_transfer(local.spec, remote.spec, lids, rids)


def test_empty_request_plans_nothing() -> None:
    local, remote = _pair()
    plan = plan_transfer(local.spec, remote.spec, [], [])
    assert plan.descriptors == 0 and plan.nbytes == 0 and plan.raw_descriptors == 0


def test_incompatible_specs_rejected() -> None:
    local, _ = _pair()
    rng = np.random.default_rng(3)
    other_heads = make_cache(Geo(2, 6, 2, 4, 2, "NHD", "split"), rng)
    with pytest.raises(IncompatibleSpecError, match="page sizes differ"):
        plan_transfer(local.spec, other_heads.spec, [0], [0])
    other_layers = make_cache(Geo(3, 6, 2, 2, 2, "NHD", "split"), rng)
    with pytest.raises(IncompatibleSpecError, match="local 2x2 vs remote 3x2"):
        plan_transfer(local.spec, other_layers.spec, [0], [0])
    with pytest.raises(IncompatibleSpecError, match="exceeds"):
        plan_transfer(local.spec, other_heads.spec, [0], [0], HeadRead(0, 1, 3, 2))
