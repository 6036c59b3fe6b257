"""Test helpers for the processes a test starts: a process group of its own (ended with
everything it started), a hung peer (SIGSTOP), and namespaces of their own (``unshare``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
from test_transport_contract import wait_until

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
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: state(pid) in ("T", "t"), timeout), (
        f"pid {pid} did not stop within {timeout}s")


def state(pid: int) -> str:
    """A process's state as the kernel shows it (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def unshare_or_skip(flag: str, *tools: str) -> None:
    """Skip, saying why, where ``unshare <flag>`` (a namespace of its own: ``--net``,
    ``--pid``) or one of ``tools`` cannot run here (no root, no such tool, a container that
    refuses it). CI's machine runs them (root)."""
    missing = [t for t in ("unshare", *tools) if not shutil.which(t)]
    why = ""
    if missing:
        why = f"needs {', '.join(missing)} for a namespace of its own"
    else:
        args = ["unshare", flag, *(["--fork"] if flag == "--pid" else []), "true"]
        probe = subprocess.run(args, capture_output=True, text=True, timeout=30)
        if probe.returncode:
            why = f"unshare {flag} refused here: {probe.stderr.strip()}"
    if why:
        print(f"SKIP {why}")
        pytest.skip(why)
