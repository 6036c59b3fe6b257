"""Push mode's ownership rules, as state (no I/O): when a prefill may still WRITE into a decode.

The decode reserves blocks and asks the prefill to WRITE them (:class:`kvlink.wire.PushRequest`,
with an id and a time to live). Two sides, one rule — *the decode frees its blocks only when no
byte of the push can still land*:

- Prefill (:class:`PushSlots`): a push is ``queued`` on arrival, ``starting`` once the caller
  takes it (handshake, plan), ``posted`` from the first WRITE, then ``done`` or ``failed``
  (failed means quiescent: the transport contract). No WRITE of it starts after its deadline
  or after a cancel (a layer-wise push's next range neither; one in flight then runs to its
  end, and the decode keeps its blocks until told); a cancel is answered with the state
  (``cancelled``, ``in_flight``, ``done``, ``failed``), and a cancel that arrives before its
  push leaves a tombstone, so the late push is refused.
- Decode (:class:`PushWait`): each prefill rank asked is ``asked`` until it is ``written``, or
  ``settled`` (nothing more can land: it said cancelled/failed, or the transport fenced it off).
  On timeout or error the decode cancels the unsettled ranks and reports the request only once
  every rank is written or settled; until then its blocks stay reserved (quarantined).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time

from kvlink import wire
from kvlink.errors import TransferCancelled

_REMEMBERED = 100_000  # finished or cancelled pushes kept to answer late cancels and pushes

PushKey = tuple[str, int, str, int]  # decode engine, decode rank, request id, push id


def push_key(engine_id: str, tp_rank: int, req_id: str, push_id: int) -> PushKey:
    return (engine_id, tp_rank, req_id, push_id)


class Slot(enum.Enum):
    QUEUED = "queued"
    STARTING = "starting"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# what a cancel is answered in each state (wire.PushState.state)
_ANSWER = {Slot.QUEUED: "cancelled", Slot.STARTING: "cancelled", Slot.CANCELLED: "cancelled",
           Slot.POSTED: "in_flight", Slot.DONE: "done", Slot.FAILED: "failed"}


@dataclasses.dataclass
class _Slot:
    state: Slot
    deadline: float
    stop: bool = False  # cancelled while a layer was in flight: no further layer is posted


class PushSlots:
    """Prefill side: the state of every push request this rank was sent (caller locks)."""

    def __init__(self) -> None:
        self._slots: collections.OrderedDict[PushKey, _Slot] = collections.OrderedDict()

    def _put(self, key: PushKey, slot: _Slot) -> _Slot:
        self._slots[key] = slot
        self._slots.move_to_end(key)
        while len(self._slots) > _REMEMBERED:
            old, s = next(iter(self._slots.items()))
            if s.state in (Slot.QUEUED, Slot.STARTING, Slot.POSTED):
                break  # never forget a live push
            del self._slots[old]
        return slot

    def __contains__(self, key: PushKey) -> bool:
        return key in self._slots

    def arrive(self, msg: wire.PushRequest, now: float) -> bool:
        """A push request came in; False if it was cancelled before it arrived."""
        key = push_key(msg.engine_id, msg.tp_rank, msg.req_id, msg.push_id)
        old = self._slots.get(key)
        if old is not None:
            return old.state is not Slot.CANCELLED
        ttl = msg.ttl_ms / 1e3 if msg.ttl_ms > 0 else float("inf")
        self._put(key, _Slot(Slot.QUEUED, now + ttl))
        return True

    def asked_to_stop(self, key: PushKey) -> bool:
        """Whether a cancel of ``key`` came before (a decode asks again every
        ``handshake_timeout`` while the push is in flight)."""
        slot = self._slots.get(key)
        return slot is not None and (slot.stop or slot.state is Slot.CANCELLED)

    def cancel(self, key: PushKey) -> str:
        slot = self._slots.get(key)
        if slot is None:  # not arrived (yet): a tombstone refuses it if it does
            self._put(key, _Slot(Slot.CANCELLED, 0.0))
            return "cancelled"
        if slot.state in (Slot.QUEUED, Slot.STARTING):
            slot.state = Slot.CANCELLED
        elif slot.state is Slot.POSTED:  # what is in flight lands or fails; nothing more goes
            slot.stop = True
        return _ANSWER[slot.state]

    def start(self, msg: wire.PushRequest, now: float) -> PushKey:
        """The caller takes a push: raises TransferCancelled if it must not be written."""
        key = push_key(msg.engine_id, msg.tp_rank, msg.req_id, msg.push_id)
        if key not in self._slots:
            self.arrive(msg, now)
        slot = self._slots[key]
        if slot.state is Slot.CANCELLED:
            raise TransferCancelled(f"push of {msg.req_id} to {msg.engine_id} rank "
                                    f"{msg.tp_rank} was cancelled by the decode")
        if slot.state is not Slot.QUEUED:
            raise TransferCancelled(f"push of {msg.req_id} to {msg.engine_id} rank "
                                    f"{msg.tp_rank} was already taken ({slot.state.value})")
        if now > slot.deadline:
            slot.state = Slot.CANCELLED
            raise TransferCancelled(f"push of {msg.req_id} to {msg.engine_id} rank "
                                    f"{msg.tp_rank} is past its deadline; the decode has given "
                                    "up on it")
        slot.state = Slot.STARTING
        return key

    def may_post(self, key: PushKey, now: float) -> str | None:
        """Just before a WRITE part is posted: None (and POSTED) if it may be, else why not."""
        slot = self._slots.get(key)
        if slot is None or slot.state is Slot.CANCELLED:
            return "cancelled by the decode before it was posted"
        if slot.stop:
            return "cancelled by the decode after an earlier layer was posted"
        if slot.state is Slot.STARTING and now > slot.deadline:
            slot.state = Slot.CANCELLED
            return "past its deadline before it was posted"
        if slot.state not in (Slot.STARTING, Slot.POSTED):
            return f"not postable ({slot.state.value})"
        slot.state = Slot.POSTED
        return None

    def resume(self, key: PushKey, now: float) -> None:
        """A layer-wise push's next layers: raises TransferCancelled unless the push is still
        being written (started, not cancelled, not finished) and within its time to live —
        its decode gives up on it then, so a range posted later would only be written into
        blocks it keeps quarantined until told (never lost, never reused: but wasted, and
        the push's end delayed)."""
        slot = self._slots.get(key)
        if slot is None or slot.stop or slot.state not in (Slot.STARTING, Slot.POSTED):
            state = "unknown" if slot is None else (
                "cancelled" if slot.stop else slot.state.value)
        elif now > slot.deadline:
            state = "past its time to live"
        else:
            return
        raise TransferCancelled(f"push of {key[2]} to {key[0]} rank {key[1]}: no more "
                                f"layers are written ({state})")

    def stopped(self, key: PushKey) -> bool:
        """The decode cancelled this push (queued, starting or in flight)."""
        slot = self._slots.get(key)
        return slot is None or slot.stop or slot.state is Slot.CANCELLED

    def overdue(self, key: PushKey, now: float, grace: float = 0.0) -> bool:
        """A push taken and not finished (starting or posted) that is ``grace`` seconds past
        its time to live: its decode gave up on it then. A decode that can cancels it (within
        ``grace``: the cancel is its say); one that cannot (it died, or its cancels do not
        reach us) never does, so the time to live is what ends a layer-wise push whose caller
        stopped feeding it layers."""
        slot = self._slots.get(key)
        return (slot is not None and slot.state in (Slot.STARTING, Slot.POSTED)
                and now > slot.deadline + grace)

    def still_queued(self, key: PushKey, now: float) -> bool:
        """A queued push may still be taken: not cancelled and within its time to live (one
        past it is cancelled here, so a late cancel is answered "cancelled")."""
        slot = self._slots.get(key)
        if slot is None or slot.state is Slot.CANCELLED:
            return False
        if slot.state is Slot.QUEUED and now > slot.deadline:
            slot.state = Slot.CANCELLED
            return False
        return True

    def finish(self, key: PushKey, ok: bool) -> None:
        slot = self._slots.get(key)
        if slot is not None and slot.state is not Slot.CANCELLED:
            slot.state = Slot.DONE if ok else Slot.FAILED

    def live(self) -> int:
        return sum(s.state in (Slot.QUEUED, Slot.STARTING, Slot.POSTED)
                   for s in self._slots.values())


class Rank(enum.Enum):
    ASKED = "asked"
    WRITTEN = "written"
    SETTLED = "settled"  # nothing (more) can land from this rank; not (completely) written


@dataclasses.dataclass
class PushWait:
    """Decode side: blocks reserved for one push, per prefill rank asked."""

    req_id: str
    push_id: int
    deadline: float
    ranks: dict[int, Rank]
    error: str | None = None  # the first reason the push cannot complete
    cancelling: bool = False
    next_cancel: float = 0.0
    started: float = dataclasses.field(default_factory=time.monotonic)

    def unsettled(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s is Rank.ASKED)

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def outcome(self) -> bool | None:
        """True (all written), False (failed, quiescent), None (bytes may still land)."""
        states = self.ranks.values()  # (every poll: membership in C, no generator)
        if Rank.ASKED in states:
            return None
        return Rank.SETTLED not in states  # every rank written (late but complete: fine)
