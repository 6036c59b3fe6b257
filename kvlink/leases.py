"""Producer-side block ownership: which blocks are held for remote readers, and when they may go.

This is the one state machine behind every pull, for the standalone :class:`kvlink.worker.KVWorker`
API, the demo and the vLLM connector alike. Never touches memory. Its rules:

- **Held, then released exactly once**: a request's blocks are held by :meth:`BlockLeases.hold`
  and released once — when every expected reader is done, when the lease expires, or on abort.
  Each hold gets a fresh *generation*; release ends it. Duplicate, late and unknown reports are
  counted and ignored.
- **Validate after read** (a seqlock): a reader asks :meth:`begin_read` before its READ and
  gets the generation (or a refusal: never held yet, already released, or blocks outside the
  hold). After the READ it reports with :meth:`finish_read`, which answers whether the same
  generation was held the whole time. Only that answer makes the READ's bytes valid: a lease
  that expired under the READ (a stalled decode step, a long transport queue) ends its
  generation, so the reader is told "not intact" and fails the receive. The expiry can stay a
  timer because a timer never decides that bytes are valid.
- **Readers that give up release at once**: ``finish_read(..., ok=False)`` counts the reader as
  done, so a failed pull frees the producer's blocks without waiting for the lease.
- **A READ touches only the request's own blocks**: ``begin_read`` refuses block ids the hold
  does not contain.
- **A waiting reader may renew**: :meth:`renew` (a decode whose request waits in its queue)
  moves the deadline to a full lease from now, never past ``renew_limit`` seconds after the
  hold: a reader that never comes cannot pin the blocks for good.

Thread-safe: the side channel thread answers intents and done reports while the step thread
holds, expires and drains releases.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError

log = logging.getLogger("kvlink.scheduler")  # the module's old name: log settings keep working

_REMEMBERED = 100_000  # released request ids kept to tell "released" from "not held yet"


class Refusal(enum.Enum):
    """Why :meth:`BlockLeases.begin_read` said no (the wire ``ErrorReply`` code)."""

    NOT_YET = "not_yet"  # never held here (yet): the producer may hold it on its next step
    RELEASED = "released"  # was held and is gone (read, expired, aborted): recompute
    BLOCKS = "blocks"  # asks for blocks the request does not hold


@dataclasses.dataclass(frozen=True)
class Grant:
    generation: int
    expires_in: float  # seconds the lease holds from now (a reader past it must not READ)


@dataclasses.dataclass(frozen=True)
class Refused:
    code: Refusal
    reason: str


@dataclasses.dataclass
class _Lease:
    block_ids: list[int]
    held: frozenset[int]  # for subset checks: a set beats numpy at a few hundred ids
    generation: int
    deadline: float
    limit: float  # no read intent extends the deadline past this
    cap: float  # no renewal extends the deadline past this (hold time + renew_limit)
    expected: int | None  # readers still unknown until the first report says
    done: set[str] = dataclasses.field(default_factory=set)
    reading: set[str] = dataclasses.field(default_factory=set)  # granted, not yet reported
    intact: set[str] = dataclasses.field(default_factory=set)  # told "intact"


@dataclasses.dataclass
class LeaseStats:
    held: int = 0  # requests currently held
    held_blocks: int = 0
    released_done: int = 0
    released_expired: int = 0
    released_aborted: int = 0
    reads_granted: int = 0
    reads_refused: int = 0
    reads_not_intact: int = 0  # READs whose lease ended under them (the reader was told)
    reads_failed: int = 0  # readers that gave up (their READ failed or never ran)
    renewed: int = 0  # leases a waiting reader renewed (renew)
    duplicate_notifications: int = 0
    unknown_notifications: int = 0


@dataclasses.dataclass(frozen=True)
class Released:
    req_id: str
    block_ids: list[int]
    why: str  # "read", "expired" or "aborted"


def _outside(held: frozenset[int], block_ids: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Up to 8 of ``block_ids`` that are not ``held`` (sorted), empty when all are."""
    ids = block_ids.tolist() if isinstance(block_ids, np.ndarray) else block_ids
    if isinstance(ids, (list, tuple)) and held.issuperset(ids):
        return []
    want = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    return sorted({int(b) for b in want.tolist() if int(b) not in held})[:8]


def new_generation() -> int:
    """A fresh random generation, for a caller that mints it where it reserves the blocks."""
    return secrets.randbits(62) + 1


