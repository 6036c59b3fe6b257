"""What both halves of the bench need: facts about the host (for the JSON and the PNG), the
versions ``kvlink doctor`` finds, and the benchmark buffer each side allocates."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from kvlink.demo.proc import exit_reason
from kvlink.errors import HandshakeError

MiB = 1 << 20


def machine() -> dict[str, Any]:
    """What the JSON and the PNG say about the host a figure was measured on."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f
                      if ln.startswith("model name")), "")
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "arch": platform.machine(), "cpus": os.cpu_count(), "cpu_model": model,
            "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}}


_VERSIONS_CODE = ("import json; from kvlink.doctor import versions; "
                  "print(json.dumps(versions()))")
_versions_proc: subprocess.Popen[str] | None = None
_versions_done: dict[str, Any] | None = None
_versions_lock = threading.Lock()


def start_versions() -> None:
    """Start finding the versions (``kvlink doctor``'s, ~1 s) in a child process.

    Not in this process: doctor reads the UCX version of NIXL's bundled libucp by loading it
    with ctypes, and a process that did that before it created a nixl transport segfaults at
    exit (seen here: exit code 139 after the JSON was written)."""
    global _versions_proc
    with _versions_lock:
        if _versions_proc is None and _versions_done is None:
            _versions_proc = subprocess.Popen([sys.executable, "-c", _VERSIONS_CODE],
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True)


def versions(timeout: float = 60.0) -> dict[str, Any]:
    """UCX/NIXL/Mooncake/torch versions as ``kvlink doctor`` finds them (once per process)."""
    global _versions_proc, _versions_done
    start_versions()
    with _versions_lock:
        if _versions_done is None:
            assert _versions_proc is not None
            proc, _versions_proc = _versions_proc, None
            try:
                out, _ = proc.communicate(timeout=timeout)
                _versions_done = json.loads(out) if proc.returncode == 0 else {
                    "error": f"kvlink doctor's versions: {exit_reason(proc.returncode)}"}
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                _versions_done = {"error": f"kvlink doctor's versions: none in {timeout:g}s"}
            except ValueError as exc:
                _versions_done = {"error": f"kvlink doctor's versions: {exc}"}
        return _versions_done


def buffer(total: int, memory: str, fill: int) -> tuple[Any, int, str]:
    """(owner, address, device) of a benchmark buffer in DRAM or VRAM."""
    if memory == "vram":
        import torch

        if not torch.cuda.is_available():
            raise HandshakeError("--memory vram: this host has no CUDA device")
        t = torch.full((total,), fill, dtype=torch.uint8, device="cuda:0")
        return t, int(t.data_ptr()), "cuda:0"
    a = np.full(total, fill, dtype=np.uint8)
    return a, int(a.__array_interface__["data"][0]), "cpu"


def human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
