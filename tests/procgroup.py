"""Test helper: start a child in a process group of its own, and end it with everything it
started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

#: ``Popen`` keywords that put a child in a process group of its own inside our session, so
#: ``kill_group`` ends it and whatever it spawned. Not ``start_new_session``: a session of its
#: own is an autogroup of its own to Linux's scheduler, and on a shared CPU this VM's kernel
#: kept a whole autogroup off the CPU for seconds (bench/results/vllm_transports_cpu/autogroup/).
#: Python 3.10 has no ``process_group``: a session of its own there.
OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the group (the child and whatever it spawned), reap the child, close its pipes:
    a fixture's teardown, which must leave no process or port behind whatever the test did."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` (alive, its sockets open, nothing answered: a hung peer) and return once
    the kernel shows it stopped, or fail at ``timeout``."""
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while state(pid) not in ("T", "t"):
        assert time.monotonic() < deadline, f"pid {pid} did not stop within {timeout}s"
        time.sleep(1e-3)


def state(pid: int) -> str:
    """A process's state as the kernel shows it (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
