"""Shared by the GPU checks: one way to write a result JSON (the figures plus the machine, the
command and the UTC date that every result under bench/results/ carries), and a host timer."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any


def host_seconds(fn: Any, reps: int) -> float:
    """Median wall time of ``fn`` between two device synchronizes (the first call not counted):
    what a caller that waits for the result sees."""
    import torch

    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def write(out_dir: str, name: str, res: dict[str, Any]) -> str:
    """Write ``res`` to ``out_dir/name`` the way every benchmark result is written (command,
    machine, date: bench/_common.write_result), the machine with its GPU stack."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from _common import machine, write_result

    gpu: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        gpu["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        gpu["triton"] = triton.__version__
    except ImportError:
        pass
    path = os.path.join(out_dir, name)
    write_result(name.removesuffix(".json"), {**res, "machine": {**machine(), **gpu}}, path)
    return path
