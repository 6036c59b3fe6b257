"""Test helper: end a child started in its own process group, and everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


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
