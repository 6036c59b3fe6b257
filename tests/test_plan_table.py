"""PlanTable's fast paths against two references, over many random geometries.

Specs are built from fake addresses (nothing is allocated), so a case costs microseconds and a
few thousand of them cover: HND / NHD, K/V split, joined and separate K and V tensors, MLA,
padded block strides, strides that differ per layer, overlapping planes, layers packed back to
back in one region (so request extents run across layer and plane seams) or scattered, every
heterogeneous-TP HeadRead that ``map_heads`` gives, and block id lists of shuffled runs,
reversed runs, duplicates, whole planes and nothing.

References: (1) a Python loop over (layer, plane, block, piece), written here from the
geometry, compared as the multiset of unit (local, remote) piece pairs: the same bytes go to the
same places; (2) the general path (``plan_general``: the whole grid, then coalesced, i.e. the
planner before PlanTable), compared record for record: the same extents in the same order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from kvlink import native
from kvlink.errors import BlockIdOutOfRange, IncompatibleSpecError
from kvlink.headmap import HeadRead, map_heads, rank_heads
from kvlink.layout import KVCacheSpec, Layout
from kvlink.plan import Plan, PlanPath, PlanTable, plan_transfer
from kvlink.transport import EXTENT_DTYPE, Region

KINDS = ("split", "joined", "pair", "padded", "mixed", "overlap")


@dataclasses.dataclass(frozen=True)
class Side:
    """What differs between the two sides of a random case."""

    blocks: int
    heads: int
    kind: str  # one of KINDS (ignored for MLA, which has one plane per layer)
    packed: bool  # layers back to back in one region, else scattered with random gaps


def fake_spec(rng: np.random.Generator, side: Side, *, layers: int, block_size: int, dim: int,
              itemsize: int, layout: Layout, mla: bool, total_heads: int, tp: int,
              rank: int) -> KVCacheSpec:
    """A spec at fake addresses: per layer one tensor laid out as ``side.kind`` says."""
    page = block_size * side.heads * dim * itemsize
    nb = side.blocks
    kvn = 1 if mla else 2
    base = np.zeros((layers, kvn), dtype=np.uint64)
    stride = np.zeros((layers, kvn), dtype=np.uint64)
    addr = 1 << 40
    spans = []
    for layer in range(layers):
        pad = 0
        if side.kind == "padded" or (side.kind == "mixed" and layer % 2):
            pad = int(rng.choice([itemsize, page, 3 * page]))
        if mla:
            s = page + pad
            base[layer] = [addr]
            size = nb * s
        elif side.kind in ("split", "padded", "mixed"):  # (2, blocks, page)
            s = page + pad
            base[layer] = [addr, addr + nb * s]
            size = 2 * nb * s
        elif side.kind == "joined":  # (blocks, 2, page)
            s = 2 * page + int(rng.choice([0, 0, itemsize, page]))
            base[layer] = [addr, addr + page]
            size = nb * s
        elif side.kind == "overlap":  # K and V one page apart, blocks one page apart
            s = page
            base[layer] = [addr, addr + page]
            size = (nb + 1) * page
        else:  # "pair": separate K and V tensors, V somewhere after K
            s = page + int(rng.choice([0, 0, page]))
            gap = int(rng.choice([0, 0, page, 12345 * itemsize]))
            base[layer] = [addr, addr + nb * s + gap]
            size = 2 * nb * s + gap
        stride[layer] = s
        spans.append((addr, size))
        addr += size + (0 if side.packed else int(rng.integers(0, 4)) * page
                        + int(rng.integers(0, 2)) * itemsize)
    return KVCacheSpec(
        num_layers=layers, num_blocks=nb, block_size=block_size, num_kv_heads=side.heads,
        head_dim=dim, dtype="raw", itemsize=itemsize, layout=layout, mla=mla,
        regions=tuple(Region(a, n, "cpu") for a, n in spans),
        plane_base=base, block_stride=stride,
        total_kv_heads=total_heads, tp_size=tp, tp_rank=rank,
    )


def random_ids(rng: np.random.Generator, nb: int, n: int, distinct: bool
               ) -> npt.NDArray[np.int64]:
    """n ids of [0, nb): shuffled runs of 1-8 (some reversed) when distinct, else with
    repeats; sometimes a whole plane in order or a random permutation."""
    if not distinct:
        return rng.integers(0, nb, n)
    mode = rng.integers(0, 4)
    if mode == 0:
        ids = list(range(nb))
    elif mode == 1:
        ids = rng.permutation(nb).tolist()
    else:
        runs: list[list[int]] = []
        at = 0
        while at < nb:
            k = int(rng.integers(1, 9))
            runs.append(list(range(at, min(at + k, nb))))
            at += k
        rng.shuffle(runs)
        ids = [i for r in runs for i in (r[::-1] if rng.random() < 0.2 else r)]
    skip = int(rng.integers(0, nb - n + 1))
    return np.array(ids[skip:skip + n], dtype=np.int64)


@dataclasses.dataclass
class Case:
    local: KVCacheSpec
    remote: KVCacheSpec
    read: HeadRead | None
    lids: npt.NDArray[np.int64]
    rids: npt.NDArray[np.int64]


def random_case(rng: np.random.Generator) -> Case:
    mla = rng.random() < 0.15
    layout = Layout.NHD if mla else Layout(rng.choice(["NHD", "HND"]))
    total = 1 if mla else int(rng.choice([1, 2, 4, 8]))
    tps = [t for t in (1, 2, 4, 8) if mla or total % t == 0 or t % total == 0]
    ltp, rtp = int(rng.choice(tps)), int(rng.choice(tps))
    lrank = int(rng.integers(0, ltp))
    reads = map_heads(ltp, lrank, rtp, total, mla=mla)
    read: HeadRead | None = reads[int(rng.integers(0, len(reads)))]
    assert read is not None
    rrank = read.remote_rank
    lheads = 1 if mla else rank_heads(total, ltp, lrank)[1]
    rheads = 1 if mla else rank_heads(total, rtp, rrank)[1]
    if rng.random() < 0.2:  # homogeneous: no head map at all
        read, rheads, rtp, rrank = None, lheads, ltp, lrank
    geo = {"layers": int(rng.integers(1, 6)), "block_size": int(rng.choice([1, 2, 4, 16])),
           "dim": int(rng.choice([1, 2, 8])), "itemsize": int(rng.choice([1, 2, 4])),
           "layout": layout, "mla": mla, "total_heads": total}

    def side(heads: int) -> Side:
        return Side(int(rng.integers(1, 7)), heads, str(rng.choice(KINDS)),
                    bool(rng.random() < 0.6))

    ls, rs = side(lheads), side(rheads)
    if rng.random() < 0.3:  # a whole plane on both sides, in order: seams can merge
        rs = dataclasses.replace(rs, blocks=ls.blocks)
        local = fake_spec(rng, ls, tp=ltp, rank=lrank, **geo)  # type: ignore[arg-type]
        remote = fake_spec(rng, rs, tp=rtp, rank=rrank, **geo)  # type: ignore[arg-type]
        ids = np.arange(ls.blocks)
        return Case(local, remote, read, ids, ids.copy())
    local = fake_spec(rng, ls, tp=ltp, rank=lrank, **geo)  # type: ignore[arg-type]
    remote = fake_spec(rng, rs, tp=rtp, rank=rrank, **geo)  # type: ignore[arg-type]
    distinct = rng.random() < 0.85
    n = int(rng.integers(0, min(ls.blocks, rs.blocks) + 1)) if distinct else int(
        rng.integers(0, 10))
    return Case(local, remote, read, random_ids(rng, ls.blocks, n, distinct),
                random_ids(rng, rs.blocks, n, distinct))


# ----------------------------------------------------------------------------- reference
def loop_pieces(c: Case) -> tuple[list[tuple[int, int]], int]:
    """Every (local address, remote address) piece, one Python iteration per (layer, plane,
    block, piece); and the piece length."""
    lo, re, read = c.local, c.remote, c.read
    hb, bs = lo.head_bytes, lo.block_size
    whole = lo.mla or read is None or (read.count == lo.num_kv_heads == re.num_kv_heads
                                       and read.local_start == read.remote_start == 0)
    if whole:
        offs, piece = [(0, 0)], lo.page_bytes
    else:
        assert read is not None
        layout = lo.layout if lo.num_kv_heads > 1 else re.layout
        if layout is Layout.HND:
            offs = [(read.local_start * bs * hb, read.remote_start * bs * hb)]
            piece = read.count * bs * hb
        else:
            offs = [((t * lo.num_kv_heads + read.local_start) * hb,
                     (t * re.num_kv_heads + read.remote_start) * hb) for t in range(bs)]
            piece = read.count * hb
    out: list[tuple[int, int]] = []
    for layer, kv in itertools.product(range(lo.num_layers), range(lo.num_kv)):
        lb, ls = int(lo.plane_base[layer, kv]), int(lo.block_stride[layer, kv])
        rb, rs = int(re.plane_base[layer, kv]), int(re.block_stride[layer, kv])
        for li, ri in zip(c.lids.tolist(), c.rids.tolist()):
            for lo_off, ro_off in offs:
                out.append((lb + li * ls + lo_off, rb + ri * rs + ro_off))
    return out, piece


def unit_pieces(plan: Plan, piece: int) -> list[tuple[int, int]]:
    """The plan's extents cut back into ``piece``-sized (local, remote) pairs."""
    assert np.array_equal(plan.local["len"], plan.remote["len"])
    out: list[tuple[int, int]] = []
    for la, ra, n in zip(plan.local["addr"].tolist(), plan.remote["addr"].tolist(),
                         plan.local["len"].tolist()):
        assert n > 0 and n % piece == 0, (n, piece)
        out.extend((la + k * piece, ra + k * piece) for k in range(n // piece))
    return out


def garbage_alloc(made: list[np.ndarray]) -> Callable[[int], np.ndarray]:
    """Like Transport.extents but the arrays start as garbage, so an unwritten record shows."""
    def alloc(n: int) -> np.ndarray:
        out = np.frombuffer(np.random.default_rng(n).bytes(16 * n), dtype=EXTENT_DTYPE).copy()
        made.append(out)
        return out
    return alloc


# ----------------------------------------------------------------------------- properties
@pytest.mark.parametrize("seed", range(12))
def test_random_geometries_move_the_same_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    paths: Counter[PlanPath] = Counter()
    seams = 0
    for _ in range(400):
        c = random_case(rng)
        table = PlanTable.build(c.local, c.remote, c.read)
        paths[table.path] += 1
        made: list[np.ndarray] = []
        plan = table.plan(c.lids, c.rids, garbage_alloc(made))
        if c.lids.size:
            assert plan.local is made[0] and plan.remote is made[1]
        want, piece = loop_pieces(c)
        assert sorted(unit_pieces(plan, piece)) == sorted(want)
        assert plan.raw_descriptors == len(want)
        general = table.plan_general(c.lids, c.rids)
        assert np.array_equal(plan.local, general.local), (table.path, c)
        assert np.array_equal(plan.remote, general.remote), (table.path, c)
        assert plan.raw_descriptors == general.raw_descriptors
        if table.path is not PlanPath.GENERAL and c.lids.size:
            seams += table._seams(c.lids, c.rids) is not None
    # every path, and the seam merge, was exercised (else the cases above prove little)
    assert min(paths[p] for p in PlanPath) >= 20, paths
    assert seams >= 5, seams


def test_the_c_planner_writes_the_numpy_paths_extents() -> None:
    """The RUNS path in one C call (kvlink.native's ``plan_runs``, what ``plan`` takes where
    it is built) writes the numpy path's extents record for record, seams merged as it
    merges them, and declines (None) ids out of range, which the numpy path then names."""
    helpers = native.load()
    assert helpers is not None, f"kvlink's C helpers did not build here: {native.why_not()}"
    rng = np.random.default_rng(11)
    planned = seams = 0
    for _ in range(1500):
        c = random_case(rng)
        table = PlanTable.build(c.local, c.remote, c.read)
        if table.path is not PlanPath.RUNS:
            continue
        want = table._plan_segments(c.lids, c.rids, None)
        got = table._plan_native(c.lids, c.rids, None)
        assert got is not None
        assert np.array_equal(got.local, want.local), c
        assert np.array_equal(got.remote, want.remote), c
        assert got.raw_descriptors == want.raw_descriptors
        planned += 1
        seams += bool(c.lids.size) and table._seams(c.lids, c.rids) is not None
    assert planned >= 100 and seams >= 5, (planned, seams)
    table = PlanTable.build(_fa(2, 1, 8, 1 << 40), _fa(2, 1, 5, 1 << 41))
    for lids, rids in (([0, 8], [0, 1]), ([0, 1], [-1, 1]), ([0, 1], [4, 5])):
        assert table._plan_native(np.array(lids), np.array(rids), None) is None
    with pytest.raises(BlockIdOutOfRange, match=r"remote block id 5 \(position 1\)"):
        table.plan(np.array([0, 1]), np.array([4, 5]))
    room = np.empty(1, EXTENT_DTYPE)  # fewer records than segments x ids: refused
    with pytest.raises(ValueError, match="segments x ids"):
        helpers.plan_runs(np.arange(2), np.arange(2), table.local_base, table.remote_base,
                          table.unit, 8, 5, room, room)


def test_runs_expand_to_the_plan() -> None:
    """What cuda_ipc's device computes from (segment bases, runs) is the plan, record for
    record; requests the form cannot hold (other paths, seams) get None."""
    rng = np.random.default_rng(7)
    got = 0
    for _ in range(600):
        c = random_case(rng)
        table = PlanTable.build(c.local, c.remote, c.read)
        runs = table.runs(c.lids, c.rids)
        if runs is None:
            assert (table.path is not PlanPath.RUNS or not c.lids.size
                    or table._seams(c.lids, c.rids) is not None)
            continue
        got += 1
        plan, flat = table.plan(c.lids, c.rids), runs.expand()
        assert np.array_equal(flat.local, plan.local) and np.array_equal(flat.remote, plan.remote)
        assert (runs.descriptors, runs.nbytes, runs.raw_descriptors) == (
            plan.descriptors, plan.nbytes, plan.raw_descriptors)
    assert got >= 50, got


def test_block_runs_move_the_pieces_of_the_plan() -> None:
    """``runs(coalesce=False)``: one extent per (segment, block), seams included; cut into
    unit pieces it moves exactly the pieces of the plan (and the longest run is one unit)."""
    rng = np.random.default_rng(11)
    got = 0
    for _ in range(600):
        c = random_case(rng)
        table = PlanTable.build(c.local, c.remote, c.read)
        runs = table.runs(c.lids, c.rids, coalesce=False)
        if runs is None:
            assert table.path is not PlanPath.RUNS or not c.lids.size
            continue
        got += 1
        plan, flat = table.plan(c.lids, c.rids), runs.expand()
        assert flat.local.shape[0] == table.segments * c.lids.size
        assert runs.longest_run == table.unit and runs.nbytes == plan.nbytes
        want, piece = loop_pieces(c)
        assert sorted(unit_pieces(flat, piece)) == sorted(want)
        assert runs.raw_descriptors == plan.raw_descriptors
    assert got >= 50, got


def test_plan_transfer_is_the_table() -> None:
    rng = np.random.default_rng(99)
    for _ in range(200):
        c = random_case(rng)
        a = plan_transfer(c.local, c.remote, c.lids, c.rids, c.read)
        b = PlanTable.build(c.local, c.remote, c.read).plan(c.lids, c.rids)
        assert np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)


# ----------------------------------------------------------------------------- named cases
def _fa(layers: int, heads: int, nb: int, base: int, *, packed: bool = True,
        layout: Layout = Layout.NHD) -> KVCacheSpec:
    """vLLM FlashAttention: per layer (2, blocks, 16, heads, 128) bf16."""
    return fake_spec(np.random.default_rng(0), Side(nb, heads, "split", packed), layers=layers,
                     block_size=16, dim=128, itemsize=2, layout=layout, mla=False,
                     total_heads=heads, tp=1, rank=0)


def test_flash_attention_runs_one_extent_per_plane_and_run() -> None:
    local, remote = _fa(4, 1, 64, 1 << 40), _fa(4, 1, 32, 1 << 41)
    table = PlanTable.build(local, remote)
    assert table.path is PlanPath.RUNS and table.segments == 8 and table.unit == local.page_bytes
    lids = np.array([10, 11, 12, 40, 41, 5, 7, 8])
    rids = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # runs: [10-12], [40-41], [5], [7-8]
    plan = table.plan(lids, rids)
    assert plan.descriptors == 8 * 4 and plan.raw_descriptors == 8 * 8
    assert plan.local["len"].tolist()[:4] == [3 * 4096, 2 * 4096, 4096, 2 * 4096]
    assert plan.nbytes == 8 * 8 * local.page_bytes


def test_whole_plane_request_merges_across_seams() -> None:
    """Layers packed in one region and a request of every block in order on both sides: the
    K plane of a layer ends where its V plane starts, and so on — one extent in all."""
    local, remote = _fa(3, 2, 6, 1 << 40), _fa(3, 2, 6, 1 << 41)
    plan = PlanTable.build(local, remote).plan(np.arange(6), np.arange(6))
    assert plan.descriptors == 1 and plan.raw_descriptors == 3 * 2 * 6
    assert int(plan.local["len"][0]) == 3 * 2 * 6 * local.page_bytes
    # scattered layers: a seam only inside a layer (K plane end -> V plane start)
    local = _fa(3, 2, 6, 1 << 40, packed=False)
    plan = PlanTable.build(local, remote).plan(np.arange(6), np.arange(6))
    assert plan.descriptors == plan_transfer(local, remote, np.arange(6),
                                             np.arange(6)).descriptors


def test_hnd_head_slices_take_the_blocks_path_and_nhd_the_general_one() -> None:
    for layout, path in ((Layout.HND, PlanPath.BLOCKS), (Layout.NHD, PlanPath.GENERAL)):
        local = _fa(2, 4, 16, 1 << 40, layout=layout)
        remote = _fa(2, 1, 16, 1 << 41, layout=layout)
        read = HeadRead(remote_rank=0, local_start=2, remote_start=0, count=1)
        table = PlanTable.build(local, remote, read)
        assert table.path is path
        plan = table.plan([1, 2, 3], [4, 5, 6])
        pieces = 1 if layout is Layout.HND else 16
        assert plan.raw_descriptors == 2 * 2 * 3 * pieces == plan.descriptors


def test_empty_request() -> None:
    table = PlanTable.build(_fa(2, 1, 8, 1 << 40), _fa(2, 1, 8, 1 << 41))
    plan = table.plan([], [])
    assert plan.descriptors == plan.raw_descriptors == plan.nbytes == 0
    assert plan.local.dtype == EXTENT_DTYPE


# ----------------------------------------------------------------------------- errors
def test_build_raises_what_plan_transfer_raised() -> None:
    a = _fa(2, 2, 8, 1 << 40)
    with pytest.raises(IncompatibleSpecError, match=r"layers x planes differ: local 2x2 vs "
                                                    r"remote 3x2"):
        PlanTable.build(a, _fa(3, 2, 8, 1 << 41))
    with pytest.raises(IncompatibleSpecError, match=r"page sizes differ: local 8192 B vs "
                                                    r"remote 16384 B"):
        PlanTable.build(a, _fa(2, 4, 8, 1 << 41))
    with pytest.raises(IncompatibleSpecError, match="exceeds local 2 / remote 4 heads"):
        PlanTable.build(a, _fa(2, 4, 8, 1 << 41), HeadRead(0, 1, 3, 2))
    with pytest.raises(IncompatibleSpecError, match="layouts differ: local NHD vs remote HND"):
        PlanTable.build(a, _fa(2, 4, 8, 1 << 41, layout=Layout.HND), HeadRead(0, 0, 0, 2))


def test_plan_checks_block_ids() -> None:
    table = PlanTable.build(_fa(2, 1, 8, 1 << 40), _fa(2, 1, 5, 1 << 41))
    with pytest.raises(BlockIdOutOfRange, match=r"local block id 8 \(position 1\)"):
        table.plan([0, 8], [0, 1])
    with pytest.raises(BlockIdOutOfRange, match=r"remote block id -1 \(position 0\)"):
        table.plan([0, 1], [-1, 1])
    with pytest.raises(BlockIdOutOfRange, match="2 local block ids but 1 remote block ids"):
        table.plan([0, 1], [0])
    with pytest.raises(BlockIdOutOfRange, match="must be integers"):
        table.plan([0.5], [1])
    with pytest.raises(BlockIdOutOfRange, match="must be 1-D"):
        table.plan([[0]], [[1]])
    big = np.array([np.iinfo(np.uint64).max], dtype=np.uint64)  # wraps negative as int64
    with pytest.raises(BlockIdOutOfRange, match="local block id"):
        table.plan(big, [0])


def test_for_peer_builds_once_per_pair_and_stays_bounded(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from kvlink import plan as plan_mod
    # not a fake: a cache of this test's own, and a small bound to reach it
    monkeypatch.setattr(plan_mod, "_CACHE", {})
    monkeypatch.setattr(plan_mod, "_CACHE_SIZE", 3)
    a, b = _fa(2, 2, 8, 1 << 40), _fa(2, 2, 8, 1 << 41)
    t = PlanTable.for_peer(a, b)
    assert PlanTable.for_peer(a, b) is t
    r0, r1 = HeadRead(0, 0, 0, 1), HeadRead(0, 1, 1, 1)
    assert PlanTable.for_peer(a, b, r0) is not t
    assert PlanTable.for_peer(a, b, r0) is PlanTable.for_peer(a, b, HeadRead(0, 0, 0, 1))
    assert PlanTable.for_peer(b, a) is not t  # direction matters
    PlanTable.for_peer(a, b, r1)  # a fourth pair: the least recently used (a, b, None) goes
    assert len(plan_mod._CACHE) == 3
    assert PlanTable.for_peer(a, b) is not t
    bad = _fa(3, 2, 8, 1 << 42)
    for _ in range(2):  # an incompatible pair raises every time and is never kept
        with pytest.raises(IncompatibleSpecError, match="layers x planes differ"):
            plan_transfer(a, bad, [0], [0])
    assert all(bad is not tb.remote for tb in plan_mod._CACHE.values())
