"""kvlink.grants: the windows a grant opens, against a byte-set reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lifecycle import make

from kvlink.grants import Grants, block_extents, covers, merge, push_ticket, read_ticket
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


def test_tickets_and_windows() -> None:
    g = Grants()
    t = read_ticket("r", 7)
    assert t != read_ticket("r", 8) != push_ticket("r", 7) and len(t) == 16
    g.grant(t, Op.READ, make_extents([100], [50]))
    assert g.check(t, Op.READ, make_extents([110], [10])) is None
    assert "READ" in (g.check(t, Op.WRITE, make_extents([110], [10])) or "")
    assert "outside" in (g.check(t, Op.READ, make_extents([140], [20])) or "")
    assert g.revoke(t) and not g.revoke(t)
    assert "no grant" in (g.check(t, Op.READ, make_extents([110], [10])) or "")
