"""What every child process of the demo, ``serve``, ``pull`` and ``bench`` does first.

* It dies with its parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux, so a parent killed
  by any signal (SIGKILL included) takes its ranks with it and their ports are free at once.
* It logs at the parent's level, in the parent's format (the level is passed, not inherited:
  children are spawned, not forked).
* A start-up failure is reported to the parent over its queue as
  ``("failed", rank, "ExcType: message")`` before the child exits, so the parent can end at
  once and say why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from kvlink.errors import KVLinkError

LOG_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("kvlink.demo")


def setup_logging(level: int) -> None:
    """The one logging set-up of the CLI and its children (stderr, :data:`LOG_FORMAT`)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)


def die_with_parent(parent_pid: int | None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; exit now if the parent is
    already gone (it died between fork and here). False where the platform cannot do it."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
    return armed


def describe(exc: BaseException) -> str:
    """One line for an exception: ``Type: message``."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def exit_reason(code: int | None) -> str:
    """``exited with code 1`` / ``killed by SIGKILL`` for a process's exit code."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class StopFlag:
    """The parent's "stop now" to its ranks, which no rank's death can wedge.

    ``multiprocessing.Event`` guards its flag with a lock every process shares: a rank
    SIGKILLed inside ``is_set()`` (ranks look every few ms) leaves it held, and the parent's
    ``set()`` then blocks for ever — ``kvlink serve`` hung instead of exiting 1 when a rank
    was killed. This is one shared byte that only the parent writes and the ranks read without
    a lock. Pass it to a child in its ``Process`` arguments (shared memory travels only there).
    """

    def __init__(self, ctx: Any) -> None:
        self._flag = ctx.RawValue(ctypes.c_bool, False)

    def set(self) -> None:
        self._flag.value = True

    def is_set(self) -> bool:
        return bool(self._flag.value)


class RankEvents:
    """What a parent's ranks tell it, on one queue per rank (``of(rank)``: the one to pass it).

    A rank SIGKILLed while its queue's feeder thread writes leaves that queue's write lock
    held for ever. With one queue for every rank, the other ranks' events stopped there too,
    and a rank that had put its last report then blocked at exit flushing it — ``kvlink
    serve`` waited for that rank until its deadline (minutes). Now only the dead rank's own
    queue wedges, and it has nothing more to say. :meth:`get` looks at each queue in turn,
    every ``_GRAIN`` s while none has anything (the parent only waits and shows progress)."""

    _GRAIN = 0.005

    def __init__(self, ctx: Any, ranks: int) -> None:
        self._queues = [ctx.Queue() for _ in range(ranks)]

    def of(self, rank: int) -> Any:
        return self._queues[rank]

    def get(self, timeout: float = 0.0) -> Any:
        """The next event of any rank, waiting up to ``timeout`` s for one; raises
        ``queue.Empty`` where none came."""
        deadline = time.monotonic() + timeout
        while True:
            for q in self._queues:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            time.sleep(min(left, self._GRAIN))


def child_main(target: Callable[..., None], level: int, parent_pid: int, report: Any,
               rank: int, *args: Any) -> None:
    """Entry point of a spawned child: the set-up above, then ``target(*args)``."""
    die_with_parent(parent_pid)
    setup_logging(level)
    try:
        target(*args)
    except Exception as exc:
        with contextlib.suppress(Exception):
            report.put(("failed", rank, describe(exc)))
        if isinstance(exc, (KVLinkError, OSError, MemoryError)):  # expected: a busy port, a
            log.debug("failed", exc_info=True)  # bad peer, no memory: the parent says it
            sys.exit(1)
        log.exception("failed")  # a bug: its traceback
        sys.exit(1)
