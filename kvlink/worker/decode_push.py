"""Push mode, decode side: ask the prefill ranks to WRITE into our blocks, and await them.

:meth:`_DecodePush.expect_push` reserves the blocks (a WRITE grant over exactly them, where a
transport enforces it) and sends a ``PushRequest`` to each prefill rank holding heads of ours;
each rank's "written" note (:meth:`_DecodePush._answer_note`, checked against the push we
asked of it, and with integrity on against its digests) settles it; a layer-wise push reports
each range as it lands (:meth:`_DecodePush.layers_landed`). A push that fails or times out is
cancelled, and its blocks are freed only once no byte of it can still land: every rank
answered the cancel, or its grant was revoked, or its transport fenced the prefill off
(:meth:`_DecodePush._settle_cancels`); else they stay reserved (:meth:`_DecodePush.quarantined`).
Separate because this is the consumer's half of push ownership (:mod:`kvlink.push`), and
independent of the prefill's half (:mod:`kvlink.worker.prefill_push`): a rank may do either.
"""

from __future__ import annotations

import collections
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.channel import Pending
from kvlink.compat import WIRE_VERSION
from kvlink.errors import ConfigError, KVLinkError
from kvlink.grants import push_ticket
from kvlink.headmap import map_heads, notify_targets
from kvlink.holdboard import BoardView
from kvlink.hostid import host_id
from kvlink.landing import AREA_HEAD, NO_LEASE, EndCheck, Hold, LandingBoard, tag_of
from kvlink.leases import check_generation
from kvlink.peers import RemoteEngine
from kvlink.push import PushWait, Rank
from kvlink.transport import Op
from kvlink.worker.records import _NOTES_KEPT, _Awaiting
from kvlink.worker.requests import _Requests

log = logging.getLogger("kvlink.worker")


