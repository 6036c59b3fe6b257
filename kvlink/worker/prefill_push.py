"""Push mode, prefill side: take decodes' push requests, WRITE them, say "written".

A decode's ``PushRequest`` is queued (bounded) by :meth:`_PrefillPush._answer_push` until the
caller takes it (:meth:`_PrefillPush.push_requests`) and writes it (:meth:`_PrefillPush.push`:
one WRITE, under the hold's lease when it pushes held blocks — validate after write) or
refuses it (:meth:`_PrefillPush.refuse_push`). A layer-wise push posts one WRITE per range of
layers as the prefill's forward reaches them, tells the decode each range that landed
(:meth:`_PrefillPush._tell_landed`) and says "written" once the last range is DONE, its lease
checked once, at the end (:meth:`_PrefillPush._finish_layered`); with integrity on, each
range is digested as it is pushed, and "written" carries them all — as does a same-host
decode's landing slot, so that the push ends there (kvlink.landing's digest areas). No
WRITE starts after a push's time to live or a cancel, a layer-wise push's next range neither
(:mod:`kvlink.push` keeps that state); a layer-wise push still short of layers then, and not
cancelled, fails (:meth:`_PrefillPush._poll_layered`).
Separate because it is the producer's half of push ownership, independent of the decode's
(:mod:`kvlink.worker.decode_push`).
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import numpy.typing as npt

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import (
    ConfigError,
    KVLinkError,
    TransferCancelled,
    TransferError,
    TransferRefused,
)
from kvlink.headmap import push_targets
from kvlink.holdboard import fingerprint
from kvlink.hostid import host_id
from kvlink.integrity import AreaOpener, RangeDigests, WireDigests, on_gpu
from kvlink.landing import NO_LEASE, Hold, LandingView, tag_of
from kvlink.leases import Grant
from kvlink.peers import RemoteEngine
from kvlink.push import PushKey, push_key
from kvlink.transport import Op
from kvlink.worker.records import _NOTES_KEPT, _Layered, _push_rid, _Request
from kvlink.worker.requests import _Requests

log = logging.getLogger("kvlink.worker")


class _PrefillPush(_Requests):
    """Pushes written, as methods of the worker."""

    _push_inbox: list[wire.PushRequest]  # received, not yet taken by push_requests()
    #: layer-wise pushes being written, by the id push() returned; and why the ended ones
    #: ended (a late range of one is refused naming it)
    _layered: dict[str, _Layered]
    _layered_ended: collections.OrderedDict[str, str]
    #: decodes' landing boards by name (None: offered, not openable), and those evicted
    _landing_views: dict[str, LandingView | None]
    _landing_closed: list[LandingView]

    def _answer_push(self, msg: wire.PushRequest) -> wire.Reply:
        """Queue a push request for :meth:`push_requests`, or refuse it now: a TP that cannot
        split our heads, a decode rank that holds none of ours, or a full queue ("busy": at
        most 4096 requests and ``wire.MAX_BLOCK_IDS`` block ids wait, after those past their
        time to live were dropped — a rank nobody takes pushes from never drains it)."""
        if not self.config.serve_pushes:
            return wire.ErrorReply(v=WIRE_VERSION, code="unsupported",
                                   message=f"engine {self.config.engine_id} rank "
                                   f"{self.config.tp_rank} serves pulls, not pushes")
        most, most_ids = 4096, wire.MAX_BLOCK_IDS
        spec = self._require_spec()
        try:
            reads = push_targets(self.config.tp_size, self.config.tp_rank, msg.tp_size,
                                 msg.tp_rank, spec.total_kv_heads, spec.mla)
        except KVLinkError as exc:
            return wire.ErrorReply(v=WIRE_VERSION, code="incompatible",
                                   message=f"PushRequest tp_size={msg.tp_size} tp_rank="
                                   f"{msg.tp_rank}: {exc}")
        if not reads:
            return wire.ErrorReply(v=WIRE_VERSION, code="bad_message",
                                   message=f"PushRequest: rank {self.config.tp_rank} holds no "
                                   f"head of decode rank {msg.tp_rank} (tp_size={msg.tp_size})")
        key = push_key(msg.engine_id, msg.tp_rank, msg.req_id, msg.push_id)
        for look in range(2):
            with self._lock:  # work bounded by the queue's bound, never by the message
                again = key in self._push_slots
                queued = sum(len(m.block_ids) for m in self._push_inbox)
                if again or (len(self._push_inbox) < most
                             and queued + len(msg.block_ids) <= most_ids):
                    if not self._push_slots.arrive(msg, time.monotonic()):
                        return wire.ErrorReply(v=WIRE_VERSION, code="cancelled",
                                               message=f"push of {msg.req_id} was cancelled "
                                               "before it arrived")
                    if not again:  # a request sent again (its answer lost with a session)
                        self._push_inbox.append(msg)
                    return wire.Ack(v=WIRE_VERSION)
            if not look:
                self.queued_pushes()  # drops the queued pushes past their time to live
        return wire.ErrorReply(v=WIRE_VERSION, code="busy",
                               message=f"{len(self._push_inbox)} push requests ({queued} block "
                               "ids) wait already: is this rank serving pushes?")

    def _answer_cancel(self, msg: wire.PushCancel) -> wire.Reply:
        """The decode cancels a push (it timed out): answered with where the push stands.
        Logged once a push: a WRITE no transport can revoke stays in flight, and its decode
        asks again every ``handshake_timeout`` (an INFO line each time filled the log)."""
        key = push_key(msg.engine_id, msg.tp_rank, msg.req_id, msg.push_id)
        with self._lock:
            again = self._push_slots.asked_to_stop(key)
            state = self._push_slots.cancel(key)
        log.log(logging.DEBUG if again else logging.INFO,
                "push of %s to %s rank %d cancelled by the decode: %s%s", msg.req_id,
                msg.engine_id, msg.tp_rank, state, " (asked again)" if again else "")
        return wire.PushState(v=WIRE_VERSION, state=state)

    def queued_pushes(self) -> int:
        """Prefill side: push requests received and not yet taken by :meth:`push_requests`.

        Drops those that may not be written any more first: past their time to live (the
        decode gave up on them; a cancel is answered "cancelled"), or cancelled."""
        now = time.monotonic()
        with self._lock:  # the queue is bounded (see _answer_push)
            keep = [m for m in self._push_inbox if self._push_slots.still_queued(
                push_key(m.engine_id, m.tp_rank, m.req_id, m.push_id), now)]
            if len(keep) < len(self._push_inbox):
                log.info("%d push request(s) dropped unserved: cancelled or past their time "
                         "to live", len(self._push_inbox) - len(keep))
            self._push_inbox = keep
            return len(keep)

    def push_requests(self) -> list[wire.PushRequest]:
        """Prefill side: decode ranks waiting for a request to be written (drained). Each one
        taken is written (:meth:`push`: one past its time to live or cancelled raises
        TransferCancelled) or refused (:meth:`refuse_push`). The queue is bounded (see
        ``_answer_push``), so a rank that never takes them costs a bounded amount."""
        with self._lock:
            out, self._push_inbox = self._push_inbox, []
        return out

    def push(self, msg: wire.PushRequest, local_ids: npt.ArrayLike,
             lease: str | None = None, layers: tuple[int, int] | None = None) -> str:
        """Prefill side: WRITE ``local_ids`` into the decode rank's blocks; returns the id that
        :meth:`poll` reports. Raises TransferCancelled if the push was cancelled or is past its
        deadline (it must not be written any more).

        ``lease``: the held request the blocks belong to. The WRITE then runs under its lease
        like a READ (validate after write): a lease that ended under it fails the push, and the
        decode is told only after that check (never through the transport's own notification),
        and the writer counts as one of the request's readers.

        ``layers``: a layer-wise push (stream the KV behind the prefill's own compute): this
        call WRITEs layers ``[start, stop)`` only, posted now — ordered after the caller's
        current CUDA stream, so call it once those layers' attention is enqueued. Call again
        with the next range (in order, from 0, ``local_ids`` and ``lease`` as in the first
        call) until every layer is pushed; the decode learns of each range once it landed
        (:meth:`layers_landed`) and of the push once all are written. Raises
        TransferCancelled once the decode cancelled it or a range failed."""
        if layers is not None:
            return self._push_layers(msg, local_ids, lease, layers)
        spec = self._require_spec()
        # the caller's ids first: a wrong one is the caller's to correct, and must not use
        # the push up (its retry was refused as taken, and the decode never told)
        lids = spec.check_block_ids(local_ids, "local")
        if lids.shape[0] != len(msg.block_ids):
            raise ConfigError(f"push of {msg.req_id}: {lids.shape[0]} local block ids for the "
                              f"decode's {len(msg.block_ids)}")
        key, generation = self._begin_push(msg, local_ids, lease)
        rid = _push_rid(msg)
        try:
            remote = RemoteEngine(msg.engine_id, msg.host, msg.port, msg.tp_size)
            reads = push_targets(self.config.tp_size, self.config.tp_rank, msg.tp_size,
                                 msg.tp_rank, spec.total_kv_heads, spec.mla)
            # the lease is the request's from the start: _step may post at once (a cached
            # peer), and a WRITE posted without it would carry a native "written" (sent before
            # the lease check) besides the side-channel one _report sends
            held = None if lease is None else (lease, generation)
            landing = self._landing_of(msg, held)
            digests = (self._push_digests(msg, local_ids, held, landing)
                       if self.integrity.on else None)
            self._start(rid, Op.WRITE, remote, local_ids, msg.block_ids, reads, msg, key,
                        lease=held, digests=digests, landing=landing)
        except KVLinkError as exc:
            with self._lock:
                self._push_slots.finish(key, False)
            self._unread_push(msg, lease, generation)
            # the decode learns now, not at its timeout: this push will not come
            self._tell(msg.host, msg.port + msg.tp_rank,
                       self._note(msg.req_id, msg.push_id, ok=False, detail=str(exc)))
            self._chan.flush()
            raise
        return rid

    def _begin_push(self, msg: wire.PushRequest, local_ids: npt.ArrayLike,
                    lease: str | None) -> tuple[PushKey, int]:
        """Take a push: under ``lease``, the writer's read of the held blocks (its
        generation), then the push's slot; undone if the slot cannot be taken."""
        generation = 0
        if lease is not None:
            writer = f"{msg.engine_id}/{msg.tp_rank}"
            got = self.leases.begin_read(lease, writer, local_ids)
            if not isinstance(got, Grant):
                raise TransferRefused(f"push of {lease} to {writer}: {got.reason}")
            generation = got.generation
        try:
            with self._lock:
                key = self._push_slots.start(msg, time.monotonic())
        except KVLinkError:
            self._unread_push(msg, lease, generation)
            raise
        return key, generation

    def _unread_push(self, msg: wire.PushRequest, lease: str | None, generation: int) -> None:
        """A push that will not be written gives its writer's read of the hold back."""
        if lease is not None:
            self.leases.finish_read(lease, f"{msg.engine_id}/{msg.tp_rank}", generation, False,
                                    self.expected_readers(msg.tp_size))

    def _push_layers(self, msg: wire.PushRequest, local_ids: npt.ArrayLike,
                     lease: str | None, layers: tuple[int, int]) -> str:
        spec = self._require_spec()
        start, stop = (int(x) for x in layers)
        if not 0 <= start < stop <= spec.num_layers:
            raise ConfigError(f"push of {msg.req_id}: layers [{start}, {stop}) outside "
                              f"[0, {spec.num_layers})")
        rid = _push_rid(msg)
        ended = self._layered_ended.get(rid)
        if ended is not None:
            raise TransferCancelled(f"push of {msg.req_id}: it ended ({ended}); no more layers")
        lay = self._layered.get(rid)
        if lay is None:
            if start != 0:
                raise ConfigError(f"push of {msg.req_id}: a layer-wise push starts at layer 0, "
                                  f"got [{start}, {stop})")
            key, generation = self._begin_push(msg, local_ids, lease)
            lay = _Layered(msg, key, spec.num_layers,
                           None if lease is None else (lease, generation),
                           self.integrity.for_layers(msg.req_id, local_ids, msg.block_ids))
            lay.landing = self._landing_of(msg, lay.lease)
            if lay.digests is not None:
                _into_area(lay.digests, self._area_opener(msg, lay.landing))
            self._layered[rid] = lay
        else:
            if start != lay.next_layer:
                raise ConfigError(f"push of {msg.req_id}: layers come in order; the next is "
                                  f"{lay.next_layer}, got [{start}, {stop})")
            if lay.error is not None:
                raise TransferCancelled(f"push of {msg.req_id}: {lay.error}")
            try:
                with self._lock:
                    self._push_slots.resume(lay.key, time.monotonic())
            except TransferCancelled as exc:  # (the next poll ends the push and says why)
                lay.error = str(exc)
                raise
        sub = f"{rid}@{start}-{stop}"
        remote = RemoteEngine(msg.engine_id, msg.host, msg.port, msg.tp_size)
        reads = push_targets(self.config.tp_size, self.config.tp_rank, msg.tp_size,
                             msg.tp_rank, spec.total_kv_heads, spec.mla)
        try:
            if lay.digests is not None:  # (before the post: its WRITE waits for them too)
                self._digest_range(lay, start, stop)
            self._start(sub, Op.WRITE, remote, local_ids, msg.block_ids, reads, msg, lay.key,
                        layers=(start, stop), layered=rid, landing=lay.landing)
        except KVLinkError as exc:  # nothing of this range was posted
            lay.error = lay.error or f"layers [{start}, {stop}) not posted: {exc}"
            raise
        lay.inflight.add(sub)
        lay.next_layer = stop
        return rid

    def _landing_of(self, msg: wire.PushRequest, held: tuple[str, int] | None
                    ) -> tuple[LandingView, int, int] | None:
        """Where this push's WRITEs signal that they landed (kvlink.landing), with the hold
        they write from written into the decode's slot now, before any of them: None where
        the decode offered no slot, is on another host, or could not check the hold (we have
        no hold board) — the push then ends by its note alone."""
        offer = msg.landing
        if offer is None or not self.config.landing_board or offer.host_id != host_id():
            return None
        if held is not None and self.board is None:
            return None
        view = self._landing_view(offer.name, offer.token)
        if view is None:
            return None
        hold = Hold(NO_LEASE, 0, None)
        if held is not None:
            assert self.board is not None
            blocks = self.leases.held_blocks(held[0])
            if blocks is None:
                return None
            hold = Hold(held[1], fingerprint(blocks), self.board.offer())
        tag = tag_of(msg.push_id)
        try:
            view.start(offer.slot, tag, hold)
        except ValueError as exc:
            log.info("push of %s: landing slot refused (%s): it ends by note", msg.req_id, exc)
            return None
        return view, offer.slot, tag

    def _push_digests(self, msg: wire.PushRequest, local_ids: npt.ArrayLike,
                      held: tuple[str, int] | None,
                      landing: tuple[LandingView, int, int] | None
                      ) -> WireDigests | RangeDigests | None:
        """A whole push's digests, for its "written" note and the landing slot's digest area:
        the ones its hold fixed, else taken now as one range of every layer — on a GPU
        launched on the caller's stream and not waited for (the WRITE, posted after them,
        waits on the device; the note reads them once it is DONE). Taken on the host here
        instead, the push's caller waited for its forward and the digest on each push.
        Raises TransferError where they cannot be taken (nothing is posted)."""
        opener = self._area_opener(msg, landing)
        fixed = self.integrity.for_push(local_ids, msg.block_ids, held, opener)
        if fixed is not None:
            return fixed
        taken = self.integrity.for_layers(msg.req_id, local_ids, msg.block_ids)
        if taken is None:
            return None
        _into_area(taken, opener)
        try:
            taken.take(0, self._require_spec().num_layers)
        except Exception as exc:  # (a device error in the digest kernel, say)
            log.exception("push of %s: digesting its blocks failed", msg.req_id)
            raise TransferError(f"integrity: digesting the pushed blocks failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        return taken

    def _area_opener(self, msg: wire.PushRequest, landing: tuple[LandingView, int, int] | None
                     ) -> AreaOpener | None:
        """With integrity on, the digest area the decode offered with its landing slot, as
        kvlink.integrity takes it (opened with the push's tag); None where there is none, or
        a GPU's digests could not be copied there without a wait (the board not
        page-locked): the push then ends by its note, which carries them."""
        offer = msg.landing
        if landing is None or offer is None or not offer.digests_bytes:
            return None
        view, _, tag = landing
        area = view.area(offer.digests_at, offer.digests_bytes)
        planes = self.integrity.planes
        if area is None or planes is None or (on_gpu(planes) and not view.pin()):
            return None
        return functools.partial(area.open, tag)

    def _landing_view(self, name: str, token: bytes) -> LandingView | None:
        """Decodes' landing boards, opened once (a board that cannot be is remembered too)."""
        if name not in self._landing_views:
            while len(self._landing_views) >= 256:  # decodes come and go: the oldest goes
                old = self._landing_views.pop(next(iter(self._landing_views)))
                if old is not None:
                    self._landing_closed.append(old)  # closed with the transports
            self._landing_views[name] = LandingView.open(name, token)
        return self._landing_views[name]

    def _report_layers(self, req: _Request, finished: set[str], failed: dict[str, str]
                       ) -> None:
        """One range of a layer-wise push ended (every part quiescent)."""
        assert req.layered is not None and req.layers is not None and req.push is not None
        lay = self._layered.get(req.layered)
        if lay is None:
            return
        lay.inflight.discard(req.req_id)
        lay.signalled = lay.signalled and req.signalled
        errors = [p.error for p in req.parts if p.error]
        if errors:
            lay.error = lay.error or (f"layers [{req.layers[0]}, {req.layers[1]}): "
                                      + "; ".join(errors))
        else:
            self._ledger.finished_bytes += req.nbytes
            lay.landed.append(req.layers)
        self._finish_layered(req.layered, finished, failed)

    def _tell_landed(self) -> None:
        """Tell each decode the layer ranges of its push that landed in this poll, merged
        into as few notes as they allow — unless every range so far signalled the decode's
        landing board, which says the same without a message. (A push that finished in this
        poll was told "written" instead, which says all of it landed.)"""
        for lay in self._layered.values():
            if not lay.landed or (lay.landing is not None and lay.signalled):
                continue  # (its flags say it on the decode's landing board)
            merged: list[list[int]] = []
            for start, stop in sorted(lay.landed):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], stop)
                else:
                    merged.append([start, stop])
            lay.landed.clear()
            msg = lay.msg
            for start, stop in merged:
                self._tell(msg.host, msg.port + msg.tp_rank, self._note(
                    msg.req_id, msg.push_id, "layers", layer_from=start, layer_to=stop))

    def _poll_layered(self, finished: set[str], failed: dict[str, str]) -> None:
        """Layer-wise pushes the decode cancelled between two ranges, or still short of layers
        ``handshake_timeout`` past their time to live with no cancel come: end them. A decode
        that is there cancels at its timeout (the push's time to live), its cancel a side
        channel call bounded by ``handshake_timeout``; past both, it is gone (or cannot reach
        us) and nothing else would end a push whose caller stopped feeding it layers: before,
        it was never reported, and its slot and its writer's read of the hold stayed taken."""
        now, grace = time.monotonic(), self.config.handshake_timeout
        for rid, lay in list(self._layered.items()):
            with self._lock:
                stopped = self._push_slots.stopped(lay.key)
                overdue = (lay.next_layer < lay.layers
                           and self._push_slots.overdue(lay.key, now, grace))
            if stopped and lay.error is None:
                lay.error = f"cancelled by the decode after layer {lay.next_layer}"
            elif overdue and lay.error is None:
                lay.error = (f"past its time to live ({lay.msg.ttl_ms} ms) with layers "
                             f"[{lay.next_layer}, {lay.layers}) not pushed, and no cancel "
                             f"from its decode within {grace:g} s of it")
            if lay.error is not None:
                self._finish_layered(rid, finished, failed)

    def _finish_layered(self, rid: str, finished: set[str], failed: dict[str, str]) -> None:
        """The push is over once nothing of it is in flight and every layer is written, or one
        failed: the lease check, the slot, the decode's "written" (or why not), the report."""
        lay = self._layered[rid]
        if lay.inflight or (lay.error is None and lay.next_layer < lay.layers):
            return
        del self._layered[rid]
        msg, why = lay.msg, lay.error
        digests = (self._layered_digests(lay) if why is None and lay.digests is not None
                   else None)
        if isinstance(digests, str):
            why, digests = digests, None
        if lay.lease is not None:
            intact = self.leases.finish_read(lay.lease[0], f"{msg.engine_id}/{msg.tp_rank}",
                                             lay.lease[1], why is None,
                                             self.expected_readers(msg.tp_size))
            if why is None and not intact:
                why = (f"the lease of {lay.lease[0]} ended under the WRITE: the written "
                       "bytes are not trusted")
        with self._lock:
            self._push_slots.finish(lay.key, why is None)
        self._layered_ended[rid] = why or "written"
        while len(self._layered_ended) > _NOTES_KEPT:
            self._layered_ended.popitem(last=False)
        ids, blob, folded = digests or ([], b"", False)
        self._tell(msg.host, msg.port + msg.tp_rank,
                   self._note(msg.req_id, msg.push_id, ok=why is None, detail=why or "",
                              digest_ids=ids, digests=blob, folded=folded))
        if why is None:
            finished.add(rid)
        else:
            failed[rid] = why
            log.warning("layer-wise push %s failed: %s", rid, why)

    @staticmethod
    def _digest_range(lay: _Layered, start: int, stop: int) -> None:
        """With integrity on, layers ``[start, stop)`` are written: their digests, taken now
        (on a GPU, launched on the caller's stream behind the forward's writes of them, not
        waited for). A fault here is the range's: nothing of it is posted."""
        assert lay.digests is not None
        try:
            lay.digests.take(start, stop)
        except Exception as exc:  # (a device error in the digest kernel, say)
            log.exception("layer-wise push of %s: digesting layers [%d, %d) failed",
                          lay.msg.req_id, start, stop)
            raise TransferError(f"integrity: digesting layers [{start}, {stop}) failed: "
                                f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _layered_digests(lay: _Layered) -> WireDigests | str:
        """A layer-wise push's digests for its "written" note, every range DONE (each range's
        were taken as it was pushed, and its WRITE waited for them); a fault here fails the
        push, never the caller: its reason is returned."""
        assert lay.digests is not None
        try:
            return lay.digests.wire(lay.layers)
        except Exception as exc:
            log.exception("layer-wise push of %s: its digests", lay.msg.req_id)
            return f"integrity: the pushed layers' digests: {type(exc).__name__}: {exc}"

    def refuse_push(self, msg: wire.PushRequest, reason: str) -> None:
        """Prefill side: tell a decode rank its push will not come, so it fails the request
        now instead of holding its reserved blocks until its timeout (async)."""
        with self._lock:
            self._push_slots.cancel(push_key(msg.engine_id, msg.tp_rank, msg.req_id,
                                             msg.push_id))
        self._tell(msg.host, msg.port + msg.tp_rank,
                   self._note(msg.req_id, msg.push_id, ok=False, detail=reason))
        self._chan.flush()


def _into_area(taken: RangeDigests, opener: AreaOpener | None) -> None:
    """A push's digests go into the digest area the decode offered with its landing slot
    too, where there is one and they fit (else with its note alone)."""
    place = opener(taken.ids, taken.shape) if opener is not None else None
    if place is not None:
        taken.into(place)
