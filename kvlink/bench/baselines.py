"""The baselines measured beside every point, in the same run: memcpy (or a device copy) of the
point's own extents, the client's half of ``ucx_perftest``, and whether ``ib_write_bw`` could run
here (detected, never faked: the JSON says why it did not)."""

from __future__ import annotations

import glob
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlink.bench.facts import MiB
from kvlink.demo.proc import describe

PERFTEST_TIMEOUT = 300.0  # seconds one ucx_perftest run may take
_TAKE = "numpy.take(src.reshape(-1, block), idx, axis=0, out=dst, mode='clip')"
MEMCPY_HOW = (f"{_TAKE}: the point's own extents gathered into a packed buffer, one pass; "
              "one process on the client host (local only)")
DEVICE_COPY_HOW = MEMCPY_HOW.replace(
    _TAKE, "torch.index_select(src.view(-1, block), 0, idx, out=dst) on cuda:0")


def timed(fn: Callable[[], object], warmup: int, reps: int,
          sync: Callable[[], None] = lambda: None) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def memcpy_seconds(total: int, size: int, idx: np.ndarray, warmup: int,
                   reps: int) -> list[float]:
    """Seconds per copy of the point's own extents (:data:`MEMCPY_HOW`)."""
    src = np.ones(total, dtype=np.uint8).reshape(-1, size)
    dst = np.zeros((len(idx), size), dtype=np.uint8)
    # mode="clip": unbuffered (mode="raise" copies through a temporary: a third slower)
    return timed(lambda: np.take(src, idx, axis=0, out=dst, mode="clip"), max(1, warmup),
                 reps)


def device_copy_seconds(total: int, size: int, idx: np.ndarray, warmup: int,
                        reps: int) -> list[float]:
    import torch

    src = torch.ones(total, dtype=torch.uint8, device="cuda:0").view(-1, size)
    ti = torch.from_numpy(idx.astype(np.int64)).to("cuda:0")
    dst = torch.empty((len(idx), size), dtype=torch.uint8, device="cuda:0")
    return timed(lambda: torch.index_select(src, 0, ti, out=dst), max(1, warmup), reps,
                 torch.cuda.synchronize)


def rdma_baseline() -> str:
    devs = glob.glob("/sys/class/infiniband/*")
    if not devs:
        return "not run: no RDMA device (/sys/class/infiniband is empty)"
    if not shutil.which("ib_write_bw"):
        return "not run: RDMA device present but perftest (ib_write_bw) is not installed"
    return ("not run automatically: run `ib_write_bw -d DEV -s SIZE` on the server host and "
            "`ib_write_bw -d DEV -s SIZE SERVER_IP` here")


def perftest_client(path: str, host: str, port: int, test: str, size: int,
                    iters: int) -> dict[str, Any]:
    """``ucx_perftest -t test`` from here to its server at host:port (which the bench server
    started); ``error`` says why there are no figures."""
    from kvlink_transports import _ucx

    warm = max(2, iters // 10)
    cmd = [path, host, "-p", str(port), "-t", test, "-s", str(size), "-n", str(iters),
           "-w", str(warm)]
    out: subprocess.CompletedProcess[str] | None = None
    why = ""
    deadline = time.monotonic() + 30
    while True:  # its server needs a moment to listen: retry while refused
        try:
            out = subprocess.run(cmd, env=_ucx.ucx_env(path), capture_output=True,
                                 text=True, timeout=PERFTEST_TIMEOUT)
        except (OSError, subprocess.SubprocessError) as exc:
            why = describe(exc)
            break
        if "Final:" in out.stdout:
            break
        why = out.stderr.strip()[-200:] or f"exit code {out.returncode}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)  # retry interval while its server is not listening yet
    res: dict[str, Any] = {"client_command": shlex.join(cmd)}
    if out is None or "Final:" not in out.stdout:
        return {**res, "error": f"ucx_perftest failed: {why}"}
    line = next(ln for ln in out.stdout.splitlines() if "Final:" in ln)
    # Final: iters lat50 lat_avg lat_overall bw_avg bw_overall(MiB/s) rate_avg rate_overall
    nums = [float(x) for x in line.split()[1:]]
    return {**res, "iterations": int(nums[0]), "warmup": warm,
            "latency_us_avg": nums[2], "gbps": nums[5] * MiB / 1e9,
            "msg_per_s": nums[7]}
