"""kvlink.gpu.ends.CopyEnds: when a transport's copies should end (what a poll waits on,
``poll_grace_us``). Pure arithmetic: the transport that feeds it (cuda_ipc) needs a GPU, and
its polls' waits run in the GPU benches; the worker's side is tests/test_lanes.py's."""

from __future__ import annotations

import pytest

from kvlink.gpu.ends import RATE_KEPT, TIMED_KEPT, CopyEnds

MIB = 1 << 20


def test_nothing_is_expected_before_a_copy_was_seen_to_end() -> None:
    ends = CopyEnds()
    assert ends.posted(1.0, 160 * MIB) == 0.0  # no rate yet: a poll does not wait
    ends.ended(160 * MIB, 0.0)  # (a copy seen in no time says nothing)
    assert ends.posted(1.0, 160 * MIB) == 0.0


def test_copies_on_one_stream_end_one_after_another_at_the_rate_seen() -> None:
    ends = CopyEnds()
    ends.ended(100 * MIB, 0.001)  # 100 MiB in 1 ms
    first = ends.posted(10.0, 100 * MIB)
    assert first == pytest.approx(10.001)
    second = ends.posted(10.0002, 50 * MIB)  # posted while the first runs: after it
    assert second == pytest.approx(10.0015)
    later = ends.posted(20.0, 100 * MIB)  # the stream long idle: from its post
    assert later == pytest.approx(20.001)


def test_a_copy_seen_late_does_not_slow_the_estimate_but_many_do() -> None:
    """A copy seen long after it ended (its caller slept), or queued behind others, ran no
    slower than it shows: the best rate stands, less RATE_KEPT a copy, so a device that did
    get slower is followed within tens of copies."""
    ends = CopyEnds()
    ends.ended(100 * MIB, 0.001)
    best = ends.rate
    ends.ended(100 * MIB, 0.010)  # seen ten times later
    assert ends.rate == pytest.approx(best * RATE_KEPT)
    for _ in range(200):
        ends.ended(100 * MIB, 0.002)  # the device at half the speed, copy after copy
    assert ends.rate == pytest.approx(100 * MIB / 0.002)
    ends.ended(100 * MIB, 0.0005)  # and a faster one counts at once
    assert ends.rate == pytest.approx(100 * MIB / 0.0005)


def test_copies_timed_on_the_device_set_the_pace_and_sightings_no_longer_do() -> None:
    """Once copies are timed on the device, a copy the host saw end says nothing more: seen
    late (8 in flight, all seen after their posts) it would slow the estimate copy after
    copy, seen early (its kernel started before the enqueue's time was taken) speed it up.
    The estimate is the median of the last TIMED_KEPT device times: one timed while it
    waited for the caller's stream (its time includes the wait) does not move it alone."""
    ends = CopyEnds()
    ends.ended(100 * MIB, 0.0005)  # a host sighting first: counted while nothing is timed
    assert ends.rate == pytest.approx(100 * MIB / 0.0005)
    ends.timed(100 * MIB, 0.001)  # the device: 100 MiB in 1 ms
    assert ends.rate == pytest.approx(100 * MIB / 0.001)
    for _ in range(200):
        ends.ended(100 * MIB, 0.003)  # seen late, round after round
    ends.ended(100 * MIB, 0.0002)  # seen early
    assert ends.rate == pytest.approx(100 * MIB / 0.001)
    for _ in range(TIMED_KEPT - 2):
        ends.timed(100 * MIB, 0.001)
    ends.timed(100 * MIB, 0.004)  # timed while the copy waited for the caller's stream
    assert ends.rate == pytest.approx(100 * MIB / 0.001)
    for _ in range(TIMED_KEPT):
        ends.timed(100 * MIB, 0.002)  # the device did get slower (other work on it)
    assert ends.rate == pytest.approx(100 * MIB / 0.002)
    assert ends.posted(5.0, 100 * MIB) == pytest.approx(5.002)
