"""One part of a request, from handshake to verdict: the per-part steps of every transfer.

A request has a part per remote rank it moves heads to or from (:class:`records._Part`); each
:meth:`KVWorker.poll` advances every part one step (:meth:`_Parts._advance`): wait for the
peer's handshake (and, for a READ without a generation, the producer's grant), plan and post
(:meth:`_Parts._post`), poll the transport (:meth:`_Parts._progress`), then validate after
read — on the producer's hold board where it is offered, else by its verdict
(:meth:`_Parts._take_verdict`), with the integrity check of what landed. A READ refused before
any byte moved, or one whose producer restarted, is asked about and posted again. A WRITE's
"written" note is built here too, since how it goes (on the WRITE itself or over the side
channel) decides what is posted. Separate because this is the hot path of every transfer,
READ or WRITE, pull or push, and it knows nothing of how a request begins or is reported.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.channel import Pending
from kvlink.compat import WIRE_VERSION
from kvlink.errors import KVLinkError
from kvlink.grants import push_ticket, read_ticket
from kvlink.headmap import HeadRead
from kvlink.holdboard import LAYOUT, fingerprint
from kvlink.integrity import Digests, RangeDigests, board_rows, unpack
from kvlink.landing import Signal
from kvlink.layout import KVCacheSpec
from kvlink.leases import Refusal
from kvlink.plan import Plan, PlanPath, PlanTable
from kvlink.push import PushSlots
from kvlink.transport import DigestJob, LaneDigests, Op, Runs, Transport, XferStatus
from kvlink.worker.holds import _Holds
from kvlink.worker.ledger import Ledger, _Spent
from kvlink.worker.records import Moved, _Go, _Part, _PeerLane, _Request

log = logging.getLogger("kvlink.worker")


class _Parts(_Holds):
    """The steps of one part, as methods of the worker (the caller's thread)."""

    _push_slots: PushSlots  # who may still post a push (kvlink.push)
    _ledger: Ledger  # what callers read back, written off the request's path
    board_validated: int  # reader: READs validated on a producer's hold board
    _slices: dict[tuple[int, int, int], tuple[KVCacheSpec, KVCacheSpec]]
    #: (id of the peer, heads, op, digests) -> its lane, or none (see _post_lane); a new
    #: handshake is a new peer (the entry holds the peer: its id is not reused while kept)
    _lanes: dict[tuple[int, HeadRead, Op, bool], _PeerLane]

    def _advance(self, req: _Request, part: _Part) -> None:
        if part.settled:
            return
        if part.reask:  # the producer did not hold it yet when our report came: again
            if time.monotonic() >= part.retry_at:
                part.reask, part.retry_at = False, 0.0
                part.verdict = self._report_read(req, part, True)
        elif part.verdict is not None:
            self._take_verdict(req, part)
        elif part.handle is not None:
            self._progress(req, part)
        elif part.go is None:
            self._get_go(req, part)
            if part.go is not None:
                self._post(req, part)

    def _get_go(self, req: _Request, part: _Part) -> None:
        """The peer's handshake, then (READ without a generation) the producer's grant."""
        if part.retry_at:
            if time.monotonic() < part.retry_at:
                return
            part.retry_at = 0.0
        if not part.peer.done():
            return
        try:  # (one look at the future: each of its calls takes its lock)
            peer = part.peer.result()
        except Exception as unreachable:  # or incompatible: nothing was granted or posted
            part.error = f"{self._where(req, part)}: {unreachable}"
            return
        if req.op is not Op.READ:
            part.go = _Go(peer)
        elif req.generation is not None:
            part.go = _Go(peer, req.generation)
        elif part.intent is None:  # (only the producer we handshook with can grant it)
            part.intent = self._ask(req, part, self._intent(req, peer.incarnation))
        elif part.intent.done():
            intent, part.intent = part.intent, None
            try:
                reply = intent.result()
            except KVLinkError as exc:
                if not self._again(req, part, exc, intent.asked):
                    part.error = (f"{self._where(req, part)}: refused the READ of "
                                  f"{req.req_id}: {exc}")
                return
            if not isinstance(reply, wire.ReadGrant):
                part.error = (f"{self._where(req, part)} answered {type(reply).__name__} to a "
                              "read intent; refusing to read unverified blocks")
                return
            part.go = _Go(peer, reply.generation, intent.asked + reply.expires_in)
        if part.go is not None:
            req.phases.wait = max(req.phases.wait, time.perf_counter() - req.t_start)

    @staticmethod
    def _where(req: _Request, part: _Part) -> str:
        return f"{req.remote.engine_id} rank {part.read.remote_rank}"

    def _again(self, req: _Request, part: _Part, exc: KVLinkError, asked: float) -> bool:
        """Whether a refusal is worth asking again: "not held yet" (the producer holds on its
        next step) to a question asked (``asked``, monotonic) within ``intent_timeout`` of the
        request's start, or "stale" (it restarted: handshake again). Judged by when the
        question left, not when its answer is read: a reader starved for seconds (a compile
        holding its GIL) must not give up on an answer that came in time."""
        code = getattr(exc, "code", "")
        if code == "stale" and part.restarts < 2:
            part.restarts += 1
            log.warning("%s rank %d restarted since our handshake; handshaking again",
                        req.remote.engine_id, part.read.remote_rank)
            self.peers.forget_stale(req.remote, part.read.remote_rank, part.peer)
            part.peer = self._peer(req.remote, part.read.remote_rank)
            return True
        if code == "not_yet" and asked - req.t_mono < self.config.intent_timeout:
            part.asks += 1
            # a READ told its generation is done and only waits for the hold (vLLM: the
            # prefill worker's next step): ask often, it is one small frame; an intent backs off
            wait = 0.002 if req.generation is not None else min(0.005 * 2 ** part.asks, 0.2)
            part.retry_at = time.monotonic() + wait
            return True
        return False

    def _post(self, req: _Request, part: _Part) -> None:
        go = part.go
        assert go is not None
        if time.monotonic() >= go.deadline:
            self._part_failed(req, part, "the producer's lease deadline passed before the READ "
                              "could start (not posted)")
            return
        if req.push_key is not None:
            with self._lock:
                why = self._push_slots.may_post(req.push_key, time.monotonic())
            if why is not None:
                self._part_failed(req, part, f"push of {req.req_id} not posted: {why}")
                return
        t0 = time.perf_counter()
        transport = go.peer.transport
        if self._post_lane(req, part, go, transport, t0):
            return
        note = None
        if self._notes_natively(req):
            note = wire.encode(self._written(req, True))  # ordered after the written bytes
        # a transport that computes addresses on its device takes the factored plan
        post_runs = getattr(transport, "post_runs", None) if note is None else None
        plan: Plan | Runs | None = None
        try:
            # built at the peer's first request (a handshake's spec is a new object: a
            # restarted peer gets a new table), cached in the planner
            ours, theirs = self._require_spec(), go.peer.spec
            if req.layers is not None:  # one range of a layer-wise push
                ours, theirs = self._slice(ours, *req.layers), self._slice(theirs, *req.layers)
            table = PlanTable.for_peer(ours, theirs, part.read)
            job = self._digest_job(req, part, transport, ours) if post_runs else None
            if post_runs is not None:
                # the fused digest takes one run per block (a unit is one block's pages)
                plan = table.runs(req.local_ids, req.remote_ids, local_checked=True,
                                  coalesce=(job is None
                                            and getattr(transport, "coalesce_runs", True)))
            if plan is None:
                plan = table.plan(req.local_ids, req.remote_ids, transport.extents)
        except KVLinkError as exc:
            self._part_failed(req, part, str(exc))
            return
        part.plan = plan
        part.t_post = time.perf_counter()
        req.phases.plan += part.t_post - t0
        # a transport that serves only granted windows checks the ticket; no other reads it
        ticket = (b"" if not transport.capabilities.enforces_grants
                  else push_ticket(req.push.req_id, req.push.push_id) if req.push is not None
                  else read_ticket(req.req_id, go.generation) if go.generation else b"")
        signal = self._signal(req, transport)
        req.signalled = signal is not None
        extra: dict[str, Any] = {} if signal is None else {"signal": signal}
        if job is not None and isinstance(plan, Runs):
            extra["digest"] = job
            part.fusing = True
        try:
            if isinstance(plan, Runs):
                assert post_runs is not None
                part.handle = post_runs(req.op, go.peer.agent, plan, ticket=ticket, **extra)
            else:
                part.handle = transport.post(req.op, go.peer.agent, plan.local, plan.remote,
                                             note, ticket=ticket, **extra)
        except KVLinkError as exc:  # the contract says FAILED handle; be safe with any plugin
            self._part_failed(req, part, f"post to {go.peer.agent} failed: {exc}")
            return
        self._posted(req, part, go, plan.nbytes)

    def _posted(self, req: _Request, part: _Part, go: _Go, nbytes: int,
                post_seconds: float | None = None) -> None:
        """After a part's post: its time (``post_seconds``: taken at the post, where these
        records come later), and (a READ validated on the hold board) its after-check bound
        — while the bytes move."""
        part.post_seconds = (time.perf_counter() - part.t_post if post_seconds is None
                             else post_seconds)
        req.phases.post += part.post_seconds
        if self._boarded(req, go):  # (the ids are fingerprinted by the check itself)
            assert go.peer.board is not None
            part.check = go.peer.board.after_check(go.generation, req.remote_ids)
        part.nbytes = nbytes  # read now: a transport may recycle the extents once done
        req.nbytes += nbytes

    def _post_lane(self, req: _Request, part: _Part, go: _Go, transport: Transport,
                   t0: float) -> bool:
        """Post through the peer's lane where the transport has one for this request (whole
        blocks, no note on the WRITE, no ticket to check; a READ with integrity on digested by
        its kernel; a push into a landing board with its signal): what does not change between
        this pair's requests was worked out at its first (:class:`_PeerLane`), so this post
        hands over both id arrays (the remote ids' range checked on the device). A whole push
        took the general way, planned and posted per request, until 2026-12-06: 0.6-0.8 ms of
        the prefill's host per push() on one H100, where a READ's lane post is tens of us
        (bench/results/gpu_push_lane/). False: post it the general way (nothing was posted)."""
        if (req.layers is not None or transport.capabilities.enforces_grants
                or (req.op is Op.WRITE and self._notes_natively(req))):
            return False
        signal = None if req.landing is None else self._signal(req, transport)
        if req.landing is not None and signal is None:  # (the general path ends it by note)
            return False
        # a READ's lane digests what it lands or not (a level may change at run time); a
        # WRITE's never does: a push's digests are taken before its WRITE, on the caller's
        # stream, for its landing area or its note (kvlink.worker.prefill_push)
        digests = self.integrity.on and req.op is Op.READ
        key = (id(go.peer), part.read, req.op, digests)
        lane = self._lanes.get(key)
        if lane is None or lane.peer is not go.peer:
            lane = self._lanes[key] = self._new_lane(go, part, req.op, transport, digests)
        if lane.lane is None or lane.table is None:
            return False
        # the ids' range is checked by the lane's kernel (a refused post names the id); a
        # digest lane's kernel finds the hold's rows on its producer's board by its generation
        rids = req.remote_ids
        generation = 0
        if digests:
            if not self._boarded(req, go):
                return False
            generation = go.generation
        part.t_post = time.perf_counter()
        handle = (lane.lane.post(req.local_ids, rids, generation, self.integrity.sampling)
                  if signal is None else lane.lane.post(req.local_ids, rids, signal=signal))
        if handle is None:
            return False
        req.signalled = signal is not None
        req.phases.plan += part.t_post - t0
        part.handle = handle
        part.fusing = digests
        part.plan = self._moved(lane.table, int(rids.shape[0]))
        self._posted(req, part, go, part.plan.nbytes)
        return True

    @staticmethod
    def _moved(table: PlanTable, blocks: int) -> Moved:
        """What a lane's post of ``blocks`` block pairs of ``table`` moves."""
        return Moved(blocks * table.unit * table.segments, blocks * table.segments,
                     table.raw_count(blocks))

    def _new_lane(self, go: _Go, part: _Part, op: Op, transport: Transport,
                  digests: bool) -> _PeerLane:
        """A peer's lane for ``part``'s heads (kept while the peer's handshake is: a new one
        is a new key), its kernel digesting what it lands or not, or one that says it has
        none."""
        if len(self._lanes) > 1024:
            self._lanes.clear()
        # a new lane: a peer handshaken (anew); those of dropped peers go, with what they
        # hold (the peer's board mapping, its registration with a device)
        live = {id(p) for p in self.peers.live()}
        self._lanes = {k: v for k, v in self._lanes.items() if id(v.peer) in live}
        make = getattr(transport, "lane", None)
        ours = self._require_spec()
        try:
            table = PlanTable.for_peer(ours, go.peer.spec, part.read)
        except KVLinkError:  # an incompatible pair: the general path fails the part, saying why
            return _PeerLane(go.peer, None, None)
        if (make is None or table.path is not PlanPath.RUNS
                or getattr(transport, "coalesce_runs", True)):
            return _PeerLane(go.peer, None, table)
        fused = None
        if digests:
            fused = self._lane_digests(go, part.read, transport, ours)
            if fused is None:  # digested after the copy: the general path
                return _PeerLane(go.peer, None, table)
        lane = make(op, go.peer.agent, table.local_base, table.remote_base, table.unit,
                    (table.local.num_blocks, table.remote.num_blocks), fused)
        return _PeerLane(go.peer, lane, table)

    def _lane_digests(self, go: _Go, r: HeadRead, transport: Transport, spec: KVCacheSpec
                      ) -> LaneDigests | None:
        """What a digest lane to ``go``'s peer binds once: our views for its kernel and the
        producer's hold board, whose rows the kernel finds itself by each READ's generation
        (kvlink.holdboard.LAYOUT), so a READ with integrity on posts what one without does.
        None where its copy kernel cannot compare in place: no board shared with us, a
        transport that does not fuse, a head slice (unequal TP), views on no GPU."""
        board = go.peer.board
        if (board is None or not self.config.hold_board
                or not getattr(transport, "fuses_digests", False)
                or r.local_start or r.remote_start or r.count != spec.num_kv_heads):
            return None
        views = self.integrity.fused_views()
        if views is None:
            return None
        return LaneDigests(spec.page_bytes, *views, board.region, LAYOUT)

    def _signal(self, req: _Request, transport: Transport) -> Signal | None:
        """The landing signal a push's WRITE is posted with (kvlink.landing): only where the
        request is one part (the flag then follows every byte of it) on a transport that
        signals; the push's "written" note still follows, for every other case."""
        if req.landing is None or len(req.parts) != 1 or not getattr(transport, "signals",
                                                                       False):
            return None
        view, slot, tag = req.landing
        start, stop = req.layers or (0, self._require_spec().num_layers)
        return view.signal(slot, tag, start, stop)

    def _progress(self, req: _Request, part: _Part) -> None:
        assert part.go is not None and part.handle is not None
        transport = part.go.peer.transport
        state = transport.poll(part.handle)
        if state.status is XferStatus.PENDING:
            return
        handle, part.handle = part.handle, None
        part.t_done = time.perf_counter()
        ok = state.status is XferStatus.DONE
        if part.fusing and ok:  # the copy kernel digested what it landed, and compared
            got = transport.landed_check(handle)  # type: ignore[attr-defined]
            part.fused, part.fused_rows = got if got is not None else (None, 0)
        self._ledger.ended.append(_Spent(req, transport, handle, ok, part.t_post,
                                         part.t_done, part.post_seconds, part.nbytes,
                                         part.plan))
        failed = state.status is XferStatus.FAILED
        reason = f"{self._where(req, part)}: {state.reason}" if failed else ""
        if (failed and state.refused and req.generation is not None
                and part.t_post - req.t_start < self.config.intent_timeout
                and _on_wire(req.remote_ids)):
            # nothing moved: the producer had not held it yet (we were told the generation
            # first), or no longer does. Ask which (an intent answers with the generation);
            # nobody listening there any more fails it at once (live_only)
            part.failure, part.refused = reason, True
            part.verdict = self._ask(req, part, self._intent(req, part.go.peer.incarnation))
        elif failed and req.generation is not None and part.restarts < 2:
            # quiescent by contract. Nothing asked the producer before this READ, so it may
            # have restarted since our handshake: its answer to the release says ("stale":
            # READ again after a new handshake). A dead one fails it at once where nobody
            # listens at its port (a restart that gave us our params listens already), else
            # within the report timeout
            part.failure = reason
            part.verdict = self._ask(req, part, self._read_done(req, part, False),
                                     min(2.0, self.config.handshake_timeout))
        elif failed:  # quiescent by contract: safe to report
            self._part_failed(req, part, reason)
        elif req.op is Op.READ and part.go.generation:
            shown = part.check is not None and part.check()
            checking = self.integrity.on
            matched = shown and checking and part.fused == -1
            digests = (self._board_digests(req, part.go)
                       if shown and checking and not matched else None)
            if shown and (matched or digests is not None or not checking):
                self._held_throughout(req, part, part.fused_rows if matched else 0)
                if digests is None:
                    part.done = True
                else:
                    self._check_landed(req, part, digests)
            else:  # not on the board, or its digests not there: the verdict says (and has them)
                part.verdict = self._report_read(req, part, True)
        else:
            part.done = True

    def _held_throughout(self, req: _Request, part: _Part, rows: int) -> None:
        """A READ still held now that it is over: intact (kvlink.holdboard), counted so. The
        report only lets the producer count us done: nobody waits for its answer, and it
        leaves with a later poll's frame, off this request's path (_tell_later). ``rows``:
        the digest rows its copy kernel found equal to the hold's (what landed digests like
        the hold), counted as checked on the device."""
        self.board_validated += 1
        self._tell_later(functools.partial(self._tell_read_done, req, part))
        if rows:
            self.integrity.checked_blocks += rows
            self.integrity.fused_blocks += rows

    def _digest_job(self, req: _Request, part: _Part, transport: Transport,
                    spec: KVCacheSpec) -> DigestJob | None:
        """With integrity on, a same-host READ of every head through a transport that digests
        while it copies, posted the general way (no lane): the job for its copy kernel, which
        compares what it lands with the digest rows on the producer's hold board in place
        (valid once the READ is seen still held after it); None: digest on the host after
        the copy."""
        go = part.go
        if go is None or not self._boarded(req, go) or self._lane_digests(
                go, part.read, transport, spec) is None:
            return None
        # the hold's rows by its generation alone: the block ids' fingerprint is compared by
        # the after-check, as without integrity, and a hold over other blocks fails the READ
        # whatever digests it showed
        assert go.peer.board is not None
        on_board = board_rows(go.peer.board, go.generation)
        if on_board is None or on_board.blocks != len(req.remote_ids):
            return None
        return self.integrity.fused_job(on_board, spec.page_bytes)

    def _boarded(self, req: _Request, go: _Go) -> bool:
        """Whether this READ will be validated on the producer's hold board: one is open (with
        integrity on, the hold's digests are there too, or the verdict brings them)."""
        return (self.config.hold_board and go.peer.board is not None and req.op is Op.READ
                and bool(go.generation))

    @staticmethod
    def _board_digests(req: _Request, go: _Go) -> Digests | None:
        """The digests the producer published with the hold we just read (None: ask)."""
        board = go.peer.board
        if board is None:
            return None
        if req.fingerprint is None:
            req.fingerprint = fingerprint(req.remote_ids)
        raw = board.digests(go.generation, req.fingerprint)
        return unpack(raw) if raw is not None else None

    @staticmethod
    def _notes_natively(req: _Request) -> bool:
        """A WRITE's "written" rides on the WRITE itself only when it is one transfer through
        a transport with native notifications; else it goes over the side channel once every
        part is DONE (a note after one part would claim bytes still moving)."""
        part = req.parts[0]
        return (req.op is Op.WRITE and len(req.parts) == 1 and req.lease is None
                and req.digests is None and req.layered is None and part.go is not None
                and part.go.peer.transport.capabilities.native_notifications)

    def _take_verdict(self, req: _Request, part: _Part) -> None:
        assert part.verdict is not None
        if not part.verdict.done():
            return
        pending, part.verdict = part.verdict, None
        if part.refused:
            self._take_requery(req, part, pending)
            return
        try:
            reply = pending.result()
        except KVLinkError as exc:
            if part.failure is not None and getattr(exc, "code", "") != "stale":
                part.error = part.failure  # the producer did not restart: the READ failed
                return
            part.failure = None
            if req.generation is not None and self._again(req, part, exc, pending.asked):
                if getattr(exc, "code", "") == "not_yet":  # held on its next step: ask again
                    part.reask = True
                else:  # restarted under the READ: READ again after the new handshake
                    self._read_again(req, part)
                return
            reply, why = None, f"no verdict ({exc})"
        if part.failure is not None:  # released by that report: the READ failed
            part.error = part.failure
            return
        if isinstance(reply, wire.ReadVerdict) and reply.intact:
            self._check_landed(req, part, (reply.digest_ids, reply.digests, reply.folded))
            return
        if isinstance(reply, wire.ReadVerdict):
            why = reply.reason
        elif reply is not None:
            why = f"answered {type(reply).__name__}"
        part.error = (f"{req.remote.engine_id} rank {part.read.remote_rank}: READ not "
                      f"confirmed, its bytes are not trusted: {why}")

    def _check_landed(self, req: _Request, part: _Part, digests: Digests) -> None:
        """An intact READ: with integrity on, its bytes count only if they digest like the
        producer's ``digests`` (the heads this part read; kvlink.integrity)."""
        spec = self._require_spec()
        r = part.read
        ids, blob, folded = digests
        why = self.integrity.check(req.req_id, req.local_ids, req.remote_ids,
                                   (r.local_start, r.remote_start, r.count),
                                   ids, blob, folded, spec.num_layers, spec.num_kv)
        if why is None and part.fused is not None and part.fused >= 0:
            self.integrity.failures += 1
            why = (f"integrity: the copy kernel's digest of {req.req_id} (row {part.fused}) "
                   "differed from the producer's: not trusted")  # fail closed
        if why is None:
            part.done = True
            return
        log.warning("request %s from %s rank %d: %s", req.req_id, req.remote.engine_id,
                    r.remote_rank, why)
        part.error = why

    def _take_requery(self, req: _Request, part: _Part, pending: Pending) -> None:
        """The owner refused our READ before any byte moved, and we asked whether it holds
        the request: under our generation → READ again (it held after we posted: we were told
        the generation first); not yet → READ again shortly; restarted → after a handshake;
        anything else → the hold is gone, fail."""
        failure, part.refused = part.failure or "refused", False
        part.failure = None
        try:
            reply = pending.result()
        except KVLinkError as exc:
            if self._again(req, part, exc, pending.asked):
                self._read_again(req, part)
            elif getattr(exc, "code", "") == Refusal.BLOCKS.value:  # held, but not those:
                self._part_failed(req, part, f"{failure}; {exc}")  # release it now
            else:
                part.error = f"{failure}; and asked: {exc}"
            return
        assert part.go is not None
        if isinstance(reply, wire.ReadGrant) and reply.generation == part.go.generation:
            self._read_again(req, part)
        else:
            part.error = f"{failure}: the hold it was told ended before its READ"

    @staticmethod
    def _read_again(req: _Request, part: _Part) -> None:
        req.nbytes -= part.nbytes
        part.go, part.plan, part.nbytes, part.check = None, None, 0, None
        part.fusing, part.fused, part.fused_rows = False, None, 0

    def _part_failed(self, req: _Request, part: _Part, reason: str) -> None:
        """A part ends without bytes: for a READ with a generation, release the producer now."""
        part.error = reason
        if part.handle is not None:
            return  # still moving: report once the transport says FAILED (quiescent)
        if req.op is Op.READ and part.go is not None and part.go.generation:
            self._tell(req.remote.host, req.remote.port + part.read.remote_rank,
                       self._read_done(req, part, False))

    def _read_done(self, req: _Request, part: _Part, ok: bool) -> wire.ReadDone:
        assert part.go is not None
        return wire.ReadDone(v=WIRE_VERSION, engine_id=self.config.engine_id,
                             req_id=req.req_id, tp_rank=self.config.tp_rank,
                             tp_size=self.config.tp_size, incarnation=part.go.peer.incarnation,
                             generation=part.go.generation, ok=ok,
                             block_ids=(req.remote_ids.tolist() if req.generation is not None
                                        and (ok or _on_wire(req.remote_ids)) else None))

    def _tell_read_done(self, req: _Request, part: _Part) -> None:
        """A READ validated on the hold board: the producer may count us done."""
        self._tell(req.remote.host, req.remote.port + part.read.remote_rank,
                   self._read_done(req, part, True), quiet=True)

    def _report_read(self, req: _Request, part: _Part, ok: bool) -> Pending:
        """The READ's report, whose answer validates it."""
        return self._ask(req, part, self._read_done(req, part, ok))

    def _intent(self, req: _Request, incarnation: int) -> wire.ReadIntent:
        """The read intent for ``req``'s blocks, to the producer incarnation we handshook
        with: the generation's question before a READ, and after a failed one."""
        return wire.ReadIntent(v=WIRE_VERSION, engine_id=self.config.engine_id,
                               req_id=req.req_id, tp_rank=self.config.tp_rank,
                               incarnation=incarnation, block_ids=req.remote_ids.tolist())

    def _ask(self, req: _Request, part: _Part, msg: wire.Request,
             timeout: float | None = None) -> Pending:
        """A question to the producer rank ``part`` READs. Only the process that held (or
        holds) the blocks can answer it, so where nobody listens at its port any more it
        fails at once (``live_only``, :meth:`kvlink.channel.Channels.call`)."""
        return self._send(req.remote.host, req.remote.port + part.read.remote_rank, msg,
                          timeout, live_only=True)

    # ------------------------------------------------------------------ a WRITE's notes
    def _written(self, req: _Request, ok: bool, detail: str = "") -> wire.Notification:
        push = req.push
        got = req.digests
        ids, blob, folded = (got if ok and got is not None and not isinstance(got, RangeDigests)
                             else ([], b"", False))
        return self._note(push.req_id if push is not None else req.req_id,
                          push.push_id if push is not None else 0, ok=ok, detail=detail,
                          digest_ids=ids, digests=blob, folded=folded)

    def _note(self, req_id: str, push_id: int, kind: str = "write", ok: bool = True,
              detail: str = "", **fields: Any) -> wire.Notification:
        """A push's note from this rank to the decode ("write": written or why not;
        "layers": a range of a layer-wise push landed)."""
        return wire.Notification(v=WIRE_VERSION, engine_id=self.config.engine_id,
                                 req_id=req_id, tp_rank=self.config.tp_rank,
                                 tp_size=self.config.tp_size, kind=kind, ok=ok,
                                 detail=detail[:500], push_id=push_id, **fields)

    def _slice(self, spec: KVCacheSpec, start: int, stop: int) -> KVCacheSpec:
        """``spec.layers(start, stop)``, the same object each time (the planner's tables are
        cached by spec identity); kept with the spec it came from, so an id is never reused."""
        key = (id(spec), start, stop)
        got = self._slices.get(key)
        if got is None or got[0] is not spec:
            if len(self._slices) > 4096:
                self._slices.clear()
            got = self._slices[key] = (spec, spec.layers(start, stop))
        return got[1]


def _on_wire(ids: npt.NDArray[np.int64]) -> bool:
    """Whether block ids are ones the wire carries: a READ launched on a route leaves their
    range to the device, which fails it naming an id outside its cache — whose report must
    then not carry that id (the producer's strict decoder refuses the whole frame it is in,
    other requests' messages with it). A failed READ's report needs none of them."""
    return not ids.size or int(ids.view(np.uint64).max()) <= wire.MAX_BLOCK_ID
