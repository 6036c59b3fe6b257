"""Benchmark-only hook: give NIXL's progress thread a delay (bench/vllm_pd.py, NixlConnector runs).

vLLM's NixlConnector creates its NIXL agent with ``nixl_agent_config(num_threads=...,
capture_telemetry=True)``; NIXL's Python API then starts the agent's progress thread with
``pthrDelay = 0``, and that thread busy-spins a whole core (measured: 2.0 s CPU per 2 s idle, see
docs/nixl.md). On a many-core GPU server that is the intended trade; on this 2-core machine a
prefill and a decode server each spin one, so nothing else gets a core, and the decode only read
after the prefill's 30 s lease had expired and the prefill stopped stepping. NixlConnector has
no setting for the progress thread, so the benchmark sets the delay here, before vLLM creates
the agent: with ``KVLINK_BENCH_NIXL_PTHR_DELAY_US=N`` in the environment (and this directory on
``PYTHONPATH``), every NIXL agent the process creates gets ``pthrDelay = N`` µs. The thread
still progresses UCX, every N µs instead of continuously (kvlink's nixl transport does the same
with its own light thread, ``progress_interval`` 1 ms). Without the variable nothing is changed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_DELAY = os.environ.get("KVLINK_BENCH_NIXL_PTHR_DELAY_US")


def _install(delay_us: int) -> None:
    try:
        import importlib

        from nixl import _api
    except ImportError:
        return
    mod: Any = importlib.import_module(_api.nixl_agent.__module__)
    real = mod.nixlBind
    if getattr(real, "_kvlink_bench_delay", None) is not None:
        return

    class _Bind:
        _kvlink_bench_delay = delay_us

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def nixlAgent(self, name: str, cfg: Any) -> Any:  # NIXL's name
            cfg.pthrDelay = delay_us
            return real.nixlAgent(name, cfg)

    mod.nixlBind = _Bind()
    print(f"[kvlink bench] NIXL progress thread delay set to {delay_us} us (pid {os.getpid()})",
          file=sys.stderr, flush=True)


if _DELAY:
    _install(int(_DELAY))
