"""Setup-time exchanges over a CPU (gloo) process group.

Only construction and CUDA-graph registration use these; the all-reduce hot path never talks to
torch.distributed. Keeping them here gives every backend the same view of "rank" and "world"
(group-local, not global) and one place that knows how to address a subgroup's rank 0.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kvlink.errors import AllReduceError


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Group-local rank and size; raises if torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise AllReduceError("torch.distributed is not initialised; call init_process_group first")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if rank < 0:
        raise AllReduceError("this process is not a member of the given process group")
    return rank, world


def all_gather_obj(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (pickled over the CPU group: setup only)."""
    _, world = rank_and_world(group)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_obj(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``obj`` on every rank."""
    box = [obj]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(ok: bool, reason: str, group: dist.ProcessGroup | None) -> str | None:
    """Collective verdict: ``None`` if every rank is ``ok``, else the first failing rank's reason.

    A backend must be on or off on all ranks together (each half of the protocol waits for the
    other), so every local check goes through here before anything collective depends on it.
    """
    verdicts = all_gather_obj((ok, reason), group)
    for peer, (peer_ok, peer_reason) in enumerate(verdicts):
        if not peer_ok:
            return f"rank {peer}: {peer_reason}"
    return None
