"""Heterogeneous tensor-parallel head mapping.

Each TP rank of an instance holds a slice of the KV heads: ``total // tp`` consecutive heads when
there are at least as many heads as ranks, otherwise one head replicated on ``tp // total`` ranks.
MLA ranks all hold the same latent. Given both sides' TP sizes, this module says which remote
ranks a local rank must contact and which heads it exchanges with each, so a worker handshakes
only with the ranks it reads and every head is read exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

from kvlink.errors import IncompatibleSpecError


@dataclasses.dataclass(frozen=True)
class HeadRead:
    """Heads ``[local_start, local_start+count)`` of the local rank exchange with
    ``[remote_start, remote_start+count)`` of ``remote_rank`` (both in rank-local head indices)."""

    remote_rank: int
    local_start: int
    remote_start: int
    count: int


def rank_heads(total_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first global head, head count) held by ``rank`` of a ``tp``-way instance."""
    check_tp(total_heads, tp, "tp")
    if not 0 <= rank < tp:
        raise IncompatibleSpecError(f"tp rank {rank} out of range for tp size {tp}")
    if total_heads >= tp:
        per = total_heads // tp
        return rank * per, per
    return rank // (tp // total_heads), 1


def head_owners(total_heads: int, tp: int, head: int) -> range:
    """Ranks holding global ``head`` (several when heads are replicated)."""
    if total_heads >= tp:
        return range(head // (total_heads // tp), head // (total_heads // tp) + 1)
    rep = tp // total_heads
    return range(head * rep, (head + 1) * rep)


def check_tp(total_heads: int, tp: int, what: str) -> None:
    if tp <= 0 or total_heads <= 0:
        raise IncompatibleSpecError(f"{what}={tp} and kv heads={total_heads} must be positive")
    if total_heads % tp and tp % total_heads:
        raise IncompatibleSpecError(
            f"{total_heads} kv heads cannot be split over {what}={tp}: one must divide the other"
        )


def notify_targets(local_tp: int, local_rank: int, remote_tp: int, total_heads: int,
                   mla: bool = False) -> frozenset[int]:
    """Remote ranks this local rank must tell "done" after pulling a request.

    Not only the ranks it read: a replica it did *not* read still holds the request's blocks and
    must learn that this reader no longer needs them, or they would sit there until the lease
    expires. Every remote rank gets told by every local rank whose heads it holds (MLA: by the
    local ranks mapped onto it round-robin), and the producer counts its readers the same way.
    """
    return _notify_targets(local_tp, local_rank, remote_tp, total_heads, mla)  # cached


# Both maps are asked per request (and per reader rank) with the few TP shapes a deployment
# has; their loops go head by head, so they are computed once per shape (errors not cached).
@functools.lru_cache(maxsize=4096)
def _notify_targets(local_tp: int, local_rank: int, remote_tp: int, total_heads: int,
                    mla: bool) -> frozenset[int]:
    if mla:
        if remote_tp >= local_tp:
            return frozenset(p for p in range(remote_tp) if p % local_tp == local_rank)
        return frozenset({local_rank % remote_tp})
    first, count = rank_heads(total_heads, local_tp, local_rank)
    return frozenset(p for h in range(first, first + count)
                     for p in head_owners(total_heads, remote_tp, h))


def push_targets(
    prefill_tp: int, prefill_rank: int, decode_tp: int, decode_rank: int, total_heads: int,
    mla: bool = False,
) -> list[HeadRead]:
    """What a prefill rank writes into one decode rank in push mode (prefill's point of view).

    It is the decode rank's read map turned around, so push and pull move the same bytes and a
    replicated decode head gets written on every replica.
    """
    return [
        HeadRead(decode_rank, r.remote_start, r.local_start, r.count)
        for r in map_heads(decode_tp, decode_rank, prefill_tp, total_heads, mla)
        if r.remote_rank == prefill_rank
    ]


def map_heads(
    local_tp: int, local_rank: int, remote_tp: int, total_heads: int, mla: bool = False
) -> list[HeadRead]:
    """Which remote ranks to contact, and which heads to exchange with each.

    Replicated heads are read from one replica; which replica rotates with the local rank, so
    several local ranks spread their reads over the remote ranks (and their NICs). For MLA
    every remote rank holds the full latent: local ranks are spread round-robin.
    """
    return list(_map_heads(local_tp, local_rank, remote_tp, total_heads, mla))


@functools.lru_cache(maxsize=4096)
def _map_heads(local_tp: int, local_rank: int, remote_tp: int, total_heads: int, mla: bool
               ) -> tuple[HeadRead, ...]:
    if mla:
        if local_tp <= 0 or remote_tp <= 0 or not 0 <= local_rank < local_tp:
            raise IncompatibleSpecError(
                f"bad MLA tp sizes: local {local_tp} (rank {local_rank}), remote {remote_tp}"
            )
        return (HeadRead(local_rank % remote_tp, 0, 0, 1),)
    check_tp(total_heads, local_tp, "local tp")
    check_tp(total_heads, remote_tp, "remote tp")
    first, count = rank_heads(total_heads, local_tp, local_rank)
    reads: list[HeadRead] = []
    for h in range(first, first + count):  # per head, not per block: at most total_heads steps
        owners = head_owners(total_heads, remote_tp, h)
        rank = owners[local_rank % len(owners)]
        r_first, _ = rank_heads(total_heads, remote_tp, rank)
        last = reads[-1] if reads else None
        if (last is not None and last.remote_rank == rank
                and last.remote_start + last.count == h - r_first):
            reads[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            reads.append(HeadRead(rank, h - first, h - r_first, 1))
    return tuple(reads)
