"""kvlink.grants: the windows a grant opens, against a byte-set reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lifecycle import make

from kvlink import native
from kvlink.grants import (
    FENCED,
    CGrants,
    Grants,
    block_extents,
    covers,
    merge,
    push_ticket,
    read_ticket,
)
from kvlink.transport import Op, make_extents

ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=12)


def _bytes(ext: np.ndarray) -> set[int]:
    return {b for a, n in zip(ext["addr"].tolist(), ext["len"].tolist()) for b in range(a, a + n)}


@settings(max_examples=200, deadline=None)
@given(ranges, ranges)
def test_merge_and_covers_match_byte_sets(window: list[tuple[int, int]],
                                          asked: list[tuple[int, int]]) -> None:
    w = merge(np.array([a for a, _ in window], dtype=np.uint64),
              np.array([n for _, n in window], dtype=np.uint64))
    assert _bytes(w) == {b for a, n in window for b in range(a, a + n)}
    assert np.all(w["addr"][1:] > w["addr"][:-1] + w["len"][:-1])  # sorted, apart
    ask = make_extents([a for a, _ in asked], [n for _, n in asked]) if asked else \
        make_extents([], [])
    want = all(set(range(a, a + n)) <= _bytes(w) for a, n in asked)
    assert covers(w, ask) == want


def test_an_extent_that_wraps_past_2_64_is_not_covered() -> None:
    window = make_extents([1 << 20], [1 << 20])
    wrap = np.zeros(1, dtype=window.dtype)
    wrap["addr"], wrap["len"] = (1 << 20) + 8, (1 << 64) - 16  # end wraps to below its start
    assert not covers(window, wrap)


def test_block_extents_are_exactly_the_blocks_pages() -> None:
    w, _ = make("p")
    try:
        spec = w._require_spec()
        ids = [3, 1, 2, 9]
        want: set[int] = set()
        for layer in range(spec.num_layers):
            for kv in range(spec.num_kv):
                for b in ids:
                    want |= _bytes(spec.page_extents(layer, b, kv))
        assert _bytes(block_extents(spec, ids)) == want
    finally:
        w.close()


@pytest.fixture(params=["c", "python"])
def grants(request: pytest.FixtureRequest) -> Grants:
    """Grants with kvlink's C gate (what tcp's C serving loop checks READs against) and
    with Python's, which must answer the same."""
    if request.param == "c":
        helpers = native.load()
        if helpers is None:
            pytest.skip(f"kvlink's C helpers did not build: {native.why_not()}")
        return CGrants(helpers)
    return Grants()


def test_tickets_and_windows(grants: Grants) -> None:
    g = grants
    t = read_ticket("r", 7)
    assert t != read_ticket("r", 8) != push_ticket("r", 7) and len(t) == 16
    g.grant(t, Op.READ, make_extents([100], [50]))
    assert g.check(t, Op.READ, make_extents([110], [10])) is None
    assert "READ" in (g.check(t, Op.WRITE, make_extents([110], [10])) or "")
    assert "outside" in (g.check(t, Op.READ, make_extents([140], [20])) or "")
    assert g.revoke(t) and not g.revoke(t)
    assert "no grant" in (g.check(t, Op.READ, make_extents([110], [10])) or "")
    assert len(g) == 0
    g.grant(t, Op.READ, make_extents([100], [50]))
    g.grant(t, Op.WRITE, make_extents([300], [50]))  # (a grant replaces the ticket's window)
    assert len(g) == 1 and "outside" in (g.check(t, Op.WRITE, make_extents([110], [10])) or "")
    assert g.check(t, Op.WRITE, make_extents([], [])) is None  # (nothing asked: granted)


@settings(max_examples=100, deadline=None)
@given(ranges, ranges, st.booleans())
def test_the_c_gate_answers_as_pythons(window: list[tuple[int, int]],
                                       asked: list[tuple[int, int]], write: bool) -> None:
    """The C gate (tcp's C serving loop checks READs there) refuses exactly what Python's
    Grants refuses, for the same reason."""
    helpers = native.load()
    if helpers is None:
        pytest.skip(f"kvlink's C helpers did not build: {native.why_not()}")
    ask = make_extents([a for a, _ in asked], [n for _, n in asked]) if asked else \
        make_extents([], [])
    answers = []
    for g in (CGrants(helpers), Grants()):
        if window:
            g.grant(b"t", Op.WRITE if write else Op.READ,
                    make_extents([a for a, _ in window], [n for _, n in window]))
        answers.append([g.check(t, op, ask) for t in (b"t", b"u") for op in (Op.READ, Op.WRITE)])
    assert answers[0] == answers[1]


def test_a_connection_serving_under_a_ticket_is_cut_by_its_revoke(grants: Grants) -> None:
    """enter marks a connection serving under its ticket in the step that checks it; a revoke
    then cuts it (its halt word set) and waits for it to leave; one that enters after the
    revoke is refused. A fenced connection enters nothing."""
    g, t = grants, read_ticket("r", 1)
    a, b = Grants.new_state(), Grants.new_state()
    g.grant(t, Op.READ, make_extents([0], [4096]))
    assert g.enter(a, t, Op.READ, make_extents([0], [512])) is None
    assert g.serving(a) == t and g.serving(b) is None and a[0] == 0
    assert g.revoke(t)
    assert g.cut(t, [b, a]) == [1] and a[0] == 1 and b[0] == 0
    assert not g.wait(t, [a], 0.05)  # still serving
    left = threading.Timer(0.05, g.leave, (a,))
    left.start()
    assert g.wait(t, [a], 10.0)  # woken by the leave, not by the timeout
    left.join()
    assert g.serving(a) is None
    assert "no grant" in (g.enter(b, t, Op.READ, make_extents([0], [512])) or "")
    assert g.serving(b) is None
    g.grant(t, Op.READ, make_extents([0], [4096]))
    g.fence(b)
    assert g.enter(b, t, Op.READ, make_extents([0], [512])) == FENCED and b[0] == 1
    assert g.enter(a, t, Op.READ, make_extents([0], [512]), check=False) is None
    assert g.enter(b, t, Op.READ, make_extents([0], [512]), check=False) == FENCED
    with pytest.raises(ValueError, match="ticket"):
        g.grant(b"x" * 65, Op.READ, make_extents([0], [1]))


def test_a_ticket_longer_than_any_grant_is_no_grant(grants: Grants) -> None:
    """A peer's request may name a ticket of any length; none past 64 bytes is ever granted
    (grant refuses one). Checked, it is refused as no grant; unchecked (no require_grants), it
    is served as no ticket; a revoke or cut of one finds nothing. bench/fuzz_tcp.py found
    the C gate raising instead (a 1000-byte ticket), which ended the connection as a bug."""
    g, state, long = grants, Grants.new_state(), b"t" * 1000
    assert "no grant" in (g.enter(state, long, Op.READ, make_extents([0], [1])) or "")
    assert g.serving(state) is None
    assert g.enter(state, long, Op.READ, make_extents([0], [1]), check=False) is None
    assert g.serving(state) == b""
    g.leave(state)
    assert not g.revoke(long) and g.cut(long, [state]) == [] and g.wait(long, [state], 0.0)
    with pytest.raises(ValueError, match="ticket"):
        g.grant(long, Op.READ, make_extents([0], [1]))
