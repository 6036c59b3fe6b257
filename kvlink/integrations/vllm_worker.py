"""Worker side of the vLLM connector: one TP rank's pulls, pushes, leases and read checks.

No vLLM import; never decides policy (the scheduler's plan says which requests to hold, pull or
have pushed).

Producer (prefill) rank: holds each finished request's blocks in a :class:`BlockLeases` lease,
frees them (reports "finished sending") when every expected reader has notified or the lease
expires, and answers *read intents*: before a consumer posts a READ it asks this rank whether the
request is still held. A request that is not held any more (expired, read, aborted) is refused,
so a late reader can never copy blocks that may already hold another request's KV. An accepted
intent pins the request until the reader's notification (or ``pin_seconds``), so the lease cannot
expire under a READ in flight.

Consumer (decode) rank: for each request in the step's plan, sends the read intent(s), then
``KVWorker.read`` (handshake, plan, post, poll), and reports finished or failed requests.

Push mode (the plan marks a request ``push``): the consumer rank calls ``KVWorker.expect_push``
with the blocks vLLM just allocated — a ``PushRequest`` (its engine, side channel and block ids)
to each prefill rank it would read from — and waits for their "written" notifications, at most
``push_timeout``. The producer rank checks the request on arrival exactly as a read intent (held,
enough blocks; refused at once when released), pins it, WRITEs its last ``len(block_ids)`` blocks
with ``KVWorker.push`` and, once the WRITE is done, counts the consumer rank as a finished reader
(so the lease is freed as after a pull). A push that arrives before the hold (the proxy got the
prefill's answer before the worker's next step) waits up to ``read_intent_timeout``; a refused
or failed push is told to the consumer (a ``write`` notification with ``ok=False``), which fails
the request (recomputed or failed by ``kv_load_failure_policy``) instead of waiting.

The intent travels as a wire ``Notification`` of kind ``"intent"`` (block ids in ``detail``),
answered by a ``Notification`` of the same kind (``ok`` or not, the reason in ``detail``). A
producer that does not check intents answers a plain ``Ack``, and the read fails closed. See
docs/vllm.md: a dedicated ``ReadIntent`` message in ``kvlink.wire`` and a ``validate`` hook in
``KVWorker`` are the intended home for this.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import sidechannel, wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import ConfigError, KVLinkError
from kvlink.headmap import map_heads, notify_targets
from kvlink.integrations.vllm_common import RecvReq, Remote, Settings, StepPlan
from kvlink.layout import KVCacheSpec
from kvlink.scheduler import BlockLeases
from kvlink.transport import Op
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

log = logging.getLogger("kvlink.vllm")

INTENT = "intent"
_NOT_YET = "not_yet"  # the prefill has not started holding the request yet: retry
_RELEASED_MEMORY = 100_000  # ids of released requests remembered to refuse late readers


class _ServingWorker(KVWorker):
    """KVWorker whose side channel also answers read intents and checks push requests on
    arrival (see module docstring)."""

    def __init__(self, config: WorkerConfig, on_intent: Any, on_push: Any) -> None:
        super().__init__(config)
        self._on_intent = on_intent
        self._on_push = on_push

    def _on_side_message(self, msg: object) -> wire._Msg:
        if isinstance(msg, wire.Notification) and msg.kind == INTENT:
            answer: wire._Msg = self._on_intent(msg)
            return answer
        if isinstance(msg, wire.PushRequest):
            verdict: wire._Msg | None = self._on_push(msg)
            if verdict is not None:  # refused, or parked until the request is held
                return verdict
        return super()._on_side_message(msg)  # accepted: queued for push_requests()


def expand_blocks(ids: tuple[int, ...] | list[int], ratio: int) -> npt.NDArray[np.int64]:
    """Scheduler block ids -> kernel block ids (vLLM may split a block into ``ratio`` pages)."""
    a = np.asarray(ids, dtype=np.int64)
    if ratio == 1:
        return a
    return (a[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)


@dataclasses.dataclass
class _Recv:
    req: RecvReq
    local: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    intents: list[cf.Future[None]]
    t0: float
    reading: bool = False


@dataclasses.dataclass
class Results:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: dict[str, str] = dataclasses.field(default_factory=dict)
    failed_blocks: set[int] = dataclasses.field(default_factory=set)  # scheduler block ids


class PullWorker:
    def __init__(self, settings: Settings, tp_rank: int, tp_size: int, dp_rank: int = 0,
                 block_ratio: int = 1) -> None:
        self.s = settings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.block_ratio = block_ratio
        self.worker: KVWorker | None = None
        self.spec: KVCacheSpec | None = None
        self.counters: dict[str, float] = {}
        self.durations: list[float] = []
        # The step thread takes _lock only when it has something to do (a notification, a
        # hold, a due expiry check): vLLM steps in a tight loop while blocks are held, and a
        # lock retaken every step would starve the side channel thread answering intents.
        self._lock = threading.Lock()
        self._side_counters: dict[str, float] = {}
        self._next_expiry_check = 0.0
        # producer state (guarded by _lock: the side channel thread answers intents)
        self._leases = BlockLeases(settings.lease_seconds)
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._pins: dict[str, dict[str, float]] = {}
        self._held_blocks: dict[str, set[int]] = {}
        self._held_order: dict[str, npt.NDArray[np.int64]] = {}  # kernel ids, prompt order
        self._push_waiting: list[tuple[wire.PushRequest, float]] = []  # arrived before the hold
        # push key -> (req id, writer "engine/rank", writer's TP size); step thread only
        self._writes: dict[str, tuple[str, str, int]] = {}
        self._expired_pinned: set[str] = set()
        self._done_sending: set[str] = set()
        # consumer state
        self._recv: dict[str, _Recv] = {}
        self._remote_to_local: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self._failed_blocks: set[int] = set()
        self._finished: set[str] = set()
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-intent")
        self._idle = False  # the current step runs no forward pass (see start)
        self._port = settings.rank_port(dp_rank, tp_size)
        self._secret = sidechannel.secret_from_env(settings.secret)

    def _count(self, key: str, n: float = 1) -> None:
        """Count from the step thread (lock-free); the intent thread uses _side_count."""
        self.counters[key] = self.counters.get(key, 0) + n

    def _side_count(self, key: str) -> None:  # caller holds _lock
        self._side_counters[key] = self._side_counters.get(key, 0) + 1

    # ------------------------------------------------------------------ setup
    def register(self, spec: KVCacheSpec) -> None:
        cfg = WorkerConfig(
            engine_id=self.s.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
            transports=list(self.s.transports),
            transport_options={k: dict(v) for k, v in self.s.transport_options.items()},
            host=self.s.host, advertise_host=self.s.advertise_host, side_port=self._port,
            handshake_timeout=self.s.handshake_timeout, serve=self.s.serves,
            secret=self.s.secret, allow_insecure=self.s.allow_insecure,
            announce_reads=False)  # this connector sends its own intents (see module docstring)
        self.worker = (_ServingWorker(cfg, self._on_intent, self._on_push) if self.s.producer
                       else KVWorker(cfg))
        self.worker.register(spec)
        self.spec = self.worker.spec
        if self.s.consumer and self.s.mode == "push" and not any(
                Op.WRITE in t.capabilities.ops for t in self.worker.transports.values()):
            raise ConfigError(f"mode 'push' needs a transport that takes WRITEs; "
                              f"{sorted(self.worker.transports)} do not")

    def _w(self) -> KVWorker:
        if self.worker is None:
            raise KVLinkError("register_kv_caches has not run on this worker")
        return self.worker

    # ------------------------------------------------------------------ producer
    def _forget(self, req_id: str, why: str) -> None:
        self._released[req_id] = why
        while len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        self._done_sending.add(req_id)
        self._held_blocks.pop(req_id, None)
        self._held_order.pop(req_id, None)
        self._pins.pop(req_id, None)
        self._expired_pinned.discard(req_id)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for req_id, _blocks in self._leases.expire():
            pins = {r: d for r, d in self._pins.get(req_id, {}).items() if d > now}
            if pins:
                self._pins[req_id] = pins
                self._expired_pinned.add(req_id)  # a READ is in flight: free after it
            else:
                self._side_count("send_expired_requests")
                self._forget(req_id, "its lease expired")
        for req_id in list(self._expired_pinned):
            pins = {r: d for r, d in self._pins.get(req_id, {}).items() if d > now}
            if not pins:
                self._side_count("send_expired_requests")
                self._forget(req_id, "its lease expired")

    def _answer(self, msg: wire.Notification, ok: bool, detail: str) -> wire.Notification:
        return wire.Notification(v=WIRE_VERSION, engine_id=self.s.engine_id, req_id=msg.req_id,
                                 tp_rank=self.tp_rank, tp_size=self.tp_size, kind=INTENT, ok=ok,
                                 detail=detail)

    def _on_intent(self, msg: wire.Notification) -> wire._Msg:
        reader = f"{msg.engine_id}/{msg.tp_rank}"
        try:
            wanted = {int(x) for x in msg.detail.split(",") if x}
        except ValueError:
            return self._answer(msg, False, "malformed block id list")
        with self._lock:
            self._expire_locked()
            if not self._leases.is_held(msg.req_id) or msg.req_id in self._expired_pinned:
                why = self._released.get(msg.req_id)
                if why is None:
                    return self._answer(msg, False, f"{_NOT_YET}: request {msg.req_id} is not "
                                                    "held (yet)")
                self._side_count("reads_refused")
                log.warning("refused a read of %s by %s: %s", msg.req_id, reader, why)
                return self._answer(msg, False, f"request {msg.req_id} is no longer held: {why}")
            held = self._held_blocks.get(msg.req_id, set())
            bad = sorted(wanted - held)
            if bad:
                self._side_count("reads_refused")
                return self._answer(msg, False, f"blocks {bad[:8]} are not among the "
                                                f"{len(held)} held for {msg.req_id}")
            self._pins.setdefault(msg.req_id, {})[reader] = (time.monotonic()
                                                             + self.s.pin_seconds)
        return self._answer(msg, True, "")

    def _hold(self, plan: StepPlan) -> None:
        if not plan.send:
            return
        with self._lock:
            for r in plan.send:
                if self._leases.is_held(r.req_id):
                    log.warning("request %s is already held; ignoring a second hold", r.req_id)
                    continue
                self._released.pop(r.req_id, None)
                self._leases.hold(r.req_id, list(r.block_ids))
                order = expand_blocks(r.block_ids, self.block_ratio)
                self._held_order[r.req_id] = order
                self._held_blocks[r.req_id] = set(order.tolist())

    def _collect_notifications(self) -> None:
        w = self._w()
        notes = [n for n in w.notifications() if n.kind == "read"]
        now = time.monotonic()
        due = now >= self._next_expiry_check and bool(self._leases.stats.held
                                                      or self._expired_pinned)
        if not notes and not due:
            return
        self._next_expiry_check = now + 0.05
        with self._lock:
            for note in notes:
                self._reader_done_locked(note.req_id, f"{note.engine_id}/{note.tp_rank}",
                                         note.tp_size)
            self._expire_locked()

    def _reader_done_locked(self, req_id: str, reader: str, reader_tp: int) -> None:
        """One consumer rank is done with a held request (it read it, was written, or its
        push failed): unpin it, and free the request once every expected reader is done."""
        pins = self._pins.get(req_id)
        if pins is not None:
            pins.pop(reader, None)
        if req_id in self._expired_pinned:
            if not pins:
                self._side_count("send_expired_requests")
                self._forget(req_id, "its lease expired")
            return
        freed = self._leases.reader_done(req_id, reader, self._w().expected_readers(reader_tp))
        if freed is not None:
            self._side_count("send_done_requests")
            self._forget(req_id, "all its readers finished")

    # ------------------------------------------------------------------ producer, push mode
    def _check_push_locked(self, msg: wire.PushRequest) -> str | None:
        """None if ``msg`` may be written now; else why not (``_NOT_YET...``: not held yet)."""
        if msg.req_id in self._expired_pinned:  # kept only for the reads already in flight
            return f"request {msg.req_id} is no longer held: its lease expired"
        if not self._leases.is_held(msg.req_id):
            why = self._released.get(msg.req_id)
            if why is None:
                return f"{_NOT_YET}: request {msg.req_id} is not held (yet)"
            return f"request {msg.req_id} is no longer held: {why}"
        held = self._held_order.get(msg.req_id)
        n = len(msg.block_ids)
        if held is None or not 0 < n <= held.shape[0]:
            return (f"{n} blocks asked for but {0 if held is None else held.shape[0]} are held "
                    f"for {msg.req_id}")
        return None

    def _pin_locked(self, msg: wire.PushRequest) -> None:
        self._pins.setdefault(msg.req_id, {})[f"{msg.engine_id}/{msg.tp_rank}"] = (
            time.monotonic() + self.s.pin_seconds)

    def _on_push(self, msg: wire.PushRequest) -> wire._Msg | None:
        """Side-channel thread: accept (None: queue it), park, or refuse a push request."""
        with self._lock:
            self._expire_locked()
            why = self._check_push_locked(msg)
            if why is None:
                self._pin_locked(msg)  # the lease cannot expire under the WRITE
                return None
            if why.startswith(_NOT_YET):
                self._push_waiting.append((msg, time.monotonic() + self.s.intent_timeout))
                return wire.Ack(v=WIRE_VERSION)
            self._side_count("pushes_refused")
        log.warning("refused a push of %s to %s/%d: %s", msg.req_id, msg.engine_id,
                    msg.tp_rank, why)
        return wire.ErrorReply(v=WIRE_VERSION, code="not_held", message=why)

    def _serve_pushes(self) -> None:
        """Step thread: WRITE the accepted push requests, settle the parked ones."""
        w = self._w()
        ready = w.push_requests()
        refused: list[tuple[wire.PushRequest, str]] = []
        if self._push_waiting:
            with self._lock:
                self._expire_locked()
                now, still = time.monotonic(), []
                for msg, deadline in self._push_waiting:
                    why = self._check_push_locked(msg)
                    if why is None:
                        self._pin_locked(msg)
                        ready.append(msg)
                    elif why.startswith(_NOT_YET) and now < deadline:
                        still.append((msg, deadline))
                    else:
                        if why.startswith(_NOT_YET):
                            why = (f"request {msg.req_id} was not held within "
                                   f"{self.s.intent_timeout:.0f}s of the push request")
                        self._side_count("pushes_refused")
                        refused.append((msg, why))
                self._push_waiting = still
        for msg, why in refused:
            log.warning("refused a push of %s to %s/%d: %s", msg.req_id, msg.engine_id,
                        msg.tp_rank, why)
            w.refuse_push(msg, why)
        for msg in ready:
            writer = f"{msg.engine_id}/{msg.tp_rank}"
            with self._lock:
                held = self._held_order.get(msg.req_id)
            try:
                if held is None:
                    raise KVLinkError(f"request {msg.req_id} was released before its push")
                # the consumer's blocks hold the prompt's tail (a local prefix hit is not
                # sent), so they match our last len(block_ids) blocks, as a pull reads them
                key = w.push(msg, held[held.shape[0] - len(msg.block_ids):])
            except KVLinkError as exc:
                log.warning("push of %s to %s failed to start: %s", msg.req_id, writer, exc)
                w.refuse_push(msg, str(exc))
                self._write_done(msg.req_id, writer, msg.tp_size, ok=False)
                continue
            self._writes[key] = (msg.req_id, writer, msg.tp_size)
        if self._writes:
            self._poll()

    def _write_done(self, req_id: str, writer: str, reader_tp: int, ok: bool) -> None:
        self._count("push_sent_requests" if ok else "push_failed_requests")
        with self._lock:
            self._reader_done_locked(req_id, writer, reader_tp)

    # ------------------------------------------------------------------ consumer
    def _intent(self, remote: Remote, rank: int, ids: list[int], deadline: float) -> None:
        msg = wire.Notification(v=WIRE_VERSION, engine_id=self.s.engine_id,
                                req_id=remote.request_id, tp_rank=self.tp_rank,
                                tp_size=self.tp_size, kind=INTENT, ok=True,
                                detail=",".join(map(str, ids)))
        delay = 0.01
        where = f"{remote.engine_id} rank {rank} ({remote.host}:{remote.port + rank})"
        while True:
            left = deadline - time.monotonic()
            reply = sidechannel.request(remote.host, remote.port + rank, msg,
                                        max(0.5, min(left, self.s.handshake_timeout)),
                                        self._secret)
            if not (isinstance(reply, wire.Notification) and reply.kind == INTENT):
                raise KVLinkError(f"{where} does not check read intents (answered "
                                  f"{type(reply).__name__}); refusing to read unverified blocks")
            if reply.ok:
                return
            if not reply.detail.startswith(_NOT_YET) or time.monotonic() > deadline:
                raise KVLinkError(f"{where} refused the read: {reply.detail}")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _start_recv(self, r: RecvReq) -> None:
        spec = self.spec
        assert spec is not None
        if r.remote.request_id in self._remote_to_local:
            self._fail(r, None, f"remote request {r.remote.request_id} is already "
                       "being read by another request")
            return
        local = expand_blocks(r.local_block_ids, self.block_ratio)
        n = len(r.local_block_ids)
        if n > len(r.remote.block_ids):
            self._fail(r, None, f"{n} local blocks but the prefill offers only "
                       f"{len(r.remote.block_ids)}")
            return
        remote_ratio = self.block_ratio
        if r.remote.block_size:
            remote_ratio = r.remote.block_size // spec.block_size
        remote_ids = expand_blocks(r.remote.block_ids[len(r.remote.block_ids) - n:],
                                   remote_ratio)
        if remote_ids.shape != local.shape or remote_ratio * spec.block_size != (
                r.remote.block_size or remote_ratio * spec.block_size):
            self._fail(r, None, f"block sizes differ: local {self.block_ratio * spec.block_size} "
                       f"vs remote {r.remote.block_size} tokens (pages of {spec.block_size})")
            return
        try:
            reads = map_heads(self.tp_size, self.tp_rank, r.remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        except KVLinkError as exc:
            self._fail(r, None, str(exc))
            return
        if r.push:
            rm = r.remote
            try:  # the PushRequest goes out on the worker's thread: this never blocks
                self._w().expect_push(rm.request_id, RemoteEngine(rm.engine_id, rm.host,
                                                                  rm.port, rm.tp_size),
                                      local, timeout=self.s.push_timeout)
            except KVLinkError as exc:
                self._fail(r, None, str(exc))
                return
            self._recv[r.req_id] = _Recv(r, local, remote_ids, [], time.perf_counter(),
                                         reading=True)
            self._remote_to_local[r.remote.request_id] = r.req_id
            return
        deadline = time.monotonic() + self.s.intent_timeout
        ids = remote_ids.tolist()
        futs = [self._pool.submit(self._intent, r.remote, h.remote_rank, ids, deadline)
                for h in {h.remote_rank: h for h in reads}.values()]
        self._recv[r.req_id] = _Recv(r, local, remote_ids, futs, time.perf_counter())
        self._remote_to_local[r.remote.request_id] = r.req_id

    def _fail(self, req: RecvReq, rec: _Recv | None, reason: str) -> None:
        req_id = req.req_id
        log.warning("loading KV of request %s failed: %s", req_id, reason)
        self._failed[req_id] = reason
        self._failed_blocks.update(req.local_block_ids)
        self._count("recv_failed_requests")
        if rec is not None:
            self._remote_to_local.pop(rec.req.remote.request_id, None)
            self._recv.pop(req_id, None)

    def _advance(self) -> None:
        w = self._w()
        for rec in list(self._recv.values()):
            if rec.reading or not all(f.done() for f in rec.intents):
                continue
            errors = [str(f.exception()) for f in rec.intents if f.exception() is not None]
            if errors:
                self._fail(rec.req, rec, "; ".join(errors))
                continue
            rm = rec.req.remote
            try:
                w.read(rm.request_id, RemoteEngine(rm.engine_id, rm.host, rm.port, rm.tp_size),
                       rec.local, rec.remote_ids)
            except KVLinkError as exc:
                self._fail(rec.req, rec, str(exc))
                continue
            rec.reading = True
        if any(rec.reading for rec in self._recv.values()) or self._writes:
            self._poll()

    def _poll(self) -> None:
        """Advance every transfer of this rank; route the results (a ``kv_both`` rank may have
        pulls, awaited pushes and its own WRITEs in flight at once)."""
        w = self._w()
        before = w.finished_bytes
        done, failed = w.poll()
        for key in [k for k in done if k in self._writes] + [k for k in failed
                                                             if k in self._writes]:
            req_id, writer, tp = self._writes.pop(key)
            self._write_done(req_id, writer, tp, ok=key in done)
        pulled = w.finished_bytes - before
        for rid in done:
            local_id = self._remote_to_local.pop(rid, None)
            got = self._recv.pop(local_id, None) if local_id is not None else None
            if local_id is None or got is None:
                continue
            rec = got
            self._finished.add(local_id)
            self._count("recv_requests")
            self._count("recv_blocks", rec.local.shape[0])
            if rec.req.push:
                self._count("recv_pushed_requests")
                self._count("recv_bytes", rec.local.shape[0] * self._spec().block_bytes)
                self._release_unwritten(rec.req.remote)
            self.durations.append(time.perf_counter() - rec.t0)
            log.debug("loaded %d tokens (%d blocks) of request %s from %s/%s (%s)",
                      rec.req.num_tokens, rec.local.shape[0], local_id,
                      rec.req.remote.engine_id, rec.req.remote.request_id,
                      "pushed" if rec.req.push else "pulled")
        self._count("recv_bytes", pulled)  # pushes add nothing here: our side posts nothing
        for rid, reason in failed.items():
            local_id = self._remote_to_local.get(rid)
            bad = self._recv.get(local_id) if local_id is not None else None
            if bad is not None:
                if bad.req.push:
                    self._release_unwritten(bad.req.remote)
                self._fail(bad.req, bad, reason)

    def _spec(self) -> KVCacheSpec:
        if self.spec is None:
            raise KVLinkError("register_kv_caches has not run on this worker")
        return self.spec

    def _release_unwritten(self, remote: Remote) -> None:
        """After a push: the prefill replicas that hold our heads but were not asked to write
        (heterogeneous TP) still expect our "done" to free their lease."""
        spec = self._spec()
        written = {h.remote_rank for h in map_heads(self.tp_size, self.tp_rank, remote.tp_size,
                                                    spec.total_kv_heads, spec.mla)}
        rest = notify_targets(self.tp_size, self.tp_rank, remote.tp_size, spec.total_kv_heads,
                              spec.mla) - written
        if not rest:
            return
        note = wire.Notification(v=WIRE_VERSION, engine_id=self.s.engine_id,
                                 req_id=remote.request_id, tp_rank=self.tp_rank,
                                 tp_size=self.tp_size)
        for rank in sorted(rest):
            self._pool.submit(self._notify, remote, rank, note)

    def _release(self, remote: Remote) -> None:
        spec = self.spec
        assert spec is not None
        note = wire.Notification(v=WIRE_VERSION, engine_id=self.s.engine_id,
                                 req_id=remote.request_id, tp_rank=self.tp_rank,
                                 tp_size=self.tp_size)
        try:
            ranks = {h.remote_rank for h in map_heads(self.tp_size, self.tp_rank, remote.tp_size,
                                                      spec.total_kv_heads, spec.mla)}
        except KVLinkError:
            return
        for rank in ranks:
            self._pool.submit(self._notify, remote, rank, note)

    def _notify(self, remote: Remote, rank: int, note: wire.Notification) -> None:
        try:
            sidechannel.request(remote.host, remote.port + rank, note,
                                self.s.handshake_timeout, self._secret)
        except KVLinkError as exc:
            log.info("could not release %s at %s: %s (its lease will expire)",
                     remote.request_id, remote.engine_id, exc)

    # ------------------------------------------------------------------ every step
    def start(self, plan: StepPlan, idle: bool = False) -> None:
        """Called once per step with the scheduler's plan (from start_load_kv).

        ``idle``: the step runs no forward pass. vLLM steps in a tight loop while a request
        waits for its KV or a finished one holds blocks, and that loop would keep the GIL from
        the threads doing the work (side channel answers, transport I/O): an idle step with
        transfers outstanding yields up to ``idle_yield_s`` to let them run, ending early when
        what it waits for arrives (:meth:`_yield`).
        """
        if self.worker is None:
            return
        self._idle = idle
        if idle and self.s.idle_yield_s > 0 and (
                self._recv or self._leases.stats.held or self._expired_pinned or self._writes):
            self._yield(self.s.idle_yield_s)
        self._hold(plan)
        if self.s.producer:
            self._serve_pushes()  # a push that waited for this step's hold starts now
        for r in plan.recv:
            self._start_recv(r)
        for remote in plan.release:
            self._release(remote)
        if self._recv:
            self._advance()

    def results(self) -> Results:
        """What finished since the last call (from get_finished / get_transfer_results)."""
        out = Results()
        if self.worker is None:
            return out
        if self.s.producer:
            self._serve_pushes()
            self._collect_notifications()
            if self._done_sending:
                with self._lock:
                    out.finished_sending, self._done_sending = self._done_sending, set()
        if self._recv:
            self._advance()
            if self._idle and self.s.idle_yield_s > 0 and self._pulling():
                # a READ posted this step often lands within a millisecond: report it with
                # this step rather than a whole engine round trip later
                self._yield(self.s.idle_yield_s)
        out.finished_recving, self._finished = self._finished, set()
        out.failed_recving, self._failed = self._failed, {}
        out.failed_blocks, self._failed_blocks = self._failed_blocks, set()
        out.finished_recving |= set(out.failed_recving)
        return out

    def pending(self) -> int:
        return len(self._recv) + len(self._writes)

    def _pulling(self) -> bool:
        return any(rec.reading and not rec.req.push for rec in self._recv.values())

    def _yield(self, seconds: float) -> None:
        """An idle step's yield: up to ``seconds`` with the GIL released, ended early by what
        the step waits for: a read intent's answer (waited on), or, with READs in flight,
        their completion (polled every 0.2 ms) or failure."""
        deadline = time.perf_counter() + seconds
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            if not self._pulling():
                asked = [f for rec in self._recv.values() if not rec.reading
                         for f in rec.intents if not f.done()]
                if asked:
                    cf.wait(asked, timeout=left, return_when=cf.FIRST_COMPLETED)
                else:
                    time.sleep(left)
                return
            time.sleep(min(left, 0.0002))
            self._advance()
            if self._finished or self._failed:
                return

    def take_stats(self) -> tuple[dict[str, float], list[float]]:
        c, self.counters = self.counters, {}
        if self._side_counters:
            with self._lock:
                side, self._side_counters = self._side_counters, {}
            for k, v in side.items():
                c[k] = c.get(k, 0) + v
        d, self.durations = self.durations, []
        return c, d

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.worker is not None:
            self.worker.close()