class _DecodePush(_Requests):
    """Pushes awaited, as methods of the worker."""

    _awaiting: dict[str, _Awaiting]  # by request id
    _side_notifs: list[wire.Notification]  # notes taken by the side channel, for poll()
    landing: LandingBoard | None  # our landing board (kvlink.landing)
    board_landed: int  # push ranks counted written from it
    _ended_pushes: collections.OrderedDict[tuple[str, int], None]
    _landings_ended: list[_Awaiting]  # reported at once: their slots go back at the next poll
    _hold_views: dict[str, BoardView | None]

    def _answer_note(self, msg: wire.Notification) -> wire.Reply:
        """A prefill rank's note for a push (on the side channel's thread): kept for
        :meth:`poll` only if that push is awaited here."""
        from kvlink.headmap import check_tp

        spec = self._require_spec()
        try:  # the sender's TP must split our heads (it wrote them)
            if not spec.mla:
                check_tp(spec.total_kv_heads, msg.tp_size, "tp_size")
        except KVLinkError as exc:
            return wire.ErrorReply(v=WIRE_VERSION, code="incompatible",
                                   message=f"Notification: {exc}")
        # only a note for a push we await is kept (the rest would be dropped by poll(),
        # or never taken at all by a rank that awaits none): a flood costs nothing here
        aw = self._awaiting.get(msg.req_id)  # a plain dict read: safe off-thread
        if aw is None and (msg.req_id, msg.push_id) in self._ended_pushes:
            return wire.Ack(v=WIRE_VERSION)  # ended on the landing board before its note
        if aw is None or msg.push_id != aw.wait.push_id:
            self.refusals["written"] += 1
            return wire.ErrorReply(v=WIRE_VERSION, code="unknown",
                                   message=f"no push of {msg.req_id!r} (id {msg.push_id}) "
                                   "is awaited here")
        with self._lock:
            if len(self._side_notifs) >= _NOTES_KEPT:  # nobody awaits them: bounded
                return wire.ErrorReply(v=WIRE_VERSION, code="busy",
                                       message="too many unread notifications")
            self._side_notifs.append(msg)
        return wire.Ack(v=WIRE_VERSION)

    def expect_push(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
                    timeout: float = 60.0, *, live: bool = False,
                    generation: int | None = None) -> None:
        """Decode side: ask the prefill ranks to WRITE this request into ``local_ids``.

        Finished once every prefill rank signalled "written". After ``timeout`` (or a refusal)
        the push is cancelled; it is reported failed only once no byte of it can still land
        (every rank answered the cancel, or its transport fenced the prefill off), so the
        caller may reuse the blocks the moment it is reported. ``live`` (as :meth:`read`'s):
        the prefill handed us this request itself, so where nobody listens at its address
        the ask fails at once, as it does at an address that answered us before.
        ``generation``: the prefill's hold, where we were told it (vLLM: the params'
        ``kvlink_generation``, shared by its ranks): the ranks holding replicas of our heads
        that are not asked to push are released under it at the end — a producer takes a
        release only with the hold's generation, so without it they keep the blocks until
        their lease ends.
        """
        spec = self._require_spec()
        generation = check_generation(generation)
        if self._server is None:
            raise ConfigError("push mode needs a side channel server on the decode side "
                              "(serve=True): the prefill handshakes back to write")
        wire.check_id(req_id, "request id")
        if req_id in self._awaiting:
            raise ConfigError(f"request {req_id!r} is already awaiting a push")
        if not timeout > 0:
            raise ConfigError(f"push timeout must be positive, got {timeout!r}")
        lids = spec.check_block_ids(local_ids, "local")
        ranks = {r.remote_rank for r in map_heads(self.config.tp_size, self.config.tp_rank,
                                                  remote.tp_size, spec.total_kv_heads, spec.mla)}
        wait = PushWait(req_id, secrets.randbits(62) + 1, time.monotonic() + timeout,
                        dict.fromkeys(sorted(ranks), Rank.ASKED))
        msg = wire.PushRequest(
            v=WIRE_VERSION, engine_id=self.config.engine_id, agent_name=self.agent_name,
            req_id=req_id, tp_rank=self.config.tp_rank, tp_size=self.config.tp_size,
            host=self._public_host(), port=self.side_port - self.config.tp_rank,
            block_ids=lids.tolist(), push_id=wait.push_id,
            ttl_ms=min(max(1, int(timeout * 1e3)), wire.MAX_TTL_MS),
            incarnation=self.incarnation)
        self._grant(push_ticket(req_id, wait.push_id), Op.WRITE, lids)
        ask = min(self.config.handshake_timeout, timeout)  # an unanswered ask fails the push
        aw = _Awaiting(remote, wait, lids, tag=tag_of(wait.push_id),
                       others=notify_targets(self.config.tp_size, self.config.tp_rank,
                                             remote.tp_size, spec.total_kv_heads,
                                             spec.mla) - ranks, live=live,
                       generation=generation)
        for rank in sorted(ranks):
            # only the process that holds req_id can push it: where a process answered us at
            # that address before and nobody listens there now, it is gone (a restart there
            # never held req_id) and the ask fails at once, not at its timeout (a push from a
            # SIGKILLed vLLM prefill took 12 s to fail over to recomputing)
            aw.asked.append(self._send(remote.host, remote.port + rank,
                                       self._with_landing(msg, aw, rank), ask,
                                       live_only=self._gone_if_refused(aw, rank)))
        self._awaiting[req_id] = aw
        self._chan.flush()

    def _with_landing(self, msg: wire.PushRequest, aw: _Awaiting, rank: int
                      ) -> wire.PushRequest:
        """``msg`` for one prefill rank, with a slot of our landing board where we have one
        (kvlink.landing) — with integrity on, and a digest area for the rank's digests, so
        that the push ends there too (else by the note, which carries them)."""
        board = self.landing
        slot = board.take() if board is not None else None
        if board is None or slot is None:
            return msg
        aw.landing[rank] = slot
        at, nbytes = (board.take_area(slot, self._area_bytes(aw)) or (0, 0)
                      if self.integrity.on else (0, 0))
        offer = board.offer()
        return msgspec.structs.replace(msg, landing=wire.LandingMsg(
            name=offer.name, token=offer.token, slot=slot, host_id=host_id(),
            digests_at=at, digests_bytes=nbytes))

    def _area_bytes(self, aw: _Awaiting) -> int:
        """What a prefill rank's digests of this push may take in a digest area: every block
        (``full``), every layer and plane, as many heads as a rank of its TP holds."""
        spec = self._require_spec()
        heads = max(1, -(-spec.total_kv_heads // max(1, aw.remote.tp_size)))
        n = int(aw.local_ids.shape[0])
        return 8 * (AREA_HEAD + n + n * spec.num_layers * spec.num_kv * heads)

    def _landed_on_board(self, aw: _Awaiting) -> None:
        """Ranks whose WRITEs say on our landing board that every layer landed, from a hold
        its prefill still shows held (so held for all of them): written, without the note."""
        for rank, slot in aw.landing.items():
            if aw.wait.ranks.get(rank) is not Rank.ASKED:
                continue
            end = aw.ends.get(rank)
            if end is None:  # the hold is written at the push's start: read (and its board
                end = self._end_check(aw, slot)  # opened) at the first poll that sees it
                if end is None:
                    continue
                aw.ends[rank] = end
            written = end.written()
            if written is None:  # its hold board's view was closed under us: bind anew
                del aw.ends[rank]
            elif written:  # (else its note says)
                there, why = (self._check_area(aw, rank, slot) if self.integrity.on
                              else (True, None))
                if not there:
                    continue  # no digests in its area: its note brings them
                if why is not None:  # written, every layer (quiescent), but not as digested
                    aw.wait.ranks[rank] = Rank.SETTLED
                    aw.wait.fail(why)
                    continue
                aw.wait.ranks[rank] = Rank.WRITTEN
                self.board_landed += 1

    def _check_area(self, aw: _Awaiting, rank: int, slot: int) -> tuple[bool, str | None]:
        """With integrity on, once ``rank``'s flag shows every layer: its digests in the
        slot's area checked against what landed — (True, None) where they agree, (True, the
        reason) where not —; (False, None) where the prefill put none there."""
        assert self.landing is not None
        got = self.landing.digests(slot, aw.tag)
        if got is None:
            return False, None
        ids, d = got
        return True, self._check_pushed(aw, rank, ids, d, False, plane_major=True)

    def _end_check(self, aw: _Awaiting, slot: int) -> EndCheck | None:
        """What the poll that ends the push checks for the prefill rank behind ``slot``, once
        it wrote its hold there (None: not yet)."""
        board = self.landing
        assert board is not None
        hold = board.hold(slot, aw.tag)
        if hold is None:
            return None
        read = None
        if hold.generation != NO_LEASE:
            view = self._hold_view(hold)
            read = (view.reader(hold.generation) if view is not None else None) or _unshown
            read()  # its page faulted in now, not on the poll that ends the push (~15 us there)
        return board.end_check(slot, aw.tag, self._require_spec().num_layers, read,
                               (hold.generation, hold.fingerprint))

    def _hold_view(self, hold: Hold) -> BoardView | None:
        """The prefill's hold board (opened once, the last 256 kept)."""
        if hold.board is None:
            return None
        name = hold.board.name
        if name not in self._hold_views:
            while len(self._hold_views) >= 256:
                old = self._hold_views.pop(next(iter(self._hold_views)))
                if old is not None:
                    old.close()
            self._hold_views[name] = BoardView.open(name, hold.board.token)
        view = self._hold_views[name]
        # Not the producer's liveness (BoardView.still_holds, a flock: a syscall that hands the
        # GIL to whichever thread wants it, 0.1 ms and more on the poll that ends the push):
        # the flag moved, so the prefill was alive when its last WRITE landed (a dead
        # process's queued copies and signals never run), and a hold it withdrew before dying
        # is not shown — a board left by a dead prefill shows only holds intact until then
        return view

    def _public_host(self) -> str:
        """Where peers dial this rank back: a wildcard bind address is no address to dial."""
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.config.host

    def _cancel_push(self, aw: _Awaiting, rank: int) -> Pending:
        """Ask ``rank`` to stop the push. Where nobody listens at an address that answered
        us before (or of a ``live`` push), it fails at once (``live_only``, as the push
        request): the rank's process is gone, and its grant's revocation or a fence settles
        it (_settle_cancels)."""
        remote, wait = aw.remote, aw.wait
        return self._send(remote.host, remote.port + rank, wire.PushCancel(
            v=WIRE_VERSION, engine_id=self.config.engine_id, req_id=wait.req_id,
            tp_rank=self.config.tp_rank, push_id=wait.push_id),
            min(2.0, self.config.handshake_timeout), live_only=self._gone_if_refused(aw, rank))

    def _gone_if_refused(self, aw: _Awaiting, rank: int) -> bool:
        """Whether a push's message to ``rank`` is ``live_only``: the push is ``live`` (the
        prefill handed us the request), or that address answered us before."""
        return aw.live or self._chan.heard(aw.remote.host, aw.remote.port + rank)

    def _take_written(self) -> None:
        notes: list[wire.Notification] = []
        if self._side_notifs:  # (every poll: no lock while none came; one appended as this
            with self._lock:  # reads is taken by the next call)
                notes, self._side_notifs = self._side_notifs, []
        for t in self.transports.values():
            for peer, raw in t.notifications():
                try:
                    notes.append(wire.decode(raw, wire.Notification))
                except KVLinkError as exc:
                    log.warning("dropped a bad notification from %s: %s", peer, exc)
        for note in notes:
            aw = self._awaiting.get(note.req_id)
            if aw is None and (note.req_id, note.push_id) in self._ended_pushes:
                continue  # ended on the landing board before its note came
            if (aw is None or note.kind not in ("write", "layers")
                    or note.engine_id != aw.remote.engine_id
                    or note.push_id != aw.wait.push_id or note.tp_rank not in aw.wait.ranks):
                self.refusals["written"] += 1
                log.info("refused a 'written' notification for push %s (id %d) from %s/%d:"
                            " no such push was asked of that rank", note.req_id, note.push_id,
                            note.engine_id, note.tp_rank)
                continue
            if aw.wait.ranks[note.tp_rank] is not Rank.ASKED:
                continue
            if note.kind == "layers":  # landed (that range's WRITE is DONE); not written yet
                aw.layers.setdefault(note.tp_rank, []).append((note.layer_from, note.layer_to))
                continue
            why = (self._check_pushed(aw, note.tp_rank, note.digest_ids, note.digests,
                                      note.folded) if note.ok else None)
            if note.ok and why is None:
                aw.wait.ranks[note.tp_rank] = Rank.WRITTEN
            elif note.ok:  # written (quiescent), but not what the prefill digested
                aw.wait.ranks[note.tp_rank] = Rank.SETTLED
                aw.wait.fail(why or "")
            else:  # quiescent by the sender's contract, not (completely) written
                aw.wait.ranks[note.tp_rank] = Rank.SETTLED
                aw.wait.fail(f"{note.engine_id} rank {note.tp_rank} did not write: "
                             f"{note.detail or 'no reason given'}")

    def layers_landed(self, req_id: str) -> int:
        """Decode side, a push in progress: how many leading layers have landed from every
        prefill rank asked (a layer-wise push reports each range as it lands; a whole push
        reports nothing before it is written). The request is loaded only once :meth:`poll`
        reports it finished; 0 for a request not awaited here."""
        self._take_written()
        aw = self._awaiting.get(req_id)
        if aw is None:
            return 0
        landed = []
        tag = aw.tag
        for rank in aw.wait.ranks:
            upto = 0
            for start, stop in sorted(aw.layers.get(rank, ())):
                if start > upto:
                    break
                upto = max(upto, stop)
            slot = aw.landing.get(rank)
            if slot is not None and self.landing is not None:  # its flag, where it signals
                upto = max(upto, self.landing.landed(slot, tag))
            landed.append(upto)
        return min(landed, default=0)

    def _check_pushed(self, aw: _Awaiting, rank: int, digest_ids: Sequence[int] | npt.NDArray[Any],
                      digests: bytes | memoryview | npt.NDArray[np.uint64], folded: bool,
                      plane_major: bool = False) -> str | None:
        """With integrity on: None when the heads prefill ``rank`` wrote digest like the
        prefill's (from its note, or its digest area: ``plane_major``, as the area keeps
        them); else the reason (kvlink.integrity), which fails the push."""
        if not self.integrity.on:
            return None
        spec = self._require_spec()
        read = next((r for r in map_heads(self.config.tp_size, self.config.tp_rank,
                                          aw.remote.tp_size, spec.total_kv_heads, spec.mla)
                     if r.remote_rank == rank), None)
        if read is None:
            return f"integrity: rank {rank} wrote heads we did not ask of it"
        why = self.integrity.check(aw.wait.req_id, aw.local_ids, aw.local_ids,
                                   (read.local_start, read.remote_start, read.count),
                                   digest_ids, digests, folded, spec.num_layers, spec.num_kv,
                                   plane_major)
        if why is not None:
            log.warning("push of %s from %s rank %d: %s", aw.wait.req_id, aw.remote.engine_id,
                        rank, why)
        return why

    def _poll_pushed(self, finished: set[str], failed: dict[str, str]) -> None:
        if not self._awaiting:
            return
        self._take_written()
        now = time.monotonic()
        for req_id, aw in list(self._awaiting.items()):
            wait = aw.wait
            for asked in [a for a in aw.asked if a.done()]:
                aw.asked.remove(asked)
                if asked.exception() is not None:
                    wait.fail(f"push request to ranks {sorted(wait.ranks)} of "
                              f"{aw.remote.engine_id} failed: {asked.exception()}")
            if wait.error is not None:  # (else this poll's _poll_landed just looked)
                self._landed_on_board(aw)
            if wait.outcome() is None and (wait.error is not None or now > wait.deadline):
                if not wait.cancelling:
                    wait.fail(f"prefill ranks {wait.unsettled()} of {aw.remote.engine_id} did "
                              "not push within the timeout")
                    wait.cancelling = True
                    log.warning("push of %s: %s; cancelling", req_id, wait.error)
                self._settle_cancels(aw, now)
            outcome = wait.outcome()
            if outcome is not None:
                self._end_push(req_id, aw, outcome, finished, failed)

    def _poll_landed(self, finished: set[str]) -> None:
        """The pushes our landing board says are written: first thing in a poll, before the
        inbox is served (which may wait for the side channel's thread, and is only needed
        for what ends by note)."""
        if self.landing is None:
            return
        for req_id, aw in list(self._awaiting.items()):
            if aw.landing and aw.wait.error is None:
                self._landed_on_board(aw)
                if aw.wait.outcome():
                    self._end_push(req_id, aw, True, finished, {}, slots_later=True)

    def _end_push(self, req_id: str, aw: _Awaiting, outcome: bool, finished: set[str],
                  failed: dict[str, str], slots_later: bool = False) -> None:
        """``slots_later``: its landing slots go back at the next poll
        (:meth:`_end_landings`), not on the way to reporting it (every byte of it landed:
        nothing can move its flag any more)."""
        wait = aw.wait
        del self._awaiting[req_id]
        self._end_landing(aw, slots_later=slots_later)
        self._revoke_push(wait, 0.0)  # no WRITE of this push is taken from now on
        if aw.others:  # replicas holding our heads that did not write
            self.release(req_id, aw.remote, set(wait.ranks), aw.generation)
        if outcome:
            finished.add(req_id)
        else:
            failed[req_id] = wait.error or "push failed"
            log.warning("push of %s failed: %s", req_id, failed[req_id])

    def _end_landings(self) -> None:
        """The slots of the pushes the last poll reported at once."""
        ended, self._landings_ended = self._landings_ended, []
        for aw in ended:
            self._give_slots(aw)

    def _give_slots(self, aw: _Awaiting) -> None:
        if self.landing is not None:
            for slot in aw.landing.values():
                self.landing.give(slot)

    def _end_landing(self, aw: _Awaiting, slots_later: bool = False) -> None:
        """The push ended, every rank settled (nothing of it can land): its slots go back
        (``slots_later``: at the next poll), and notes still on their way for it are taken
        quietly (from now)."""
        if not aw.landing:
            return
        if slots_later:
            self._landings_ended.append(aw)
        else:
            self._give_slots(aw)
        self._ended_pushes[(aw.wait.req_id, aw.wait.push_id)] = None
        while len(self._ended_pushes) > _NOTES_KEPT:
            self._ended_pushes.popitem(last=False)

    def _settle_cancels(self, aw: _Awaiting, now: float) -> None:
        """Cancel the ranks that may still write; settle each on its answer, or by fencing it
        off when it cannot answer. A rank nothing can settle keeps the blocks (quarantine)."""
        wait = aw.wait
        for rank in wait.unsettled():
            fut = aw.cancels.get(rank)
            if fut is None:
                if now >= wait.next_cancel:
                    aw.cancels[rank] = self._cancel_push(aw, rank)
                continue
            if not fut.done():
                continue
            del aw.cancels[rank]
            exc = fut.exception()
            reply = fut.result() if exc is None else None
            if isinstance(reply, wire.PushState):
                if reply.state == "done":
                    wait.ranks[rank] = Rank.WRITTEN
                elif reply.state in ("cancelled", "failed"):
                    wait.ranks[rank] = Rank.SETTLED
                else:  # in flight: its "written" note follows once it is quiescent
                    wait.next_cancel = now + self.config.handshake_timeout
                continue
            if self._revoke_push(wait, 2.0):
                log.warning("push of %s: %s rank %d cannot answer its cancel (%s); its grant "
                            "is revoked and quiescent", wait.req_id, aw.remote.engine_id, rank,
                            exc)
                wait.ranks[rank] = Rank.SETTLED
            elif self._fence(aw.remote.engine_id, rank):
                log.warning("push of %s: %s rank %d cannot answer its cancel (%s); fenced off",
                            wait.req_id, aw.remote.engine_id, rank, exc)
                wait.ranks[rank] = Rank.SETTLED
            else:
                log.warning("push of %s: %s rank %d cannot answer its cancel (%s) and no "
                            "transport can fence it off; its blocks stay reserved",
                            wait.req_id, aw.remote.engine_id, rank, exc)
                wait.next_cancel = now + 1.0

    def _revoke_push(self, wait: PushWait, timeout: float) -> bool:
        """End a push's WRITE grant; True when every transport guarantees that no byte of it
        can land any more (only transports that enforce grants can: else fence the peer)."""
        enforcing = self._enforcing()
        if not enforcing:  # (the common same-host case, cuda_ipc: on the poll that ends it)
            return False
        ticket = push_ticket(wait.req_id, wait.push_id)
        quiet = [t.revoke(ticket, timeout) for t in enforcing]
        return bool(enforcing) and len(enforcing) == len(self.transports) and all(quiet)

    def _fence(self, engine_id: str, rank: int) -> bool:
        """Revoke every agent of ``engine_id``'s ``rank`` that handshook with us on every
        transport; True when they all guarantee no more bytes."""
        with self._lock:
            agents = set(self._handshook.get((engine_id, rank), ()))
        ok = True
        for agent in agents:
            for t in self.transports.values():
                fence = getattr(t, "fence", None)
                ok = ok and fence is not None and bool(fence(agent, 2.0))
        return ok

    def quarantined(self) -> int:
        """Pushes past their timeout whose blocks stay reserved (bytes may still land)."""
        return sum(aw.wait.cancelling for aw in self._awaiting.values())


def _unshown() -> tuple[int, ...]:
    """The read of a hold whose board we cannot open: never the hold (its note says)."""
    return ()
