"""The parent's stop to its ranks survives a rank killed while it looks at it.

``kvlink serve`` stopped its ranks through a ``multiprocessing.Event``, whose lock every
process shares: a rank SIGKILLed inside ``is_set()`` left the lock held and the parent's
``set()`` blocked for ever (``tests/test_hostile_messages.py::
test_serve_exits_nonzero_when_a_rank_dies`` hung now and then under load). Real processes,
real SIGKILLs: a child that does nothing but look at the flag is killed mid-look ten times.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

from kvlink.demo.proc import StopFlag

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
        deadline = time.monotonic() + 60
        while not looking.value:  # (spawned: the interpreter takes a moment to start)
            assert child.is_alive() and time.monotonic() < deadline, child.exitcode
            time.sleep(0.001)
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
