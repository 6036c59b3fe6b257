"""Tensor-parallel all-reduce for the decode path (single node, latency-bound).

Public API::

    from kvlink.allreduce import AllReduce, AllReduceConfig
    ar = AllReduce(cpu_group, device_group)      # collective; logs one line with the backends
    y = ar.all_reduce(x)                         # custom -> symm_mem -> NCCL (CPU: shm -> gloo)
    with ar.capture(), torch.cuda.graph(g): ...  # registers captured inputs after capture

    from kvlink.allreduce import ShmAllReduce    # CPU shared-memory variant on its own
    from kvlink.allreduce import CustomAllReduce # GPU IPC + Triton variant on its own (lazy)

Nothing here imports Triton or touches CUDA at import time: the GPU modules load on first use, so
the package imports on CPU-only hosts and in CI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlink.allreduce.config import (
    DEFAULT_CPU_ONE_SHOT_MAX_BYTES,
    DEFAULT_GPU_ONE_SHOT_MAX_BYTES,
    AllReduceConfig,
    choose_mode,
    one_shot_limit,
)
from kvlink.allreduce.exceptions import PeerExitedError, PeerTimeoutError
from kvlink.errors import AllReduceError

if TYPE_CHECKING:
    from kvlink.allreduce.custom import CustomAllReduce
    from kvlink.allreduce.dispatch import AllReduce
    from kvlink.allreduce.shm import ShmAllReduce
    from kvlink.allreduce.symm import SymmMemAllReduce

__all__ = [
    "DEFAULT_CPU_ONE_SHOT_MAX_BYTES",
    "DEFAULT_GPU_ONE_SHOT_MAX_BYTES",
    "AllReduce",
    "AllReduceConfig",
    "AllReduceError",
    "CustomAllReduce",
    "PeerExitedError",
    "PeerTimeoutError",
    "ShmAllReduce",
    "SymmMemAllReduce",
    "choose_mode",
    "one_shot_limit",
]

_LAZY = {
    "AllReduce": "kvlink.allreduce.dispatch",
    "CustomAllReduce": "kvlink.allreduce.custom",
    "ShmAllReduce": "kvlink.allreduce.shm",
    "SymmMemAllReduce": "kvlink.allreduce.symm",
}


def __getattr__(name: str) -> Any:
    """Load backend classes on first access (keeps ``import kvlink.allreduce`` cheap)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlink.allreduce' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
