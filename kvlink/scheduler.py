"""Scheduler side: which blocks a producer holds for remote readers, and when they may be freed.

Never touches memory. A held request is released exactly once: when its last expected reader has
notified, when its lease expires (a decode that never reads cannot pin prefill memory), or on
abort. Duplicate, late and unknown notifications are counted and ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("kvlink.scheduler")


@dataclasses.dataclass
class _Lease:
    block_ids: list[int]
    deadline: float
    expected: int | None  # readers still unknown until the first notification says
    readers: set[str] = dataclasses.field(default_factory=set)
    reading: int = 0  # reads announced (begin_read) and not yet notified


@dataclasses.dataclass
class LeaseStats:
    held: int = 0  # requests currently held
    held_blocks: int = 0
    released_done: int = 0
    released_expired: int = 0
    released_aborted: int = 0
    duplicate_notifications: int = 0
    unknown_notifications: int = 0


class BlockLeases:
    """Holds a producer's blocks for remote readers (pull mode)."""

    def __init__(self, lease_seconds: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self.stats = LeaseStats()

    def hold(self, req_id: str, block_ids: Sequence[int], readers: int | None = None) -> None:
        if req_id in self._leases:
            raise ValueError(f"request {req_id!r} already holds blocks")
        self._leases[req_id] = _Lease(list(block_ids), self._clock() + self.lease_seconds,
                                      readers)
        self.stats.held += 1
        self.stats.held_blocks += len(block_ids)

    def is_held(self, req_id: str) -> bool:
        return req_id in self._leases

    def begin_read(self, req_id: str, read_seconds: float = 30.0) -> bool:
        """A reader announces its READ: pin the blocks for ``read_seconds`` more, or refuse.

        After this returns True the blocks cannot expire under the READ (until the pin runs out);
        after it returns False the reader must not read — the blocks may already be reused.
        """
        lease = self._leases.get(req_id)
        if lease is None:
            return False
        lease.reading += 1
        lease.deadline = max(lease.deadline, self._clock() + read_seconds)
        return True

    def reader_done(self, req_id: str, reader: str,
                    expected: int | None = None) -> list[int] | None:
        """Record one reader's notification; returns the blocks to free once all have read."""
        lease = self._leases.get(req_id)
        if lease is None:
            self.stats.unknown_notifications += 1
            log.info("notification for unknown or already released request %s from %s",
                     req_id, reader)
            return None
        if reader in lease.readers:
            self.stats.duplicate_notifications += 1
            log.info("duplicate notification for %s from %s ignored", req_id, reader)
            return None
        lease.readers.add(reader)
        lease.reading = max(0, lease.reading - 1)
        if lease.expected is None:
            lease.expected = expected if expected is not None else 1
        if len(lease.readers) < lease.expected:
            return None
        self.stats.released_done += 1
        return self._release(req_id)

    def expire(self) -> list[tuple[str, list[int]]]:
        now = self._clock()
        gone = [r for r, lease in self._leases.items() if lease.deadline <= now]
        out = []
        for req_id in gone:
            lease = self._leases[req_id]
            log.warning("lease of %s expired after %.1fs with %d/%s reader(s) done; freeing %d "
                        "block(s)", req_id, self.lease_seconds, len(lease.readers),
                        lease.expected if lease.expected is not None else "?",
                        len(lease.block_ids))
            self.stats.released_expired += 1
            out.append((req_id, self._release(req_id)))
        return out

    def abort(self, req_id: str) -> list[int] | None:
        if req_id not in self._leases:
            return None
        self.stats.released_aborted += 1
        return self._release(req_id)

    def _release(self, req_id: str) -> list[int]:
        lease = self._leases.pop(req_id)
        self.stats.held -= 1
        self.stats.held_blocks -= len(lease.block_ids)
        return lease.block_ids
