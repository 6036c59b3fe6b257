"""kvlink.gpu.copy.BatchCopier's timed lane copies (``device_times``): which posts are timed,
what comes back, and that timing never fails or leaks a copy.

The copier needs a GPU to be built; here its state is set up by hand around stand-ins for the
driver's events, the C launcher and a lane: none of them can run without a GPU, and the faults
injected — a driver refusing timing events, a launcher refusing ids, a kernel refusing an
extent — cannot be produced on demand by the real ones. scripts/gpu_runs_check.py runs the real
ones and compares the copier's device times with CUDA events around the same copies. What is
under test is the copier's own bookkeeping.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
from typing import Any

import pytest

from kvlink.gpu import copy as gpucopy
from kvlink.gpu.lane import END_WORD


class _Buf:
    """A status buffer as kvlink.gpu.copy._Pinned offers it, in ordinary memory."""

    def __init__(self) -> None:
        self._mem = (ctypes.c_uint64 * (END_WORD + 1))()
        self.ptr = ctypes.addressof(self._mem)
        self.size = 4096
        self.status = ctypes.c_longlong.from_address(self.ptr)
        self.end = ctypes.c_int32.from_address(self.ptr + 8 * END_WORD)
        self.check = (ctypes.c_uint64 * 3).from_address(self.ptr + 8)


class _Events:
    """The driver's events: timing events are numbers; a pair's time is in once ``done``.
    A start is taken here and recorded by the launch (the lane's post); an end recorded
    here."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.taken: list[int] = []  # starts, handed to a launch
        self.recorded: list[int] = []  # ends
        self.recycled: list[int] = []
        self.done: dict[tuple[int, int], float] = {}  # (start, end) -> seconds
        self.refuse = False

    def take(self) -> int:
        return 99

    def take_timed(self) -> int:
        if self.refuse:
            return 0
        ev = next(self.ids)
        self.taken.append(ev)
        return ev

    def record_timed(self, stream: int) -> int:
        if self.refuse:
            return 0
        ev = next(self.ids)
        self.recorded.append(ev)
        return ev

    def elapsed(self, start: int, end: int) -> float | None:
        got = self.done.get((start, end))
        if got is not None:
            self.recycled += (start, end)
        return got

    def recycle_timed(self, *events: int) -> None:
        self.recycled += events

    def query(self, ev: int) -> bool:
        return True


class _Launcher:
    def __init__(self) -> None:
        self.posts = 0


class _Lane:
    """A lane as copy_lane uses it: its post writes nothing but counts (and records the
    timing start it is handed, as the C launcher does right before its kernel), or refuses
    ids, or (``refuse_start``: a driver refusing that record) launches untimed."""

    digest = None
    segments, unit = 160, 4096

    def __init__(self) -> None:
        self.refuse_next = False
        self.refuse_start = False
        self.started: list[int] = []

    def post(self, launcher: _Launcher, src: Any, dst: Any, status: int, seq: int,
             stream: int, after: Any, order: int, check: Any, signal: Any = None,
             start: int = 0) -> bool:
        if self.refuse_next:
            self.refuse_next = False
            raise TypeError("ids it does not take")
        launcher.posts += 1
        if start and not self.refuse_start:
            self.started.append(start)
            return True
        return False

    def posted(self, n: int) -> Any:
        return None


class _Stream:
    cuda_stream = 7


def _copier() -> tuple[Any, _Events, _Lane]:
    c: Any = object.__new__(gpucopy.BatchCopier)
    events = _Events()
    c._lock = threading.Lock()
    c._seq = itertools.count(1)
    c._pinned = collections.defaultdict(list)
    c._status_free = c._pinned[4096]
    c._take = lambda nbytes: _Buf()
    c._cuda = type("Cuda", (), {"launcher": _Launcher()})()
    c._lane_end = None  # (a lane's end words read through ctypes: no C helpers here)
    c._order_event = None
    c._events = events
    c._inflight = collections.deque()
    c._records, c._lent = collections.defaultdict(list), collections.OrderedDict()
    c._untimed = c._times = 0
    c.timed = collections.deque()
    c.seconds_by_kind = {k: collections.deque() for k in ("plain", "sample", "full")}
    return c, events, _Lane()


def _post(c: Any, lane: _Lane) -> Any:
    return c.copy_lane(lane, [1, 2, 3], [4, 5, 6], _Stream(), None)


def test_the_first_five_posts_are_timed_then_one_in_32() -> None:
    c, events, lane = _copier()
    timed = []
    for i in range(1, 200):
        before = len(c.timed)
        _post(c, lane)
        if len(c.timed) > before:
            timed.append(i)
    assert timed == [1, 2, 3, 4, 5, 37, 69, 101, 133, 165, 197]  # the median of five at once
    # a start a timed post, recorded by its launch (after the order, before the kernel), and
    # an end after the copy's end mark
    assert lane.started == events.taken and len(events.taken) == len(timed)
    assert len(events.recorded) == len(timed)


def test_device_times_come_in_once_the_events_are_and_leave_failed_copies_out() -> None:
    c, events, lane = _copier()
    first, third = _post(c, lane), (_post(c, lane), _post(c, lane))[1]  # (all timed)
    c.timed.remove(c.timed[1])  # (the second's: not looked at here)
    assert [t[0] for t in c.timed] == [first, third]
    assert c.device_times() == []  # neither pair is in yet
    (p1, s1, e1, n1), (p3, s3, e3, _) = c.timed
    assert n1 == 3 * 160 * 4096
    events.done[(s1, e1)] = 100e-6
    p1.buf.end.value = p1.seq  # its stream marked its end
    assert c.device_times() == [(n1, 100e-6)]
    events.done[(s3, e3)] = 50e-6
    p3.buf.status.value = p3.seq  # the kernel refused an extent: it ended at once
    p3.buf.end.value = p3.seq
    assert c.device_times() == []  # not a copy's time
    assert not c.timed and {s1, e1, s3, e3} <= set(events.recycled)


def test_device_times_are_kept_by_the_kind_of_lane_copy() -> None:
    """A bench splits a request's time into the kernel's and the host's by these: a plain
    lane's copy, a digest lane's that checks `sample`'s blocks, one that checks them all."""
    c, events, lane = _copier()
    digest_lane = _Lane()
    digest_lane.digest = object()  # type: ignore[assignment]
    posts = [(lane, False, 100e-6), (digest_lane, True, 102e-6), (digest_lane, False, 110e-6)]
    for which, sample, _ in posts:  # (the first five posts are all timed)
        c.copy_lane(which, [1, 2, 3], [4, 5, 6], _Stream(), None, generation=9, sample=sample)
    for (p, start, end, _), (_, _, seconds) in zip(c.timed, posts):
        events.done[(start, end)] = seconds
        p.buf.end.value = p.seq
        p.buf.check[:] = [gpucopy.NO_MISMATCH, 1, 0]  # (what a digest lane's kernel reports)
    assert len(c.device_times()) == 3
    assert {k: list(v) for k, v in c.seconds_by_kind.items()} == {
        "plain": [100e-6], "sample": [102e-6], "full": [110e-6]}


def test_a_driver_that_refuses_timing_events_is_asked_once_in_32_posts() -> None:
    c, events, lane = _copier()
    events.refuse = True
    asked = []
    real = events.take_timed

    def counting() -> int:
        asked.append(1)
        return real()

    events.take_timed = counting  # type: ignore[method-assign]
    for _ in range(100):
        assert not _post(c, lane).failed()  # no copy fails for its timing
    assert len(asked) == 4  # posts 1, 33, 65, 97
    assert not c.timed


def test_a_refused_post_hands_its_start_event_back() -> None:
    c, events, lane = _copier()
    lane.refuse_next = True
    with pytest.raises(TypeError):
        _post(c, lane)  # the first post is timed: its start was taken
    assert events.taken == events.recycled == [1] and not lane.started
    _post(c, lane)
    assert len(c.timed) == 1  # timed, the next one


def test_a_start_the_launch_did_not_record_leaves_the_copy_untimed() -> None:
    """The driver refusing the start's record at the launch: the copy is posted (not failed
    for its timing), goes untimed, the start goes back, and the driver is asked again no
    sooner than a timed post would be."""
    c, events, lane = _copier()
    lane.refuse_start = True
    p = _post(c, lane)
    assert not p.failed() and not c.timed and events.recycled == [1]
    assert not events.recorded  # (no end for it)
    lane.refuse_start = False
    for _ in range(31):
        _post(c, lane)
    assert not c.timed
    _post(c, lane)
    assert len(c.timed) == 1 and lane.started == [2]
