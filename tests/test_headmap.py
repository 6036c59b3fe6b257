"""Heterogeneous-TP head map against a brute-force reference, and handshake compatibility."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvlink.compat import check_compatible, compat_hash
from kvlink.errors import IncompatibleSpecError
from kvlink.headmap import head_owners, map_heads, rank_heads


def valid(h: int, tp: int) -> bool:
    return h % tp == 0 or tp % h == 0


@st.composite
def tp_combo(draw: st.DrawFn) -> tuple[int, int, int]:
    """(local tp, remote tp, total kv heads), all valid."""
    h = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
    tps = [t for t in range(1, 65) if valid(h, t)]
    return draw(st.sampled_from(tps)), draw(st.sampled_from(tps)), h


def held(h: int, tp: int) -> dict[int, set[int]]:
    """Reference: global head -> ranks holding it (contiguous slices, or replicas)."""
    out: dict[int, set[int]] = defaultdict(set)
    for r in range(tp):
        if h >= tp:
            for g in range(r * h // tp, (r + 1) * h // tp):
                out[g].add(r)
        else:
            out[r * h // tp].add(r)
    return out


@settings(max_examples=300, deadline=None)
@given(tp_combo())
def test_rank_heads_and_owners_match_reference(combo: tuple[int, int, int]) -> None:
    _, tp, h = combo
    ref = held(h, tp)
    assert sorted(ref) == list(range(h))
    for r in range(tp):
        first, count = rank_heads(h, tp, r)
        assert count == max(1, h // tp)
        for g in range(first, first + count):
            assert r in ref[g]
    for g in range(h):
        assert set(head_owners(h, tp, g)) == ref[g]


@settings(max_examples=300, deadline=None)
@given(tp_combo())
def test_every_local_head_read_once_from_an_owner(combo: tuple[int, int, int]) -> None:
    ltp, rtp, h = combo
    for lr in range(ltp):
        first, count = rank_heads(h, ltp, lr)
        reads = map_heads(ltp, lr, rtp, h)
        seen: Counter[int] = Counter()
        for rd in reads:
            assert 0 <= rd.remote_rank < rtp and rd.count >= 1
            r_first, r_count = rank_heads(h, rtp, rd.remote_rank)
            assert rd.remote_start >= 0 and rd.remote_start + rd.count <= r_count
            assert rd.local_start >= 0 and rd.local_start + rd.count <= count
            for i in range(rd.count):
                g = first + rd.local_start + i
                assert r_first + rd.remote_start + i == g  # same global head on both sides
                seen[g] += 1
        assert seen == Counter(range(first, first + count))  # each local head exactly once
        for a, b in itertools.pairwise(reads):  # neighbours that could be one read are merged
            assert not (a.remote_rank == b.remote_rank
                        and a.remote_start + a.count == b.remote_start
                        and a.local_start + a.count == b.local_start)


@settings(max_examples=300, deadline=None)
@given(tp_combo())
def test_replicated_heads_spread_over_replicas(combo: tuple[int, int, int]) -> None:
    ltp, rtp, h = combo
    readers: dict[int, list[int]] = defaultdict(list)  # global head -> remote ranks read from
    for lr in range(ltp):
        first, _ = rank_heads(h, ltp, lr)
        for rd in map_heads(ltp, lr, rtp, h):
            for i in range(rd.count):
                readers[first + rd.local_start + i].append(rd.remote_rank)
    replicas = max(1, rtp // h)
    for g, ranks in readers.items():
        # local ranks sharing head g hit as many different replicas as there can be
        assert len(set(ranks)) == min(len(ranks), replicas), (g, ranks)


@pytest.mark.parametrize(("ltp", "rtp", "h", "want"), [
    (2, 8, 2, [{0}, {5}]),  # 1 head per local rank, 4 replicas each: rotated by local rank
    (8, 8, 2, [{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}]),  # 4 readers hit 4 distinct replicas
    (8, 4, 2, [{0}, {1}, {0}, {1}, {2}, {3}, {2}, {3}]),  # 4 readers over 2 replicas
    (1, 2, 4, [{0, 1}]),  # one local rank reads from both remote ranks
])
def test_remote_ranks_examples(ltp: int, rtp: int, h: int, want: list[set[int]]) -> None:
    assert [{r.remote_rank for r in map_heads(ltp, lr, rtp, h)} for lr in range(ltp)] == want


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 16))
def test_mla_round_robin(ltp: int, rtp: int) -> None:
    hits: Counter[int] = Counter()
    for lr in range(ltp):
        reads = map_heads(ltp, lr, rtp, total_heads=1, mla=True)
        assert len(reads) == 1
        (rd,) = reads
        assert (rd.local_start, rd.remote_start, rd.count) == (0, 0, 1)
        assert 0 <= rd.remote_rank < rtp
        hits[rd.remote_rank] += 1
    # round-robin: every remote rank serves floor or ceil of ltp / rtp local ranks
    loads = [hits[r] for r in range(rtp)]
    assert max(loads) - min(loads) <= 1 and sum(loads) == ltp


@pytest.mark.parametrize(("ltp", "lr", "rtp"), [(0, 0, 2), (2, 2, 2), (2, -1, 2), (2, 0, 0)])
def test_mla_bad_tp(ltp: int, lr: int, rtp: int) -> None:
    with pytest.raises(IncompatibleSpecError, match="MLA"):
        map_heads(ltp, lr, rtp, 1, mla=True)


@st.composite
def invalid_combo(draw: st.DrawFn) -> tuple[int, int, int]:
    """(heads, a tp that cannot split them, a tp that can)."""
    h = draw(st.integers(2, 24))
    bad = [t for t in range(2, 49) if not valid(h, t)]
    assume(bad)
    good = [t for t in range(1, 49) if valid(h, t)]
    return h, draw(st.sampled_from(bad)), draw(st.sampled_from(good))


@settings(max_examples=200, deadline=None)
@given(invalid_combo(), st.booleans())
def test_invalid_tp_names_both_numbers(combo: tuple[int, int, int], bad_local: bool) -> None:
    h, bad_tp, good_tp = combo
    ltp, rtp = (bad_tp, good_tp) if bad_local else (good_tp, bad_tp)
    side = "local" if bad_local else "remote"
    with pytest.raises(IncompatibleSpecError) as ei:
        map_heads(ltp, 0, rtp, h)
    msg = str(ei.value)
    assert f"{h} kv heads" in msg and f"{side} tp={bad_tp}" in msg


def test_three_heads_over_tp_two() -> None:
    with pytest.raises(IncompatibleSpecError, match=r"3 kv heads cannot be split over local tp=2"):
        map_heads(2, 0, 1, 3)
    with pytest.raises(IncompatibleSpecError, match=r"tp rank 4 out of range for tp size 4"):
        rank_heads(8, 4, 4)
    with pytest.raises(IncompatibleSpecError, match="must be positive"):
        map_heads(0, 0, 1, 4)


# ----------------------------------------------------------------------------- check_compatible
BASE: dict[str, Any] = {
    "num_layers": 32, "block_size": 16, "head_dim": 128, "dtype": "bfloat16", "layout": "NHD",
    "mla": False, "total_kv_heads": 8,
}
OTHER: dict[str, Any] = {
    "num_layers": 40, "block_size": 32, "head_dim": 64, "dtype": "float16", "layout": "HND",
    "mla": True, "total_kv_heads": 4,
}


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(sorted(BASE)), min_size=1), st.booleans())
def test_check_compatible_names_both_values(keys: set[str], swap: bool) -> None:
    local = dict(BASE)
    remote = {k: (OTHER[k] if k in keys else v) for k, v in BASE.items()}
    if swap:
        local, remote = remote, local
    with pytest.raises(IncompatibleSpecError) as ei:
        check_compatible(local, remote, 2, 2)
    msg = str(ei.value)
    for k in BASE:
        part = f"{k}: local={local[k]!r} remote={remote[k]!r}"
        assert (part in msg) == (k in keys), (k, msg)
    assert compat_hash(local) != compat_hash(remote)


def test_check_compatible_missing_key_and_tp() -> None:
    remote = {k: v for k, v in BASE.items() if k != "head_dim"}
    with pytest.raises(IncompatibleSpecError, match=r"head_dim: local=128 remote=None"):
        check_compatible(BASE, remote, 1, 1)
    check_compatible(BASE, dict(BASE), 8, 2)  # equal geometry and valid tp: no error
    assert compat_hash(BASE) == compat_hash(dict(reversed(list(BASE.items()))))
    with pytest.raises(IncompatibleSpecError, match=r"8 kv heads cannot be split over remote tp=3"):
        check_compatible(BASE, dict(BASE), 2, 3)
    mla = {**BASE, "mla": True, "total_kv_heads": 1}
    check_compatible(mla, dict(mla), 3, 5)  # MLA: any tp pair


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
       st.booleans())
def test_every_holder_is_released_by_someone(ptp: int, dtp: int, heads: int, mla: bool) -> None:
    """Each prefill rank is told "done" by a fixed set of decode ranks that includes every rank
    that read from it — so replicas nobody read do not wait for their lease to expire."""
    from kvlink.headmap import notify_targets

    if (not mla and heads % ptp and ptp % heads) or (not mla and heads % dtp and dtp % heads):
        return
    for p in range(ptp):
        notifiers = {d for d in range(dtp) if p in notify_targets(dtp, d, ptp, heads, mla)}
        readers = {d for d in range(dtp)
                   if any(r.remote_rank == p for r in map_heads(dtp, d, ptp, heads, mla))}
        assert readers <= notifiers
        assert notifiers, f"prefill rank {p} of {ptp} is never released ({dtp=}, {heads=})"