def _integer(x: object) -> int | None:
    """``x`` as an int where it is an integer (Python's or numpy's, not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        return None
    return int(x)


def check_generation(generation: object) -> int | None:
    """A caller-minted hold generation: None (minted here) or a positive 63-bit integer,
    returned as an int."""
    if generation is None:
        return None
    g = _integer(generation)
    if g is None or not 0 < g < 2**63:
        raise ConfigError(f"generation must be a positive 63-bit integer, got {generation!r}")
    return g


def check_readers(readers: object) -> int | None:
    """A hold's reader count: None (the first reader's TP says) or an integer >= 1, returned
    as an int (a reader's report compares its count with it, on the side channel's thread:
    a string there failed every report, and the hold stayed until its lease)."""
    if readers is None:
        return None
    n = _integer(readers)
    if n is None or n < 1:
        raise ConfigError(f"readers must be None (the first reader's TP says) or an integer "
                          f">= 1, got {readers!r}")
    return n


class BlockLeases:
    """Holds a producer's blocks for remote readers (see the module docstring for the rules)."""

    def __init__(self, lease_seconds: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 read_seconds: float = 30.0, renew_limit: float = 600.0,
                 on_release: Callable[[str, int], None] | None = None) -> None:
        self.lease_seconds = lease_seconds
        #: renewals (:meth:`renew`) keep a hold at most this long after it began
        self.renew_limit = max(renew_limit, lease_seconds)
        # a READ granted near the lease's end extends it this far, once: read intents cannot
        # keep a hold alive past lease_seconds + read_seconds, whoever sends them
        self.read_seconds = read_seconds
        self._clock = clock
        #: called with (request id, generation) as a hold ends, under the lock (the worker
        #: revokes the hold's data-plane grant there); must not block
        self.on_release = on_release
        self._lock = threading.RLock()
        self._leases: dict[str, _Lease] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._gone_generation: dict[str, int] = {}  # the released hold's (same keys as _gone)
        # (request, generation) -> readers told "intact" before the release: a report that
        # comes again (its answer was lost with a connection) gets the same answer
        self._intact: collections.OrderedDict[tuple[str, int], frozenset[str]] = (
            collections.OrderedDict())
        self._released: list[Released] = []
        self.stats = LeaseStats()

    # ---------------------------------------------------------------- holding
    def hold(self, req_id: str, block_ids: Sequence[int] | npt.ArrayLike,
             readers: int | None = None, generation: int | None = None, *,
             on_hold: Callable[[int], None] | None = None) -> int:
        """Hold ``block_ids`` for ``req_id``'s readers (``None``: the first report says how
        many); returns the generation.

        ``generation``: one the caller minted when it reserved the blocks (vLLM's scheduler
        does, to hand it to the decode with the block ids before this worker holds them). It
        must be positive and unique per hold: a reader that names it validates against it.

        ``on_hold``: called with the generation once the hold exists, under the lock, like
        :attr:`on_release` — so nothing that ends the hold (a reader told the generation
        before it was held, an abort on another thread) runs between the two: what it
        publishes is withdrawn by the release, never left showing a hold that ended. Must
        not block."""
        ids = [int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1)]
        generation, readers = check_generation(generation), check_readers(readers)
        with self._lock:
            if req_id in self._leases:
                raise ConfigError(f"request {req_id!r} already holds blocks")
            if generation is not None and self._gone_generation.get(req_id) == generation:
                # that hold came and went (a second path delivering the same hold late)
                raise ConfigError(f"request {req_id!r} was held under generation "
                                  f"{generation} and released already")
            self._gone.pop(req_id, None)
            # random, never counted up: the generation is what lets a reader in (kvlink.grants)
            gen = new_generation() if generation is None else generation
            now = self._clock()
            self._leases[req_id] = _Lease(ids, frozenset(ids), gen, now + self.lease_seconds,
                                          now + self.lease_seconds + self.read_seconds,
                                          now + self.renew_limit, readers)
            self.stats.held += 1
            self.stats.held_blocks += len(ids)
            if on_hold is not None:
                on_hold(gen)
            return gen

    def generation_of(self, req_id: str) -> int | None:
        """The generation ``req_id`` is held under, or None."""
        with self._lock:
            lease = self._leases.get(req_id)
            return None if lease is None else lease.generation

    def released_generation(self, req_id: str) -> int | None:
        """The generation of ``req_id``'s last released hold, while remembered, else None."""
        with self._lock:
            return self._gone_generation.get(req_id) if req_id in self._gone else None

    def is_held(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._leases

    def held_blocks(self, req_id: str) -> list[int] | None:
        """The held block ids in hold order, or None when not held."""
        with self._lock:
            lease = self._leases.get(req_id)
            return None if lease is None else list(lease.block_ids)

    def released_why(self, req_id: str) -> str | None:
        """Why a recently released request went ("read", "expired", "aborted"), else None."""
        with self._lock:
            return self._gone.get(req_id)

    def renew(self, req_id: str) -> float | None:
        """A reader still wants ``req_id`` (its request waits to be scheduled): the deadline
        moves to a full lease from now, capped at ``renew_limit`` after the hold, and a read
        intent may again extend it by ``read_seconds`` past that. Returns the seconds the
        lease now holds, or None when ``req_id`` is not held. Never shortens a lease, never
        changes its generation (a READ under it stays valid)."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None:
                return None
            now = self._clock()
            lease.deadline = max(lease.deadline, min(now + self.lease_seconds, lease.cap))
            lease.limit = max(lease.limit, min(lease.deadline + self.read_seconds, lease.cap))
            self.stats.renewed += 1
            return lease.deadline - now

    # ---------------------------------------------------------------- readers
    def begin_read(self, req_id: str, reader: str,
                   block_ids: Sequence[int] | npt.ArrayLike | None = None) -> Grant | Refused:
        """A reader is about to READ ``block_ids`` of ``req_id``: the generation, or why not."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None:
                why = self._gone.get(req_id)
                if why is None:  # not counted: readers retry this until the hold arrives
                    return Refused(Refusal.NOT_YET, f"request {req_id} is not held (yet)")
                self.stats.reads_refused += 1
                return Refused(Refusal.RELEASED, f"request {req_id} is no longer held: {why}")
            if block_ids is not None:
                bad = _outside(lease.held, block_ids)
                if bad:
                    self.stats.reads_refused += 1
                    return Refused(Refusal.BLOCKS, f"blocks {bad} are not among the "
                                   f"{len(lease.held)} held for {req_id}")
            now = self._clock()
            lease.deadline = min(max(lease.deadline, now + self.read_seconds), lease.limit)
            lease.reading.add(reader)
            self.stats.reads_granted += 1
            return Grant(lease.generation, lease.deadline - now)

    def finish_read(self, req_id: str, reader: str, generation: int = 0, ok: bool = True,
                    expected: int | None = None) -> bool:
        """A reader is done with ``req_id``. Returns whether the lease of ``generation`` was
        intact for the whole READ (always False for ``ok=False`` or ``generation=0``, which
        only release). The request is released once its expected readers are all done."""
        with self._lock:
            lease = self._leases.get(req_id)
            if ok and generation and self._was_intact(req_id, generation, reader, lease):
                return True
            if lease is None or (generation and lease.generation != generation):
                if ok and generation:
                    self.stats.reads_not_intact += 1
                    log.warning("READ of %s by %s ran on a lease that ended under it (%s); "
                                "the reader fails the request", req_id, reader,
                                self._gone.get(req_id, "released and held again"))
                else:
                    self.stats.unknown_notifications += 1
                return False
            if reader in lease.done:  # (told "intact" before: answered by _was_intact)
                self.stats.duplicate_notifications += 1
                log.info("duplicate report for %s from %s ignored", req_id, reader)
                return False
            lease.done.add(reader)
            lease.reading.discard(reader)
            if ok and generation:
                lease.intact.add(reader)
            if not ok:
                self.stats.reads_failed += 1
            if lease.expected is None:
                lease.expected = expected if expected is not None else 1
            if len(lease.done) >= lease.expected:
                self.stats.released_done += 1
                self._release(req_id, "read")
            return bool(ok and generation)

    def validate_read(self, req_id: str, reader: str, generation: int,
                      block_ids: Sequence[int] | npt.ArrayLike,
                      expected: int | None = None) -> Grant | Refused:
        """A READ that ran without asking first is over (its reader got ``generation`` with the
        block ids): was the hold of that generation live the whole time, over these blocks?

        A generation is minted where the blocks are reserved, before any reader can know it,
        so "held under that generation now" means "held for the whole READ". Intact answers a
        :class:`Grant` and counts the reader done. ``NOT_YET``: never held here (yet) — the
        caller minted the generation and holds on its next step; ask again. Any other refusal
        means the READ's bytes are not trusted."""
        with self._lock:
            lease = self._leases.get(req_id)
            if self._was_intact(req_id, generation, reader, lease):
                return Grant(generation, 0.0)
            if lease is None:
                why = self._gone.get(req_id)
                if why is None:
                    return Refused(Refusal.NOT_YET, f"request {req_id} is not held (yet)")
                self.stats.reads_not_intact += 1
                return Refused(Refusal.RELEASED, f"request {req_id} was released under the "
                               f"READ ({why})")
            if lease.generation != generation:
                self.stats.reads_not_intact += 1
                return Refused(Refusal.RELEASED, f"request {req_id} was released and held "
                               "again under the READ (another generation)")
            bad = _outside(lease.held, block_ids)
            if bad:
                self.stats.reads_refused += 1
                self.finish_read(req_id, reader, generation, False, expected)
                return Refused(Refusal.BLOCKS, f"blocks {bad} are not among the "
                               f"{len(lease.held)} held for {req_id}")
            self.stats.reads_granted += 1
            if self.finish_read(req_id, reader, generation, True, expected):
                return Grant(generation, 0.0)
            return Refused(Refusal.RELEASED, f"{reader} already reported a failed READ of "
                           f"{req_id}")

    def release_reader(self, req_id: str, reader: str, generation: int,
                       expected: int | None = None) -> bool:
        """A reader that did not READ this rank is done with ``req_id`` (a replica it did
        not read, a request it did not read at all). ``generation``, where the reader knows
        it, must be this hold's: a late release meant for an earlier hold of the same request
        id is counted as unknown and ignored. True when it counted."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None or (generation and lease.generation != generation):
                self.stats.unknown_notifications += 1
                return False
            self.finish_read(req_id, reader, 0, True, expected)
            return True

    def _was_intact(self, req_id: str, generation: int, reader: str,
                    lease: _Lease | None) -> bool:
        """This reader's READ of this hold was already answered "intact" (a report sent
        again): the same answer, counted as a duplicate. Under the lock."""
        if lease is not None and lease.generation == generation:
            told = reader in lease.intact
        else:
            told = reader in self._intact.get((req_id, generation), ())
        if told:
            self.stats.duplicate_notifications += 1
        return told

    def reader_done(self, req_id: str, reader: str,
                    expected: int | None = None) -> list[int] | None:
        """A release without validation (a reader that did not READ this rank); returns the
        blocks if this released the request."""
        with self._lock:
            before = len(self._released)
            self.finish_read(req_id, reader, 0, True, expected)
            return self._released[-1].block_ids if len(self._released) > before else None

    # ---------------------------------------------------------------- endings
    def expire(self) -> list[tuple[str, list[int]]]:
        """Release every lease past its deadline (READs under them will be told "not intact")."""
        with self._lock:
            now = self._clock()
            out = []
            for req_id in [r for r, lease in self._leases.items() if lease.deadline <= now]:
                lease = self._leases[req_id]
                log.warning("lease of %s expired with %d/%s reader(s) done, %d reading; freeing "
                            "%d block(s)", req_id, len(lease.done),
                            lease.expected if lease.expected is not None else "?",
                            len(lease.reading), len(lease.block_ids))
                self.stats.released_expired += 1
                out.append((req_id, self._release(req_id, "expired")))
            return out

    def abort(self, req_id: str) -> list[int] | None:
        with self._lock:
            if req_id not in self._leases:
                return None
            self.stats.released_aborted += 1
            return self._release(req_id, "aborted")

    def drain_released(self) -> list[Released]:
        """Requests released since the last call (by readers, expiry or abort)."""
        with self._lock:
            out, self._released = self._released, []
            return out

    def _release(self, req_id: str, why: str) -> list[int]:
        lease = self._leases.pop(req_id)
        self.stats.held -= 1
        self.stats.held_blocks -= len(lease.block_ids)
        self._gone[req_id] = why
        self._gone_generation[req_id] = lease.generation
        while len(self._gone) > _REMEMBERED:
            self._gone_generation.pop(self._gone.popitem(last=False)[0], None)
        if lease.intact:
            self._intact[(req_id, lease.generation)] = frozenset(lease.intact)
            while len(self._intact) > _REMEMBERED:
                self._intact.popitem(last=False)
        self._released.append(Released(req_id, lease.block_ids, why))
        if self.on_release is not None:
            self.on_release(req_id, lease.generation)
        return lease.block_ids
