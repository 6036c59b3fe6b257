"""The parent's stop to its ranks, and its ranks' events, survive a rank killed at any moment.

``kvlink serve`` stopped its ranks through a ``multiprocessing.Event``, whose lock every
process shares: a rank SIGKILLed inside ``is_set()`` left the lock held and the parent's
``set()`` blocked for ever (``tests/test_hostile_messages.py::
test_serve_exits_nonzero_when_a_rank_dies`` hung now and then under load). Real processes,
real SIGKILLs: a child that does nothing but look at the flag is killed mid-look ten times.
Likewise the ranks' events (:class:`RankEvents`): a rank killed while it writes one wedged the
queue every rank shared, so the others' last reports never came.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from typing import Any

from test_lifecycle import until

from kvlink.demo.proc import RankEvents, StopFlag

_mp = mp.get_context("spawn")


def _look(stop: Any, looking: Any) -> None:
    looking.value = True
    while not stop.is_set():
        pass


def _set_returns(stop: Any, within: float) -> bool:
    """Whether ``stop.set()`` returns within ``within`` seconds (a daemon thread tries)."""
    t = threading.Thread(target=stop.set, daemon=True)
    t.start()
    t.join(within)
    return not t.is_alive()


def test_a_rank_killed_while_looking_at_the_stop_cannot_wedge_it() -> None:
    """Ten children, each killed while it looks at the flag in a loop (on the old Event most
    of the loop runs under its lock: the first kill or two wedged ``set()``); the flag still
    sets at once, and a child still running sees it."""
    stop = StopFlag(_mp)
    for _ in range(10):
        looking = _mp.RawValue(ctypes.c_bool, False)
        child = _mp.Process(target=_look, args=(stop, looking), daemon=True)
        child.start()
        # (spawned: the interpreter takes a moment to start)
        until(lambda lk=looking, c=child: lk.value or not c.is_alive(), 60,
              "the child looking at the flag")
        assert looking.value, child.exitcode
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    survivor = _mp.Process(target=_look, args=(stop, _mp.RawValue(ctypes.c_bool, False)),
                           daemon=True)
    survivor.start()
    try:
        returned = _set_returns(stop, 5.0)  # (not inside the assert: its repr would look)
        assert returned, "the stop's set() blocked after a child was killed"
        assert stop.is_set()
        survivor.join(60)
        assert survivor.exitcode == 0, "a child still running did not see the stop"
    finally:
        if survivor.is_alive():
            survivor.kill()


def _chatter(events: Any, rank: int) -> None:
    while True:  # (its queue's feeder thread writes nearly all the time)
        events.put(("phase", rank, "x" * 200))


def _report(events: Any, rank: int) -> None:
    events.put(("served", rank, {}))


def test_a_rank_killed_while_it_writes_an_event_leaves_the_others_heard() -> None:
    """Ten rounds: rank 0 is killed while it writes events in a loop, then rank 1 reports;
    its report comes (on the old shared queue seven rounds in ten never did: rank 0's feeder
    died holding the queue's write lock)."""
    for _ in range(10):
        events = RankEvents(_mp, 2)
        talker = _mp.Process(target=_chatter, args=(events.of(0), 0), daemon=True)
        talker.start()
        assert events.get(60)[1] == 0  # it runs
        os.kill(talker.pid, signal.SIGKILL)
        talker.join(10)
        reporter = _mp.Process(target=_report, args=(events.of(1), 1), daemon=True)
        reporter.start()
        try:
            deadline = time.monotonic() + 20
            got = None
            while got is None and time.monotonic() < deadline:
                try:
                    ev = events.get(1.0)
                except queue.Empty:
                    continue
                got = ev if ev[0] == "served" else None
            assert got == ("served", 1, {}), "rank 1's report never came"
            reporter.join(20)
            assert reporter.exitcode == 0, "rank 1 could not exit (its report stuck)"
        finally:
            if reporter.is_alive():
                reporter.kill()
