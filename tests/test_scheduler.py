"""Block leases: every held request is released exactly once."""

from __future__ import annotations

import pytest

from kvlink.leases import BlockLeases, Grant, Refused


class Clock:
    """A settable clock, so lease expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_released_on_last_reader_only() -> None:
    leases = BlockLeases(10.0, Clock())
    leases.hold("r", [1, 2, 3])
    assert leases.reader_done("r", "d/0", expected=2) is None
    assert leases.reader_done("r", "d/0", expected=2) is None  # duplicate: ignored
    assert leases.reader_done("r", "d/1", expected=2) == [1, 2, 3]
    assert leases.reader_done("r", "d/1", expected=2) is None  # late: request already gone
    assert leases.stats.held == 0 and leases.stats.held_blocks == 0
    assert leases.stats.duplicate_notifications == 1
    assert leases.stats.unknown_notifications == 1


def test_lease_expiry_frees_once() -> None:
    clock = Clock()
    leases = BlockLeases(5.0, clock)
    leases.hold("a", [7])
    leases.hold("b", [8, 9])
    clock.now = 4.9
    assert leases.expire() == []
    clock.now = 5.0
    assert sorted(leases.expire()) == [("a", [7]), ("b", [8, 9])]
    assert leases.expire() == []
    assert leases.reader_done("a", "d/0") is None  # a reader arriving after expiry frees nothing
    assert leases.stats.released_expired == 2 and leases.stats.held_blocks == 0


def test_renewal_extends_to_a_full_lease_from_now_up_to_the_limit() -> None:
    """A waiting reader's renewals keep a hold past lease_seconds, never shorten it, never
    change its generation, and stop at renew_limit after the hold (a reader that never comes
    cannot pin the blocks for good); a read intent still adds read_seconds after a renewal."""
    clock = Clock()
    leases = BlockLeases(5.0, clock, read_seconds=2.0, renew_limit=12.0)
    gen = leases.hold("a", [7])
    leases.hold("b", [8])
    assert leases.renew("gone") is None
    clock.now = 4.0
    assert leases.renew("a") == 5.0  # a full lease from now: deadline 9
    clock.now = 3.0  # (a renewal never shortens: deadline stays 9)
    assert leases.renew("a") == 6.0
    clock.now = 5.0
    assert leases.expire() == [("b", [8])]
    clock.now = 8.0
    assert leases.renew("a") == 4.0  # capped: hold at 0 + renew_limit 12
    assert leases.begin_read("a", "d/0") == Grant(gen, 4.0)  # still inside the cap
    clock.now = 11.9
    assert leases.expire() == [] and leases.renew("a") == pytest.approx(0.1)
    clock.now = 12.0
    assert leases.expire() == [("a", [7])] and leases.renew("a") is None
    assert leases.stats.renewed == 4


def test_abort_and_unknown() -> None:
    leases = BlockLeases(5.0, Clock())
    leases.hold("a", [1])
    assert leases.abort("a") == [1]
    assert leases.abort("a") is None
    assert leases.reader_done("zzz", "d/0") is None
    assert leases.stats.released_aborted == 1 and leases.stats.unknown_notifications == 1


def test_a_report_sent_again_gets_the_same_answer() -> None:
    """A reader's report whose answer was lost (its session connection broke as the producer
    released the request and closed) is sent again: "intact" again, not "released under the
    READ" — which failed a verified request in the demo's 8 -> 2 TP run under load."""
    leases = BlockLeases(60)
    gen = leases.hold("r", [1, 2], readers=1)
    assert isinstance(leases.validate_read("r", "d/0", gen, [1, 2]), Grant)
    assert [r.why for r in leases.drain_released()] == ["read"]
    assert isinstance(leases.validate_read("r", "d/0", gen, [1, 2]), Grant)  # again
    assert leases.finish_read("r", "d/0", gen, True)  # an intent-path report again, too
    assert isinstance(leases.validate_read("r", "d/1", gen, [1, 2]), Refused)  # not d/1
    assert not leases.finish_read("r", "d/0", gen + 1, True)  # nor another generation
    assert leases.stats.duplicate_notifications == 2
