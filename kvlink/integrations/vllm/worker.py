"""Worker side of the vLLM connector: one TP rank's pulls, pushes and holds, on the core.

No vLLM import; never decides policy (the scheduler's plan says which requests to hold, pull or
have pushed), and owns no block-ownership rules of its own: holds, read grants, validate after
read, push cancel and ack all live in :class:`kvlink.worker.KVWorker` and
:class:`kvlink.leases.BlockLeases` (see their docstrings). What is left here is vLLM's side:

Producer (prefill) rank: holds each finished request's (kernel) blocks with ``KVWorker.hold``,
reports "finished sending" when the core releases it (every reader done, lease expired,
aborted). Push requests are served from the held blocks (``KVWorker.push(..., lease=...)``:
the WRITE runs under the lease like a READ); one that arrives before the hold (the proxy got the
prefill's answer before this worker's next step) waits up to ``read_intent_timeout``; a refused
one is told to the decode, which fails the request at once. The layer-wise flow's streams
(held and written during the forward) are :class:`~.layerwise.LayerwisePushes`'.

Consumer (decode) rank: ``KVWorker.read`` (pull) or ``KVWorker.expect_push`` (push) for each
request in the step's plan; reports finished or failed requests. A failed one is recomputed or
failed by vLLM's ``kv_load_failure_policy``; finished always means the producer confirmed the
bytes (pull) or every prefill rank wrote them (push).

Before a READ is started it is checked against what the params say (vLLM 0.33's
NixlConnector keys): not after the prefill's lease deadline (``remote_blocks_expiry_time``,
rebased onto this clock), and only over a handshake with the prefill incarnation that held the
request (``remote_registration_generation`` / ``kvlink_incarnations``): a cached handshake of
another one is dropped and made again (``PeerTable.forget_stale``, as the core does for a
"stale" answer); a fresh handshake that still answers another one means the prefill
restarted since, and the receive fails naming both values.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import math
import time

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.errors import ConfigError, KVLinkError
from kvlink.headmap import map_heads
from kvlink.integrations.vllm.config import Settings
from kvlink.integrations.vllm.layerwise import LayerwisePushes
from kvlink.integrations.vllm.layout import expand_blocks
from kvlink.integrations.vllm.metadata import RecvReq, Remote, StepPlan
from kvlink.integrity import Planes
from kvlink.layout import KVCacheSpec
from kvlink.peers import Peer
from kvlink.transport import Op
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

log = logging.getLogger("kvlink.vllm")


@dataclasses.dataclass
class _Recv:
    req: RecvReq
    local: npt.NDArray[np.int64]
    t0: float
    ranks: frozenset[int] = frozenset()  # the prefill ranks it reads from


@dataclasses.dataclass
class _Gate:
    """A pull whose READ waits until its handshakes are known to be with the prefill
    incarnation the params name, and that is never started after the lease deadline."""

    req: RecvReq
    local: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    ranks: tuple[int, ...]
    deadline: float  # time.monotonic(); inf: none known
    #: the handshake of each rank, asked for once (PeerTable.get would retry a failed one)
    futs: dict[int, cf.Future[Peer]] = dataclasses.field(default_factory=dict)
    redone: set[int] = dataclasses.field(default_factory=set)  # ranks handshaken again


_WAIT = "wait"  # a gate's handshakes are not settled yet
#: a synchronous load's outcome as :meth:`PullWorker.take_synced` reports a failed one (a
#: loaded one: the seconds from its READ's start to its bytes seen landed, >= 0)
SYNC_FAILED = -1.0


@dataclasses.dataclass
class Results:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: dict[str, str] = dataclasses.field(default_factory=dict)
    failed_blocks: set[int] = dataclasses.field(default_factory=set)  # scheduler block ids
    #: the blocks of synchronous loads that failed (vLLM's invalid block ids, every version)
    invalid_blocks: set[int] = dataclasses.field(default_factory=set)


def _engine(remote: Remote) -> RemoteEngine:
    return RemoteEngine(remote.engine_id, remote.host, remote.port, remote.tp_size)


class PullWorker(LayerwisePushes):
    def __init__(self, settings: Settings, tp_rank: int, tp_size: int, dp_rank: int = 0,
                 block_ratio: int = 1) -> None:
        self.s = settings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.block_ratio = block_ratio
        self.worker: KVWorker | None = None
        self.spec: KVCacheSpec | None = None
        self.counters: dict[str, float] = {}
        self.durations: list[float] = []
        # producer: push requests that arrived before their hold, with their wait deadline
        self._push_waiting: list[tuple[wire.PushRequest, float]] = []
        self._writes: set[str] = set()  # push keys in flight
        self._done_sending: set[str] = set()
        # consumer: local request id -> receive; the core knows it by the remote request id
        self._recv: dict[str, _Recv] = {}
        self._remote_to_local: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self._failed_blocks: set[int] = set()
        self._finished: set[str] = set()
        # synchronous loads settled (request -> seconds, or SYNC_FAILED) and the blocks of
        # those that failed
        self._synced: dict[str, float] = {}
        self._invalid: set[int] = set()
        self._idle = False  # the current step runs no forward pass (see start)
        self._port = settings.rank_port(dp_rank, tp_size)
        self._refused_seen = 0
        self._gates: list[_Gate] = []
        self._told = False  # releases queued in the core: they leave with its next poll
        # (engine, host, rank port) -> incarnations proven gone: a newer handshake at that
        # address answered another one (params naming them fail at once)
        self._gone: dict[tuple[str, str, int], set[int]] = {}
        # prefill, layer-wise flow (docs/layerwise.md): push key -> our request id (kept past
        # the release, bounded: a late push request is then refused naming why); the vLLM
        # layer name -> its kvlink layers; this forward's streams; requests held before they
        # finished (their release is reported only once the scheduler finished them too:
        # vLLM frees the blocks of a request it is told "finished sending")
        self._alias: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._layer_of: dict[str, tuple[int, int]] = {}
        self._streams = []  # this forward's (LayerwisePushes)
        self._early: set[str] = set()
        self._early_released: set[str] = set()
        self._finished_here: collections.OrderedDict[str, None] = collections.OrderedDict()

    def _count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ setup
    def worker_config(self) -> WorkerConfig:
        """The standalone worker's config this connector rank runs (from its Settings)."""
        return WorkerConfig(
            engine_id=self.s.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
            transports=list(self.s.transports),
            transport_options={k: dict(v) for k, v in self.s.transport_options.items()},
            host=self.s.host, advertise_host=self.s.advertise_host, side_port=self._port,
            handshake_timeout=self.s.handshake_timeout, serve=self.s.serves,
            secret=self.s.secret, allow_insecure=self.s.allow_insecure,
            lease_seconds=self.s.lease_seconds, read_seconds=self.s.pin_seconds,
            renew_limit=self.s.renew_limit,
            intent_timeout=self.s.intent_timeout, grants=self.s.grants,
            integrity=self.s.integrity, hold_board=self.s.hold_board,
            landing_board=self.s.landing_board, poll_grace_us=self.s.poll_grace_us,
            # any instance that serves readers serves pushes (a kv_consumer in push mode may
            # hold a do_remote_decode request too), whichever mode a decode asks in
            serve_pushes=self.s.serves)

    def register(self, spec: KVCacheSpec, planes: Planes | None = None) -> None:
        """``planes``: vLLM's own tensors as logical views, what integrity digests (so a
        wrong description of the cache is caught too); None: through ``spec``."""
        self.worker = KVWorker(self.worker_config())
        self.worker.hold_hook = self._hold_now
        self.worker.register(spec, planes)
        self.spec = self.worker.spec
        if self.s.consumer and self.s.mode == "push" and not any(
                Op.WRITE in t.capabilities.ops for t in self.worker.transports.values()):
            raise ConfigError(f"mode 'push' needs a transport that takes WRITEs; "
                              f"{sorted(self.worker.transports)} do not")

    def _w(self) -> KVWorker:
        if self.worker is None:
            raise KVLinkError("register_kv_caches has not run on this worker")
        return self.worker

    def _spec(self) -> KVCacheSpec:
        if self.spec is None:
            raise KVLinkError("register_kv_caches has not run on this worker")
        return self.spec

    # ------------------------------------------------------------------ producer
    def _hold(self, plan: StepPlan) -> None:
        for r in plan.send:
            self._mark_finished(r.req_id)
            self._take_hold(r.req_id, r.block_ids, r.generation)
        for rid in plan.aborted:  # a layer-wise candidate that did not finish normally
            self._mark_finished(rid)
            if self._w().leases.is_held(rid):
                self._w().abort(rid)  # its streams fail "not intact"; released, then reported
            elif rid not in self._early and rid not in self._early_released:
                self._done_sending.add(rid)  # never held here: nothing to wait for

    def _hold_now(self, msg: wire.Hold) -> None:
        """The scheduler's hold, sent the moment it kept the blocks (side channel thread):
        the decode's READ report need not wait for this engine's next step."""
        self._take_hold(msg.req_id, tuple(msg.block_ids), msg.generation)

    def _take_hold(self, req_id: str, block_ids: tuple[int, ...], generation: int) -> None:
        """Hold once, whichever of the step's plan and the scheduler's message comes first."""
        w = self._w()
        try:
            w.hold(req_id, expand_blocks(block_ids, self.block_ratio),
                   generation=generation or None)
        except ValueError:  # held already: by the other path (same generation), or a bug
            if generation and generation in (w.leases.generation_of(req_id),
                                             w.leases.released_generation(req_id)):
                return  # the same hold, delivered twice (or late, after its release)
            log.warning("request %s is already held; ignoring a second hold", req_id)

    def _collect_released(self) -> None:
        for r in self._w().released():
            if r.req_id in self._early:
                self._early.discard(r.req_id)
                self._early_released.add(r.req_id)
            else:
                self._done_sending.add(r.req_id)
            self._count("send_expired_requests" if r.why == "expired" else
                        "send_aborted_requests" if r.why == "aborted" else "send_done_requests")

    def _serve_pushes(self) -> None:
        """WRITE the push requests whose request is held; park those that came too early."""
        w = self._w()
        self._take_push_requests()
        now = time.monotonic()
        todo, self._push_waiting = self._push_waiting, []
        for msg, deadline in todo:
            rid = self._alias.get(msg.req_id, msg.req_id)
            held = w.leases.held_blocks(rid)
            why: str | None = None
            if held is None:
                gone = w.leases.released_why(rid)
                if gone is None and now < deadline:
                    self._push_waiting.append((msg, deadline))
                    continue
                why = (f"request {msg.req_id} is no longer held: {gone}" if gone else
                       f"request {msg.req_id} was not held within "
                       f"{max(self.s.intent_timeout, msg.ttl_ms / 1e3):.0f}s of the push "
                       "request")
            elif not 0 < len(msg.block_ids) <= len(held):
                why = (f"{len(msg.block_ids)} blocks asked for but {len(held)} are held for "
                       f"{msg.req_id}")
            if why is None and held is not None:
                # the consumer's blocks hold the prompt's tail (a local prefix hit is not
                # sent), so they match our last len(block_ids) blocks, as a pull reads them
                try:
                    self._writes.add(w.push(msg, held[len(held) - len(msg.block_ids):],
                                            lease=rid))
                    continue
                except KVLinkError as exc:
                    why = str(exc)
            why = why or "refused"
            self._count("pushes_refused")
            log.warning("refused a push of %s to %s/%d: %s", msg.req_id, msg.engine_id,
                        msg.tp_rank, why)
            w.refuse_push(msg, why)

    def _take_push_requests(self) -> None:
        """Decode ranks' push requests, parked until their request is held. Where a router
        asks both sides at once (the layer-wise flow, vLLM 0.33's push proxy) they come
        before the prefill even computed it: they wait up to their own time to live (the
        decode's push_timeout), not just ``read_intent_timeout``."""
        now = time.monotonic()
        for m in self._w().push_requests():
            wait = max(self.s.intent_timeout, m.ttl_ms / 1e3)
            self._push_waiting.append((m, now + wait))

    # ------------------------------------------------------------------ consumer
    def _start_recv(self, r: RecvReq) -> None:
        spec = self._spec()
        if r.refused:  # the scheduler's verdict (parallel layout, lease over): move nothing
            self._give_up(r, r.refused)
            return
        if r.remote.request_id in self._remote_to_local or any(
                g.req.remote.request_id == r.remote.request_id for g in self._gates):
            self._fail(r, f"remote request {r.remote.request_id} is already being read by "
                       "another request")
            return
        local = expand_blocks(r.local_block_ids, self.block_ratio)
        n = len(r.local_block_ids)
        if r.push and not r.remote.block_ids:
            # the layer-wise flow: we ask before the prefill computed, so its block ids are
            # not known here (and not needed: it WRITEs from its own blocks into ours)
            self._begin(r, local, local, (), math.inf if r.expires_in is None
                        else time.monotonic() + r.expires_in)
            return
        if n > len(r.remote.block_ids):
            self._fail(r, f"{n} local blocks but the prefill offers only "
                       f"{len(r.remote.block_ids)}")
            return
        ours = self.block_ratio * spec.block_size
        if r.remote.block_size not in (0, ours):  # (told before its ids are expanded by it)
            self._fail(r, f"block sizes differ: local {ours} vs remote "
                       f"{r.remote.block_size} tokens (pages of {spec.block_size})")
            return
        remote_ids = expand_blocks(r.remote.block_ids[len(r.remote.block_ids) - n:],
                                   self.block_ratio)
        try:
            reads = map_heads(self.tp_size, self.tp_rank, r.remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        except KVLinkError as exc:
            self._fail(r, str(exc))
            return
        ranks = tuple(sorted({h.remote_rank for h in reads}))
        # rebased onto our clock on arrival: later than the scheduler saw it, never earlier
        deadline = (math.inf if r.expires_in is None
                    else time.monotonic() + r.expires_in)
        if r.push or (deadline == math.inf and not r.remote.registration
                      and not r.remote.incarnations):
            self._begin(r, local, remote_ids, ranks, deadline)
        else:  # checked against the params before its READ (see _gate_verdict)
            self._gates.append(_Gate(r, local, remote_ids, ranks, deadline))
            self._open_gates()

    def _begin(self, r: RecvReq, local: npt.NDArray[np.int64],
               remote_ids: npt.NDArray[np.int64], ranks: tuple[int, ...],
               deadline: float) -> None:
        """Hand the receive to the core: the READ is posted inside ``read`` (cached peers), a
        push is asked for with at most the lease's remaining time to live."""
        left = deadline - time.monotonic()
        if left <= 0:
            self._give_up(r, self._expired(r, -left))
            return
        try:
            if r.push:  # the PushRequest goes out on the worker's thread: this never blocks
                # the prefill never WRITEs after the push's time to live: not after its lease
                # (live: the params are the prefill's answer, as for a READ below)
                self._w().expect_push(r.remote.request_id, _engine(r.remote), local,
                                      timeout=min(self.s.push_timeout, left), live=True,
                                      generation=r.remote.generation or None)
            else:
                # (the params are the prefill's answer: it was serving, so nobody listening
                # there now means it is gone)
                self._w().read(r.remote.request_id, _engine(r.remote), local, remote_ids,
                               generation=r.remote.generation or None, live=True)
        except KVLinkError as exc:
            self._fail(r, str(exc))
            return
        self._recv[r.req_id] = _Recv(r, local, time.perf_counter(), frozenset(ranks))
        self._remote_to_local[r.remote.request_id] = r.req_id

    @staticmethod
    def _expired(r: RecvReq, late: float) -> str:
        return (f"remote_blocks_expiry_time of {r.remote.engine_id}'s request "
                f"{r.remote.request_id} passed {late:.3f}s before the READ could start (the "
                "prefill's lease of the blocks is over): not started")

    # ------------------------------------------------------------------ consumer: gates
    def _open_gates(self) -> None:
        """Start the READs whose handshakes are settled and match the params; fail those past
        their deadline or of a prefill incarnation that is gone."""
        for gate in list(self._gates):
            verdict = self._gate_verdict(gate)
            if verdict == _WAIT:
                continue
            self._gates.remove(gate)
            if verdict:
                self._give_up(gate.req, verdict)
            else:
                self._begin(gate.req, gate.local, gate.remote_ids, gate.ranks, gate.deadline)

    def _gate_verdict(self, gate: _Gate) -> str:
        """Empty (go), :data:`_WAIT`, or why the receive fails."""
        late = time.monotonic() - gate.deadline
        if late >= 0:
            return self._expired(gate.req, late)
        remote = _engine(gate.req.remote)
        for rank in gate.ranks:
            fut = gate.futs.get(rank)
            if fut is None:  # starts the handshake if none is cached (the prefill that made
                # the params was serving: nobody listening there now means it is gone)
                fut = gate.futs[rank] = self._w().peers.get(remote, rank, live=True)
            if not fut.done():
                return _WAIT
            exc = fut.exception()
            if exc is not None:
                return f"handshake with {remote.engine_id} rank {rank} failed: {exc}"
            verdict = self._check_incarnation(gate, rank, fut)
            if verdict:
                return verdict
        return ""

    def _check_incarnation(self, gate: _Gate, rank: int, fut: cf.Future[Peer]) -> str:
        """Empty if the handshake with ``rank`` is with the incarnation the params name (or
        they name none); :data:`_WAIT` after dropping a cached handshake of another one (once,
        and only while no receive of ours runs over it); else why the receive fails."""
        want = gate.req.remote.incarnation_of(rank)
        have = fut.result().incarnation
        if want is None or not have or want == have:
            return ""
        remote = _engine(gate.req.remote)
        key = (remote.engine_id, remote.host, remote.port + rank)
        gone = self._gone.setdefault(key, set())
        if rank not in gate.redone and want not in gone:
            if any(rec.req.remote.engine_id == remote.engine_id and rank in rec.ranks
                   and rec.req.remote.host == remote.host and rec.req.remote.port == remote.port
                   for rec in self._recv.values()):
                return _WAIT  # never tear a handshake down under our own READs
            log.info("%s rank %d: the params of %s name incarnation %d, our handshake is with "
                     "%d: handshaking again", remote.engine_id, rank, gate.req.req_id, want, have)
            self._w().peers.forget_stale(remote, rank, fut)
            gate.futs[rank] = self._w().peers.get(remote, rank)
            gate.redone.add(rank)
            return _WAIT
        gone.add(want)
        return (f"the kv_transfer_params name {remote.engine_id} rank {rank}'s registration "
                f"(remote_registration_generation / kvlink_incarnations) {want}, but it "
                f"answers the handshake as incarnation {have}: the prefill restarted since it "
                f"held request {gate.req.remote.request_id}, whose blocks are gone")

    def _give_up(self, req: RecvReq, reason: str) -> None:
        """Fail a receive before anything moved, and release the prefill's hold on it now
        (as a failed pull does) rather than at its lease's end."""
        self._fail(req, reason)
        try:
            self._w().release(req.remote.request_id, _engine(req.remote),
                              generation=req.remote.generation or None)
            self._told = True
        except KVLinkError as exc:
            log.info("could not release %s at %s: %s", req.remote.request_id,
                     req.remote.engine_id, exc)

    def _fail(self, req: RecvReq, reason: str) -> None:
        log.warning("loading KV of request %s failed: %s", req.req_id, reason)
        if req.sync:  # its request runs this step: vLLM learns it by the blocks
            self._synced[req.req_id] = SYNC_FAILED
            self._invalid.update(req.local_block_ids)
        else:
            self._failed[req.req_id] = reason
            self._failed_blocks.update(req.local_block_ids)
        self._count("recv_failed_requests")

    def _poll(self, grace: bool = False) -> None:
        """Advance every transfer of this rank; route the results (a ``kv_both`` rank may have
        pulls, awaited pushes and its own WRITEs in flight at once). ``grace``: the core's poll
        may wait for a copy about to end (``poll_grace_us``) — only where the step hands its
        results to vLLM next (:meth:`results`), never before a forward, which it would hold
        up for a copy that ends during the forward anyway."""
        w = self._w()
        before = w.finished_bytes
        self._told = False  # the core's poll sends what is queued
        done, failed = w.poll(grace=grace)
        self._told = w.reports_owed > 0  # the requests it just reported owe their producers
        for key in self._writes & (done | set(failed)):
            self._writes.discard(key)
            self._count("push_sent_requests" if key in done else "push_failed_requests")
        self._count("recv_bytes", w.finished_bytes - before)
        for rid in done:
            rec = self._take(rid)
            if rec is None:
                continue
            if rec.req.sync:
                self._synced[rec.req.req_id] = time.perf_counter() - rec.t0
            else:
                self._finished.add(rec.req.req_id)
            self._count("recv_requests")
            self._count("recv_blocks", rec.local.shape[0])
            if rec.req.push:  # our side posted nothing: count the bytes written into us
                self._count("recv_pushed_requests")
                self._count("recv_bytes", rec.local.shape[0] * self._spec().block_bytes)
            self.durations.append(time.perf_counter() - rec.t0)
        for rid, reason in failed.items():
            rec = self._take(rid)
            if rec is not None:
                self._fail(rec.req, reason)

    def _take(self, remote_req_id: str) -> _Recv | None:
        local_id = self._remote_to_local.pop(remote_req_id, None)
        return self._recv.pop(local_id, None) if local_id is not None else None

    # ------------------------------------------------------------------ every step
    def start(self, plan: StepPlan, idle: bool = False) -> None:
        """Called once per step with the scheduler's plan (from start_load_kv).

        ``idle``: the step runs no forward pass. vLLM steps in a tight loop while a request
        waits for its KV or a finished one holds blocks, and that loop would keep the GIL from
        the threads doing the work (side channel answers, transport I/O): an idle step with
        transfers outstanding yields up to ``idle_yield_s`` to let them run, ending early when
        a receive finishes (:meth:`_yield`).
        """
        if self.worker is None:
            return
        self._idle = idle
        if idle and self.s.idle_yield_s > 0 and self.pending():
            self._yield(self.s.idle_yield_s)
        self._hold(plan)
        if self.s.serves:
            self._serve_pushes()  # a push that waited for this step's hold starts now
        self._open_gates()  # handshakes that settled since the last step
        for r in plan.recv:
            self._start_recv(r)
        for remote in plan.release:
            self._w().release(remote.request_id, _engine(remote),
                              generation=remote.generation or None)
            self._told = True
        for renewal in plan.renew:  # requests still in our queue: their leases
            try:
                self._w().renew(list(renewal.request_ids), _engine(renewal.remote))
            except KVLinkError as exc:  # (a bad id: its request fails at its READ instead)
                log.warning("could not renew %d lease(s) of %s: %s",
                            len(renewal.request_ids), renewal.remote.engine_id, exc)
            self._told = True
        if self._recv or self._writes or self._told:
            self._poll()
        sync = {r.req_id for r in plan.recv if r.sync}
        if sync:
            self._settle(sync)

    def _settle(self, req_ids: set[str]) -> None:
        """Wait until every synchronous load of this step is finished or failed: the forward
        that follows reads their blocks. Nothing is given up early: a READ reported failed has
        nothing of it left to land (the core's rule), and vLLM recomputes into the blocks of
        a failed one, so a timeout here would let a late byte overwrite that. What bounds the
        wait is the core's: a dead peer fails its READ, an unanswered one fails at its
        report timeout; the scheduler asks for one only from a prefill whose last load
        finished (:meth:`PullScheduler._loads_in_step`)."""
        t0 = time.perf_counter()
        said = t0 + 1.0  # then every 10 s, each time saying where every load stands
        while True:
            self._open_gates()
            self._poll(grace=True)
            if all(r in self._synced for r in req_ids):
                break
            self._w().wait(0.0002)  # (GIL released: transport and side-channel threads run)
            now = time.perf_counter()
            if now > said:
                said = now + 10.0
                log.warning("the forward has waited %.0f s for synchronous load(s) to settle "
                            "(sync_load_tokens; still waiting): %s", now - t0,
                            " | ".join(self._where(r) for r in sorted(req_ids)
                                       if r not in self._synced))
        self._count("sync_wait_seconds", time.perf_counter() - t0)

    def _where(self, req_id: str) -> str:
        """Where one of this worker's loads stands, for a log (KVWorker.explain)."""
        gate = next((g for g in self._gates if g.req.req_id == req_id), None)
        if gate is not None:
            return (f"{req_id}: its READ waits for the handshakes with prefill ranks "
                    f"{list(gate.ranks)} of the incarnation its params name")
        rec = self._recv.get(req_id)
        if rec is None:
            return f"{req_id}: not started"
        got = self._w().explain(rec.req.remote.request_id)
        return f"{req_id}: {got or 'ended; its outcome not taken yet'}"

    def take_synced(self) -> dict[str, float]:
        """The synchronous loads settled since the last call: request -> the seconds it took
        (its READ's start to its bytes seen landed: what the scheduler sizes the next ones
        by), or :data:`SYNC_FAILED`."""
        out, self._synced = self._synced, {}
        return out

    def results(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> Results:
        """What finished since the last call (from get_finished / get_transfer_results);
        ``finished_req_ids``: the requests vLLM says finished (its argument to those)."""
        out = Results()
        if self.worker is None:
            return out
        if self.s.serves:  # any instance whose workers serve readers holds (not the role)
            self._serve_pushes()
            self._collect_released()
            self._report_early(finished_req_ids)
            out.finished_sending, self._done_sending = self._done_sending, set()
        self._open_gates()
        if self._recv or self._writes or self._told:
            self._poll(grace=True)
            if self._idle and self.s.idle_yield_s > 0 and self._recv:
                # a READ posted this step often lands within a millisecond: report it with
                # this step rather than a whole engine round trip later
                self._yield(self.s.idle_yield_s)
        out.finished_recving, self._finished = self._finished, set()
        out.failed_recving, self._failed = self._failed, {}
        out.failed_blocks, self._failed_blocks = self._failed_blocks, set()
        out.invalid_blocks, self._invalid = self._invalid, set()
        out.finished_recving |= set(out.failed_recving)
        return out

    def pending(self) -> int:
        w = self.worker
        held = w.leases.stats.held if w is not None else 0
        return (len(self._recv) + len(self._writes) + len(self._push_waiting) + held
                + len(self._gates) + len(self._early_released))

    def _yield(self, seconds: float) -> None:
        """An idle step's yield: up to ``seconds`` with the GIL released, polling at least every
        0.2 ms and as soon as a side-channel answer arrives (a READ's verdict), ended early by a
        finished or failed receive."""
        deadline = time.perf_counter() + seconds
        while (left := deadline - time.perf_counter()) > 0:
            self._w().wait(min(left, 0.0002))
            self._open_gates()
            if self._recv or self._writes:
                self._poll()
            if self._finished or self._failed:
                return

    def take_stats(self) -> tuple[dict[str, float], list[float]]:
        c, self.counters = self.counters, {}
        if self.worker is not None:  # READs the core refused (released, blocks not held)
            refused = self.worker.leases.stats.reads_refused
            if refused > self._refused_seen:
                c["reads_refused"] = refused - self._refused_seen
            self._refused_seen = refused
        d, self.durations = self.durations, []
        return c, d

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
