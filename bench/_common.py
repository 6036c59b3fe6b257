"""Shared bits of the benchmarks: result files with command, machine and date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_SWEPT: list[Any] = []  # sweep()'s buffer, made at its first call


def sweep() -> None:
    """What a serving process runs between two requests, for benches that time a request's
    host steps cold (host_steps, worker_host): a pass over 32 MiB and a burst of Python
    objects, which evict the caches the steps' code and data were in."""
    if not _SWEPT:
        import numpy as np

        _SWEPT.append(np.ones(32 << 20, dtype=np.uint8))
    _SWEPT[0][::64] += 1
    _ = [str(i) for i in range(2000)]


def machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def write_result(name: str, payload: dict[str, Any], path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def change_interval(base: Any, other: Any, seed: int = 0, resamples: int = 2000
                    ) -> tuple[float, float]:
    """90 % bootstrap interval of (median(other) - median(base)) / median(base): both series
    resampled with replacement, vectorised."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(base), np.asarray(other)
    ma = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    lo, hi = np.percentile((mb - ma) / ma, [5, 95])
    return float(lo), float(hi)
