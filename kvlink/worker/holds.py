"""Producer side of a pull: holds under leases, grants over them, answers to their readers.

:meth:`_Holds.hold` puts a request's blocks under a lease (:class:`kvlink.leases.BlockLeases`)
with a fresh generation, grants READ over exactly those blocks where a transport enforces it
(:mod:`kvlink.grants`), fixes the integrity digests and publishes the hold on the hold board;
the lease's end (read, expired, aborted) withdraws all of that again (:meth:`_Holds._revoke_hold`).
The answers here are what a reader asks of a hold: a ``ReadIntent`` (the grant), a ``ReadDone``
(the verdict: validate after read) and our own scheduler's signed ``Hold``. Separate because
this is the producer's half of the block-ownership invariant, and it needs nothing of the
reader's machinery; the push paths above reuse its grants and its count of readers.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable

import numpy.typing as npt

from kvlink import localkey, wire
from kvlink.compat import WIRE_VERSION
from kvlink.grants import block_extents, read_ticket
from kvlink.headmap import notify_targets
from kvlink.integrity import Checker
from kvlink.leases import (
    BlockLeases,
    Grant,
    Refusal,
    Refused,
    Released,
    check_generation,
    check_readers,
    new_generation,
)
from kvlink.transport import Op, Transport
from kvlink.worker.peering import _Peering

log = logging.getLogger("kvlink.worker")


class _Holds(_Peering):
    """Holds and their readers' answers, as methods of the worker."""

    leases: BlockLeases  # the requests held for readers
    integrity: Checker
    #: messages refused because they did not come from the transfer's peer, by kind
    refusals: collections.Counter[str]
    _engine_key: bytes | None  # for our scheduler's holds (kvlink.localkey)
    _readers: dict[int, int]  # consumer TP -> readers per hold (see expected_readers)
    hold_hook: Callable[[wire.Hold], None] | None

    def hold(self, req_id: str, block_ids: npt.ArrayLike, readers: int | None = None,
             generation: int | None = None, *, final: bool = True) -> int:
        """Hold ``block_ids`` for ``req_id``'s readers (pull): they READ under the lease until
        all ``readers`` are done (``None``: as many as the first reader's TP says), the lease
        expires, or :meth:`abort`. :meth:`released` reports the end.

        Returns the hold's generation (``generation``: one minted by the caller, see
        :meth:`BlockLeases.hold`). A reader given it reads at once, with no round trip before
        its READ (see :meth:`read`); it is also what lets the reader in: with
        :attr:`WorkerConfig.grants`, transports that can enforce it serve READs of these blocks
        only to a transfer that names it, until the hold ends (:mod:`kvlink.grants`).

        ``final``: whether the blocks' KV is final at the call — the default: a request is
        held once its forward wrote it, and with integrity on its digests are fixed now (for
        its readers' verdicts and the hold board). False for a hold taken before the KV is
        written (a layer-wise push's, at its forward's start): no digests are fixed, so a READ
        of it with integrity on fails closed, and a push from it digests its blocks once they
        are written (a layer-wise push each range as it is pushed, a whole push at its call)."""
        wire.check_id(req_id, "request id")
        self._require_spec().check_block_ids(block_ids, "held")  # a window is granted over them
        generation, readers = check_generation(generation), check_readers(readers)
        gen = new_generation() if generation is None else generation
        # granted before the hold is visible: a reader told the generation may READ at once;
        # digested before too: the verdict of that READ carries them
        ticket = read_ticket(req_id, gen)
        try:
            # (inside: a grant that fails partway, the second of two transports that enforce
            # grants raising, and digests that cannot be taken, a device error in their
            # kernel, leave nothing granted; before, the grant outlived the raise, and a
            # reader told the generation READ blocks the caller then believed not held)
            self._grant(ticket, Op.READ, block_ids)
            if final:
                self.integrity.fix(req_id, gen, block_ids)
            # published under the lease table's lock: a release can only follow it, and
            # withdraws it (a reader told the generation may end the hold at once)
            held = self.leases.hold(req_id, block_ids, readers, gen, on_hold=(
                None if self.board is None else functools.partial(
                    self._publish, req_id, block_ids)))
        except BaseException:
            if self.leases.generation_of(req_id) != gen:  # not the same hold delivered twice
                self.integrity.drop(req_id, gen)
                for t in self._enforcing():
                    t.revoke(ticket)
            raise
        return held

    def _publish(self, req_id: str, block_ids: npt.ArrayLike, generation: int) -> None:
        """Show the hold on the hold board (BlockLeases calls this under its lock as the hold
        begins; withdrawn as it ends). Best effort: a hold the board does not show is
        validated by asking, so a failure here is logged, not raised into the hold."""
        assert self.board is not None
        try:
            self.board.publish(generation, block_ids,
                               self.integrity.for_board(req_id, generation))
        except Exception:
            log.exception("hold board: %s not published (its readers ask)", req_id)

    def _enforcing(self) -> list[Transport]:
        if not self.config.grants:
            return []
        return [t for t in self.transports.values() if t.capabilities.enforces_grants]

    def _grant(self, ticket: bytes, op: Op, block_ids: npt.ArrayLike) -> None:
        enforcing = self._enforcing()
        if enforcing:
            window = block_extents(self._require_spec(), block_ids)
            for t in enforcing:
                t.grant(ticket, op, window)

    def _revoke_hold(self, req_id: str, generation: int) -> None:
        """A hold ended (read, expired, aborted): its READ grant with it (BlockLeases calls
        this under its lock; revoking is a dict update)."""
        if self.board is not None:  # first: a reader's after-check must see it gone
            self.board.withdraw(generation)
        for t in self._enforcing():
            t.revoke(read_ticket(req_id, generation))
        self.integrity.drop(req_id, generation)

    def abort(self, req_id: str) -> None:
        """Release a held request now; readers still reading it will be told "not intact"."""
        self.leases.abort(req_id)

    def released(self) -> list[Released]:
        """Held requests that ended since the last call (read, expired, aborted): their blocks
        may be reused. Also expires leases past their deadline."""
        self.leases.expire()
        return self.leases.drain_released()

    def expect_access(self, seconds: float, count: int = 1) -> None:
        """A reader will post ``count`` transfers against our memory within ``seconds`` (it was
        just told to go ahead): let every transport serve them promptly (see
        :meth:`Transport.expect_access`; NIXL's initiator waits on our UCX progress)."""
        for t in self.transports.values():
            t.expect_access(seconds, count)

    def expected_readers(self, reader_tp: int) -> int:
        """How many ranks of a ``reader_tp``-way consumer will say "done" to this rank (see
        :func:`kvlink.headmap.notify_targets`: replicas that were not read are told too)."""
        known = self._readers.get(reader_tp)
        if known is None:  # asked by every report: computed once per consumer TP
            from kvlink.errors import IncompatibleSpecError
            from kvlink.headmap import check_tp

            spec = self._require_spec()
            # a peer's number: bounded (wire.MAX_TP) before it gets here, and checked against
            # our heads before it is looped over (no lock is held here); IncompatibleSpecError
            # is answered "incompatible" by the side channel
            if not 1 <= reader_tp <= wire.MAX_TP:
                raise IncompatibleSpecError(f"reader tp_size={reader_tp} is outside "
                                            f"1..{wire.MAX_TP}")
            if not spec.mla:
                check_tp(spec.total_kv_heads, reader_tp, "reader tp_size")
            known = self._readers[reader_tp] = sum(
                self.config.tp_rank in notify_targets(reader_tp, rank, self.config.tp_size,
                                                      spec.total_kv_heads, spec.mla)
                for rank in range(reader_tp))
        return known

    # ------------------------------------------------------------------ answers to readers
    def _stale(self, incarnation: int, what: str, req_id: str) -> wire.ErrorReply:
        return wire.ErrorReply(v=WIRE_VERSION, code="stale",
                               message=f"{what} of {req_id} names incarnation {incarnation}, this "
                               f"process is {self.incarnation} (it restarted): handshake again")

    def _answer_intent(self, msg: wire.ReadIntent) -> wire.Reply:
        if msg.incarnation != self.incarnation:
            return self._stale(msg.incarnation, "read intent", msg.req_id)
        reader = f"{msg.engine_id}/{msg.tp_rank}"
        got = self.leases.begin_read(msg.req_id, reader, msg.block_ids)
        if isinstance(got, Grant):
            return wire.ReadGrant(v=WIRE_VERSION, generation=got.generation,
                                  expires_in=got.expires_in)
        if got.code.value != "not_yet":
            log.warning("refused a READ of %s by %s: %s", msg.req_id, reader, got.reason)
        return wire.ErrorReply(v=WIRE_VERSION, code=got.code.value, message=got.reason)

    def _answer_done(self, msg: wire.ReadDone) -> wire.Reply:
        # a release (a replica not read, a request not read at all) validates nothing, so it
        # needs no incarnation. Whatever ends a reader's part of a hold (a release, a failed
        # READ) must name the hold's generation: only readers given it may (kvlink.grants)
        reader = f"{msg.engine_id}/{msg.tp_rank}"
        release = msg.ok and msg.block_ids is None and not msg.incarnation
        # taken before the verdict: the last reader's report ends the hold (and its digests)
        ids, blob, folded = ([], b"", False) if release or not msg.ok else (
            self.integrity.for_verdict(msg.req_id, msg.generation))
        held = self.leases.generation_of(msg.req_id)
        if (release or not msg.ok) and held is not None and msg.generation != held:
            self.refusals["release"] += 1
            log.warning("refused a %s of %s by %s: it does not name the hold's generation",
                        "release" if release else "failed-READ report", msg.req_id, reader)
            return wire.ErrorReply(v=WIRE_VERSION, code="not_yours",
                                   message=f"a release of {msg.req_id} must name the hold's "
                                   "generation")
        if release:
            self.leases.release_reader(msg.req_id, reader, msg.generation,
                                       self.expected_readers(msg.tp_size))
            return wire.ReadVerdict(v=WIRE_VERSION, intact=False, reason="released")
        if msg.generation and msg.incarnation != self.incarnation:
            if msg.block_ids is not None:  # a READ without an intent: READ again, after a
                return self._stale(msg.incarnation, "read report", msg.req_id)  # handshake
            return wire.ReadVerdict(v=WIRE_VERSION, intact=False,
                                    reason=f"the producer restarted (incarnation "
                                    f"{self.incarnation}, the READ ran under {msg.incarnation})")
        if msg.block_ids is not None and msg.ok:  # validate after read, no intent before
            got = self.leases.validate_read(msg.req_id, reader, msg.generation, msg.block_ids,
                                            self.expected_readers(msg.tp_size))
            if isinstance(got, Refused):
                if got.code is Refusal.NOT_YET:
                    return wire.ErrorReply(v=WIRE_VERSION, code=got.code.value,
                                           message=got.reason)
                return wire.ReadVerdict(v=WIRE_VERSION, intact=False, reason=got.reason)
            return wire.ReadVerdict(v=WIRE_VERSION, intact=True, reason="", digest_ids=ids,
                                    digests=blob, folded=folded)
        intact = self.leases.finish_read(msg.req_id, reader, msg.generation, msg.ok,
                                         self.expected_readers(msg.tp_size))
        why = "" if intact else (f"the lease of {msg.req_id} ended under the READ "
                                 f"({self.leases.released_why(msg.req_id) or 'held again'})")
        if not intact:
            return wire.ReadVerdict(v=WIRE_VERSION, intact=False, reason=why)
        return wire.ReadVerdict(v=WIRE_VERSION, intact=True, reason="", digest_ids=ids,
                                digests=blob, folded=folded)

    def _answer_hold(self, msg: wire.Hold) -> wire.Reply:
        hook = self.hold_hook
        if hook is None or msg.engine_id != self.config.engine_id:
            return wire.ErrorReply(v=WIRE_VERSION, code="unsupported",
                                   message=f"holds are taken only from engine "
                                   f"{self.config.engine_id!r}'s own scheduler here")
        body = wire.hold_body(msg.engine_id, msg.req_id, msg.block_ids, msg.generation)
        if not localkey.verify(self.engine_key(), body, msg.mac):
            self.refusals["hold"] += 1
            log.warning("refused a hold of %s not signed with engine %s's key", msg.req_id,
                        msg.engine_id)
            return wire.ErrorReply(v=WIRE_VERSION, code="auth",
                                   message="a hold must be signed with the engine's key")
        hook(msg)
        return wire.Ack(v=WIRE_VERSION)

    def _answer_renew(self, msg: wire.Renew) -> wire.Reply:
        """A reader whose requests still wait (a decode's queue) renews their leases."""
        renewed = sum(self.leases.renew(r) is not None for r in msg.req_ids)
        log.debug("%s renewed %d of %d lease(s)", msg.engine_id, renewed, len(msg.req_ids))
        return wire.Ack(v=WIRE_VERSION)

    def engine_key(self) -> bytes:
        """The key our own engine's scheduler signs its holds with (:mod:`kvlink.localkey`)."""
        if self._engine_key is None:
            self._engine_key = localkey.engine_key(self.config.engine_id, self._secret)
        return self._engine_key
