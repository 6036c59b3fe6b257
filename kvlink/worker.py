"""Worker side: register memory, handshake, post READ/WRITE, poll, report.

Never decides policy (that is the scheduler's): it is told which blocks to move and reports
which requests finished or failed. Handshakes run on a helper thread, so the caller (vLLM's
forward loop) never blocks on a slow peer; requests wait in PENDING until their peers are ready.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import sidechannel, wire
from kvlink.compat import WIRE_VERSION, check_compatible, compat_hash
from kvlink.errors import ConfigError, HandshakeError, KVLinkError, TransportUnavailable
from kvlink.headmap import HeadRead, map_heads, notify_targets, push_targets
from kvlink.hostid import host_id
from kvlink.layout import KVCacheSpec
from kvlink.plan import Plan, plan_transfer
from kvlink.scheduler import BlockLeases
from kvlink.transport import (
    Op,
    Transport,
    TransportContext,
    TransportStats,
    XferStatus,
    create_transport,
)

log = logging.getLogger("kvlink.worker")
_XFER_SECONDS_KEPT = 4096  # finished requests whose transport time KVWorker.xfer_seconds keeps


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


@dataclasses.dataclass
class WorkerConfig:
    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    transports: list[str] = dataclasses.field(default_factory=lambda: ["tcp"])
    transport_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"  # bind address of side channel and data plane
    advertise_host: str | None = None
    side_port: int = 0  # base port; rank r listens on side_port + r (0: ephemeral)
    handshake_timeout: float = 10.0
    serve: bool = True  # run a side channel server (producers, and consumers in push mode)
    secret: str | None = None  # shared side-channel secret (default: env KVLINK_SECRET)
    announce_reads: bool = True  # pull: ask the producer to pin a request before READing it
    allow_insecure: bool = False  # bind an unauthenticated side channel on a non-loopback host

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if not self.transports:
            raise ConfigError("transports must name at least one transport")


@dataclasses.dataclass(frozen=True)
class RemoteEngine:
    """How to reach a remote instance: the keys vLLM's kv_transfer_params carry."""

    engine_id: str
    host: str
    port: int  # side channel base port (rank r at port + r)
    tp_size: int = 1


@dataclasses.dataclass
class _Peer:
    agent: str
    spec: KVCacheSpec
    transport: Transport
    tp_size: int
    endpoint: tuple[str, int]


@dataclasses.dataclass
class _Part:
    read: HeadRead
    future: cf.Future[_Peer]
    handle: int | None = None
    transport: Transport | None = None
    done: bool = False
    error: str | None = None
    plan: Plan | None = None
    t_post: float = 0.0
    xfer_seconds: float = 0.0  # transport post to completion (see KVWorker.xfer_seconds)


@dataclasses.dataclass
class _Awaiting:
    """Push mode, decode side: blocks reserved for a request the prefill will WRITE into."""

    req_id: str
    remote: RemoteEngine
    waiting: set[int]  # prefill ranks that have not signalled "written" yet
    deadline: float
    nbytes: int
    asked: cf.Future[None] | None = None
    error: str | None = None  # a prefill rank said it could not write (ok=False)


@dataclasses.dataclass
class _Request:
    req_id: str
    op: Op
    remote: RemoteEngine
    local_ids: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    parts: list[_Part]
    t_start: float
    nbytes: int = 0


class KVWorker:
    """One TP rank's transfer engine; usable without vLLM."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.spec: KVCacheSpec | None = None
        self.agent_name = f"{config.engine_id}/{config.tp_rank}/{os.getpid()}-{time.time_ns()}"
        self.transports: dict[str, Transport] = {}
        self._server: sidechannel.SideChannelServer | None = None
        self._peers: dict[tuple[str, int], cf.Future[_Peer]] = {}
        self._peers_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._side_notifs: list[wire.Notification] = []
        self._read_notifs: list[wire.Notification] = []
        self._push_inbox: list[wire.PushRequest] = []
        self._awaiting: dict[str, _Awaiting] = {}
        self._notif_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlink-hs",
                                           initializer=self._thread_init)
        self._intents = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlink-intent")
        # readers' "done" notifications on their own threads: a dead prefill stalls these for
        # the side-channel timeout each, and must not hold up read intents to live ones
        self._notifier = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlink-notify")
        #: producer side: when set, READs must be announced and are refused once leases expire
        self.leases: BlockLeases | None = None
        self.leases_lock = threading.Lock()
        self._secret = sidechannel.secret_from_env(config.secret)
        self.finished_bytes = 0
        self.raw_descriptors = 0  # before coalescing, over finished requests
        self.descriptors = 0
        #: finished request id -> transport-level seconds, post to completion (the slowest
        #: part): the transport's own timing where it has one (NIXL telemetry ``xferDuration``,
        #: with the nixl option ``telemetry``), else post() call to DONE seen by poll().
        #: Excludes handshake, read intents and the step loop. Callers pop what they read.
        self.xfer_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------ setup
    def register(self, spec: KVCacheSpec) -> None:
        """Register the cache with every configured transport that can take it; start serving."""
        if spec.tp_size != self.config.tp_size or spec.tp_rank != self.config.tp_rank:
            spec = dataclasses.replace(spec, tp_size=self.config.tp_size,
                                       tp_rank=self.config.tp_rank)
        self.spec = spec
        ctx = TransportContext(agent_name=self.agent_name, host=self.config.host,
                               advertise_host=self.config.advertise_host, host_id=host_id())
        reasons = []
        for name in self.config.transports:
            try:
                t = create_transport(name, ctx, self.config.transport_options.get(name))
                t.register(spec.regions)
            except KVLinkError as exc:
                reasons.append(f"{name}: {exc}")
                log.info("transport %s unavailable: %s", name, exc)
                continue
            self.transports[name] = t
        if not self.transports:
            raise TransportUnavailable("no configured transport can serve this cache: "
                                       + "; ".join(reasons))
        log.info("rank %d registered %d region(s), %.1f MiB, transports %s",
                 self.config.tp_rank, len(spec.regions),
                 sum(r.nbytes for r in spec.regions) / 2**20, list(self.transports))
        if self.config.serve:
            port = self.config.side_port + self.config.tp_rank if self.config.side_port else 0
            self._server = sidechannel.SideChannelServer(
                self.config.host, port, self._on_side_message,
                name=f"kvlink-side-{self.config.tp_rank}", secret=self._secret,
                allow_insecure=self.config.allow_insecure)

    @property
    def side_port(self) -> int:
        if self._server is None:
            raise ConfigError("this worker runs no side channel server (serve=False)")
        return int(self._server.port)

    def _thread_init(self) -> None:
        # UCX (and CUDA IPC) need a CUDA context on the thread that connects.
        if self.spec is not None and self.spec.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(int(self.spec.device.split(":")[1]))

    # ------------------------------------------------------------------ side channel server
    def _on_side_message(self, msg: object) -> wire._Msg:
        if isinstance(msg, wire.HandshakeRequest):
            return self._answer_handshake(msg)
        if isinstance(msg, wire.Notification):
            with self._notif_lock:
                self._side_notifs.append(msg)
            return wire.Ack(v=WIRE_VERSION)
        if isinstance(msg, wire.ReadIntent):
            with self.leases_lock:
                ok = self.leases is None or self.leases.begin_read(msg.req_id)
            if ok:
                return wire.Ack(v=WIRE_VERSION)
            log.warning("refused READ of %s by %s rank %d: not held (lease expired, aborted or "
                        "never existed)", msg.req_id, msg.engine_id, msg.tp_rank)
            return wire.ErrorReply(v=WIRE_VERSION, code="expired",
                                   message=f"request {msg.req_id} is not held here (lease "
                                   "expired or unknown); recompute it")
        if isinstance(msg, wire.PushRequest):
            with self._notif_lock:
                self._push_inbox.append(msg)
            return wire.Ack(v=WIRE_VERSION)
        return wire.ErrorReply(v=WIRE_VERSION, code="unsupported",
                               message=f"{type(msg).__name__} not handled here")

    def _answer_handshake(self, req: wire.HandshakeRequest) -> wire._Msg:
        spec = self._require_spec()
        ours = compat_hash(spec.geometry())
        if req.compat != ours:
            log.warning("handshake from %s (rank %d) with compat %s != ours %s; the peer will "
                        "name the differing values", req.engine_id, req.tp_rank, req.compat, ours)
        return wire.HandshakeResponse(
            v=WIRE_VERSION, engine_id=self.config.engine_id, agent_name=self.agent_name,
            tp_rank=self.config.tp_rank, tp_size=self.config.tp_size, host_id=host_id(),
            compat=ours, spec=wire.SpecMsg.of(spec),
            transports=self._offer(req),
        )

    def _offer(self, req: wire.HandshakeRequest) -> dict[str, bytes]:
        """Descriptors for this peer: same-host-only ones (IPC handles) only to our own host."""
        same = req.host_id == host_id()
        out = {}
        for name, t in self.transports.items():
            if t.capabilities.same_host_only and not same:
                log.info("not offering %s to %s rank %d: other host", name, req.engine_id,
                         req.tp_rank)
                continue
            out[name] = t.descriptor()
        return out

    def _require_spec(self) -> KVCacheSpec:
        if self.spec is None:
            raise ConfigError("register() a KV cache before transferring")
        return self.spec

    # ------------------------------------------------------------------ handshake (client)
    def _peer(self, remote: RemoteEngine, rank: int) -> cf.Future[_Peer]:
        key = (remote.engine_id, rank)
        with self._peers_lock:
            fut = self._peers.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._handshake, remote, rank)
                self._peers[key] = fut
            return fut

    def _intent(self, remote: RemoteEngine, rank: int, req_id: str) -> cf.Future[_Peer]:
        """Handshake (if needed), then announce the READ; the future fails if it is refused."""
        peer = self._peer(remote, rank)

        def announce() -> _Peer:
            ready = peer.result(timeout=self.config.handshake_timeout * 2)
            sidechannel.request(remote.host, remote.port + rank, wire.ReadIntent(
                v=WIRE_VERSION, engine_id=self.config.engine_id, req_id=req_id,
                tp_rank=self.config.tp_rank), self.config.handshake_timeout, self._secret)
            return ready

        return self._intents.submit(announce)

    def forget_peer(self, engine_id: str, rank: int) -> None:
        """Drop cached handshake state (after a failure, the next request handshakes again)."""
        with self._peers_lock:
            fut = self._peers.pop((engine_id, rank), None)
        if fut is not None and fut.done() and fut.exception() is None:
            peer = fut.result()
            peer.transport.disconnect(peer.agent)

    def _drop_stale(self, endpoint: tuple[str, int], keep: tuple[str, int]) -> None:
        """A new engine answers at an address an old one used: forget the old one's metadata."""
        with self._peers_lock:
            stale = [k for k, f in self._peers.items() if k != keep and f.done()
                     and f.exception() is None and f.result().endpoint == endpoint]
        for engine_id, rank in stale:
            log.warning("engine %s rank %d was replaced at %s:%d; dropping its metadata",
                        engine_id, rank, *endpoint)
            self.forget_peer(engine_id, rank)

    def connected_peers(self) -> list[str]:
        """Agent names of peers with live handshake state."""
        with self._peers_lock:
            futs = list(self._peers.values())
        return sorted(f.result().agent for f in futs if f.done() and f.exception() is None)

    def _handshake(self, remote: RemoteEngine, rank: int) -> _Peer:
        spec = self._require_spec()
        req = wire.HandshakeRequest(
            v=WIRE_VERSION, engine_id=self.config.engine_id, agent_name=self.agent_name,
            tp_rank=self.config.tp_rank, tp_size=self.config.tp_size, host_id=host_id(),
            compat=compat_hash(spec.geometry()))
        reply = sidechannel.request(remote.host, remote.port + rank, req,
                                    self.config.handshake_timeout, self._secret)
        if not isinstance(reply, wire.HandshakeResponse):
            raise HandshakeError(f"{remote.host}:{remote.port + rank} answered "
                                 f"{type(reply).__name__} to a handshake")
        if reply.engine_id != remote.engine_id or reply.tp_rank != rank:
            raise HandshakeError(
                f"{remote.host}:{remote.port + rank} is engine {reply.engine_id!r} rank "
                f"{reply.tp_rank}, expected {remote.engine_id!r} rank {rank}")
        rspec = reply.spec.to_spec()
        check_compatible(spec.geometry(), rspec.geometry(), self.config.tp_size, reply.tp_size)
        same_host = reply.host_id == host_id()
        reasons = []
        for name, transport in self.transports.items():
            desc = reply.transports.get(name)
            if desc is None:
                reasons.append(f"{name}: not offered by the peer")
                continue
            why = transport.unreachable_reason(desc, same_host)
            kind = rspec.device.split(":")[0]
            if why is None and kind not in transport.capabilities.memory_kinds:
                why = f"{name} cannot reach peer memory on {rspec.device}"
            if why is not None:
                reasons.append(f"{name}: {why}")
                continue
            try:
                transport.connect(reply.agent_name, desc)
            except KVLinkError as exc:
                reasons.append(f"{name}: {exc}")
                continue
            log.info("peer %s rank %d (%s, %s host): transport %s", remote.engine_id, rank,
                     reply.agent_name, "same" if same_host else "other", name)
            if (same_host and name != "cuda_ipc" and spec.device.startswith("cuda")
                    and rspec.device.startswith("cuda")):
                _warn_once(f"same-host GPU peer {remote.engine_id} is served by {name}, not "
                           "cuda_ipc: one-sided READs of VRAM can fall back to a TCP lane "
                           "(measured 0.46 GB/s with NIXL on one H200); put 'cuda_ipc' first "
                           "in the transports list")
            endpoint = (remote.host, remote.port + rank)
            self._drop_stale(endpoint, (remote.engine_id, rank))
            return _Peer(reply.agent_name, rspec, transport, reply.tp_size, endpoint)
        raise HandshakeError(f"no transport reaches {remote.engine_id} rank {rank}: "
                             + "; ".join(reasons))

    # ------------------------------------------------------------------ transfers
    def read(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike) -> None:
        """Pull a request's blocks (non-blocking); completion is reported by :meth:`poll`."""
        self._start(req_id, Op.READ, remote, local_ids, remote_ids)

    def write(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
              remote_ids: npt.ArrayLike) -> None:
        """Push a request's blocks into the remote's blocks (non-blocking)."""
        self._start(req_id, Op.WRITE, remote, local_ids, remote_ids)

    def _start(self, req_id: str, op: Op, remote: RemoteEngine, local_ids: npt.ArrayLike,
               remote_ids: npt.ArrayLike, reads: list[HeadRead] | None = None) -> None:
        spec = self._require_spec()
        if req_id in self._requests:
            raise ConfigError(f"request {req_id!r} is already in flight")
        lids = spec.check_block_ids(local_ids, "local")
        rids = np.asarray(remote_ids)
        if rids.ndim != 1 or rids.shape != lids.shape:
            raise ConfigError(f"request {req_id}: {lids.shape[0]} local vs "
                              f"{np.shape(rids)} remote block ids")
        if reads is None:
            reads = map_heads(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        announce = op is Op.READ and self.config.announce_reads
        parts = [_Part(r, self._intent(remote, r.remote_rank, req_id) if announce
                       else self._peer(remote, r.remote_rank)) for r in reads]
        self._requests[req_id] = _Request(req_id, op, remote, lids, rids.astype(np.int64), parts,
                                          time.perf_counter())

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Advance every request; returns (finished ids, {failed id: reason}) since last call."""
        finished: set[str] = set()
        failed: dict[str, str] = {}
        self._poll_pushed(finished, failed)
        for req in list(self._requests.values()):
            for part in req.parts:
                self._advance(req, part)
            if any(p.handle is not None and not p.done for p in req.parts):
                continue  # never report while bytes may still land in our blocks
            if any(p.handle is None and not p.done and p.error is None for p in req.parts):
                continue
            del self._requests[req.req_id]
            errors = [p.error for p in req.parts if p.error]
            if errors:
                failed[req.req_id] = "; ".join(errors)
                log.warning("request %s failed: %s", req.req_id, failed[req.req_id])
                if req.op is Op.WRITE and "@" in req.req_id:  # a push: the decode is waiting
                    self._notify_write_failed(req, failed[req.req_id])
            else:
                finished.add(req.req_id)
                self.finished_bytes += req.nbytes
                self.xfer_seconds[req.req_id] = max((p.xfer_seconds for p in req.parts),
                                                    default=0.0)
                if len(self.xfer_seconds) > _XFER_SECONDS_KEPT:  # nobody reads them
                    del self.xfer_seconds[next(iter(self.xfer_seconds))]
                if req.op is Op.READ:
                    self._release_unread(req)
                self.raw_descriptors += sum(p.plan.raw_descriptors for p in req.parts if p.plan)
                self.descriptors += sum(p.plan.descriptors for p in req.parts if p.plan)
        return finished, failed

    def _advance(self, req: _Request, part: _Part) -> None:
        if part.done or (part.error is not None and part.handle is None):
            return
        if part.handle is None:
            if not part.future.done():
                return
            exc = part.future.exception()
            if exc is not None:
                part.error = f"{req.remote.engine_id} rank {part.read.remote_rank}: {exc}"
                return
            peer = part.future.result()
            try:
                plan = plan_transfer(self._require_spec(), peer.spec, req.local_ids,
                                     req.remote_ids, part.read, peer.transport.extents)
            except KVLinkError as exc:
                part.error = str(exc)
                return
            note = None
            if req.op is Op.WRITE and peer.transport.capabilities.native_notifications:
                note = self._notification(req)  # ordered after the written bytes
            part.plan, part.transport = plan, peer.transport
            part.t_post = time.perf_counter()
            part.handle = peer.transport.post(req.op, peer.agent, plan.local, plan.remote, note)
            req.nbytes += plan.nbytes
            return
        assert part.transport is not None
        state = part.transport.poll(part.handle)
        if state.status is XferStatus.PENDING:
            return
        part.xfer_seconds = self._transport_seconds(part)
        part.transport.release(part.handle)
        part.done = True
        if state.status is XferStatus.FAILED:
            part.error = f"{req.remote.engine_id} rank {part.read.remote_rank}: {state.reason}"
            self.forget_peer(req.remote.engine_id, part.read.remote_rank)
        elif req.op is Op.READ or not part.transport.capabilities.native_notifications:
            # A READ is DONE once its bytes are ours, so its "done" can go over the side
            # channel, off this thread. Through the transport it would cost the next READ from
            # that peer: NIXL/UCX makes an RMA after a notification wait for the TARGET's
            # progress (docs/nixl.md "Progress"), where over cma it would finish in the post.
            self._notifier.submit(self._notify_side, req, part)

    @staticmethod
    def _transport_seconds(part: _Part) -> float:
        """Post to completion of one finished part: the transport's own timing if it keeps one
        (``xfer_telemetry``: NIXL's ``xferDuration``, what vLLM's NixlConnector reports as
        ``vllm:nixl_xfer_time_seconds``), else our clock from post() to the poll that saw DONE."""
        telemetry = getattr(part.transport, "xfer_telemetry", None)
        if telemetry is not None and part.handle is not None:
            try:
                entries = telemetry(part.handle)
            except KVLinkError:
                entries = []
            us = sum(float(e.get("xfer_us", 0.0)) for e in entries)
            if us > 0:
                return us / 1e6
        return time.perf_counter() - part.t_post

    def _release_unread(self, req: _Request) -> None:
        """Tell the replicas we did not read that we are done with the request's blocks."""
        spec = self._require_spec()
        read = {p.read.remote_rank for p in req.parts}
        rest = notify_targets(self.config.tp_size, self.config.tp_rank, req.remote.tp_size,
                              spec.total_kv_heads, spec.mla) - read
        if not rest:
            return
        msg = wire.decode(self._notification(req))

        def send() -> None:
            for rank in sorted(rest):
                try:
                    sidechannel.request(req.remote.host, req.remote.port + rank, msg,
                                        self.config.handshake_timeout, self._secret)
                except KVLinkError as exc:
                    log.warning("could not release %s on %s rank %d: %s (its lease will "
                                "expire)", req.req_id, req.remote.engine_id, rank, exc)

        self._notifier.submit(send)

    def _notification(self, req: _Request) -> bytes:
        # a pushed request is known to the decode side by its own id (before the '@')
        return wire.encode(wire.Notification(
            v=WIRE_VERSION, engine_id=self.config.engine_id, req_id=req.req_id.split("@")[0],
            tp_rank=self.config.tp_rank, tp_size=self.config.tp_size,
            kind="read" if req.op is Op.READ else "write"))

    def _notify_write_failed(self, req: _Request, reason: str) -> None:
        """A failed push: say so to the decode rank (its blocks may hold part of the bytes), so
        it fails the request now rather than at its timeout."""
        note = wire.Notification(v=WIRE_VERSION, engine_id=self.config.engine_id,
                                 req_id=req.req_id.split("@")[0], tp_rank=self.config.tp_rank,
                                 tp_size=self.config.tp_size, kind="write", ok=False,
                                 detail=reason[:500])
        for rank in sorted({p.read.remote_rank for p in req.parts}):
            self._intents.submit(self._send_failure, req.remote.host, req.remote.port + rank,
                                 note)

    def _notify_side(self, req: _Request, part: _Part) -> None:
        msg = wire.decode(self._notification(req))
        try:
            sidechannel.request(req.remote.host, req.remote.port + part.read.remote_rank, msg,
                                self.config.handshake_timeout, self._secret)
        except KVLinkError as exc:
            log.warning("could not notify %s of %s: %s (its lease will expire)",
                        req.remote.engine_id, req.req_id, exc)

    def descriptor_counts(self) -> tuple[int, int]:
        """(before, after) coalescing, summed over finished requests."""
        return self.raw_descriptors, self.descriptors

    def pending(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ producer side
    def expect_access(self, seconds: float, count: int = 1) -> None:
        """A reader will post ``count`` transfers against our memory within ``seconds`` (it was
        just told to go ahead): let every transport serve them promptly (see
        :meth:`Transport.expect_access`; NIXL's initiator waits on our UCX progress)."""
        for t in self.transports.values():
            t.expect_access(seconds, count)

    def _drain_notifications(self) -> None:
        """Sort incoming notifications: "written" ones complete pushes, "read" ones are kept
        for :meth:`notifications`. Bad ones are logged and dropped."""
        got: list[wire.Notification] = []
        for t in self.transports.values():
            for peer, raw in t.notifications():
                try:
                    got.append(wire.decode(raw, wire.Notification))
                except KVLinkError as exc:
                    log.warning("dropped a bad notification from %s: %s", peer, exc)
        with self._notif_lock:
            got.extend(self._side_notifs)
            self._side_notifs.clear()
        for note in got:
            if note.kind == "write":
                wait = self._awaiting.get(note.req_id)
                if wait is None or note.engine_id != wait.remote.engine_id:
                    log.info("'written' notification for unknown request %s from %s/%d",
                             note.req_id, note.engine_id, note.tp_rank)
                elif not note.ok:  # a refusal or a failed WRITE: the blocks are not filled
                    wait.error = (f"{note.engine_id} rank {note.tp_rank} did not write: "
                                  f"{note.detail or 'no reason given'}")
                else:
                    wait.waiting.discard(note.tp_rank)
            else:
                self._read_notifs.append(note)

    def notifications(self) -> list[wire.Notification]:
        """Readers' "done" notifications (pull mode, producer side)."""
        self._drain_notifications()
        out, self._read_notifs = self._read_notifs, []
        return out

    # ------------------------------------------------------------------ push mode
    def expect_push(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
                    timeout: float = 60.0) -> None:
        """Decode side: ask the prefill ranks to WRITE this request into ``local_ids``.

        The blocks stay reserved until every prefill rank has signalled "written" (finished) or
        ``timeout`` passes (failed; the caller may then free or reuse them).
        """
        spec = self._require_spec()
        if self._server is None:
            raise ConfigError("push mode needs a side channel server on the decode side "
                              "(serve=True): the prefill handshakes back to write")
        if req_id in self._awaiting:
            raise ConfigError(f"request {req_id!r} is already awaiting a push")
        lids = spec.check_block_ids(local_ids, "local")
        ranks = {r.remote_rank for r in map_heads(self.config.tp_size, self.config.tp_rank,
                                                  remote.tp_size, spec.total_kv_heads, spec.mla)}
        msg = wire.PushRequest(
            v=WIRE_VERSION, engine_id=self.config.engine_id, agent_name=self.agent_name,
            req_id=req_id, tp_rank=self.config.tp_rank, tp_size=self.config.tp_size,
            host=self._public_host(), port=self.side_port - self.config.tp_rank,
            block_ids=lids.tolist())
        wait = _Awaiting(req_id, remote, set(ranks), time.monotonic() + timeout, 0)
        wait.asked = self._pool.submit(self._ask_push, remote, sorted(ranks), msg, wait.deadline)
        self._awaiting[req_id] = wait

    def _public_host(self) -> str:
        """Where peers dial this rank back: a wildcard bind address is no address to dial."""
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.config.host

    def _ask_push(self, remote: RemoteEngine, ranks: list[int], msg: wire.PushRequest,
                  deadline: float) -> None:
        for rank in ranks:  # an unanswered ask ends with the push's own deadline, if sooner
            wait = min(self.config.handshake_timeout, max(0.1, deadline - time.monotonic()))
            sidechannel.request(remote.host, remote.port + rank, msg, wait, self._secret)

    def _poll_pushed(self, finished: set[str], failed: dict[str, str]) -> None:
        if not self._awaiting:
            return
        self._drain_notifications()
        now = time.monotonic()
        for req_id, wait in list(self._awaiting.items()):
            reason = None
            if wait.asked is not None and wait.asked.done() and wait.asked.exception():
                reason = (f"push request to prefill ranks {sorted(wait.waiting)} of "
                          f"{wait.remote.engine_id} failed: {wait.asked.exception()}")
            elif wait.error is not None:
                reason = wait.error
            elif not wait.waiting:
                finished.add(req_id)
            elif now > wait.deadline:
                reason = (f"prefill ranks {sorted(wait.waiting)} of {wait.remote.engine_id} did "
                          "not push within the timeout")
            else:
                continue
            del self._awaiting[req_id]
            if reason is not None:
                failed[req_id] = reason
                log.warning("push of %s failed: %s", req_id, reason)

    def push_requests(self) -> list[wire.PushRequest]:
        """Prefill side: decode ranks waiting for a request to be written (drained)."""
        with self._notif_lock:
            out, self._push_inbox = self._push_inbox, []
        return out

    def push(self, msg: wire.PushRequest, local_ids: npt.ArrayLike) -> str:
        """Prefill side: WRITE ``local_ids`` into the decode rank's blocks; returns the id that
        :meth:`poll` reports (``req_id@engine/rank``)."""
        spec = self._require_spec()
        key = f"{msg.req_id}@{msg.engine_id}/{msg.tp_rank}"
        reads = push_targets(self.config.tp_size, self.config.tp_rank, msg.tp_size, msg.tp_rank,
                             spec.total_kv_heads, spec.mla)
        remote = RemoteEngine(msg.engine_id, msg.host, msg.port, msg.tp_size)
        self._start(key, Op.WRITE, remote, local_ids, msg.block_ids, reads)
        return key

    def refuse_push(self, msg: wire.PushRequest, reason: str) -> None:
        """Prefill side: tell a decode rank its push will not come, so it fails the request
        now instead of holding its reserved blocks until its timeout (best effort, async)."""
        note = wire.Notification(v=WIRE_VERSION, engine_id=self.config.engine_id,
                                 req_id=msg.req_id, tp_rank=self.config.tp_rank,
                                 tp_size=self.config.tp_size, kind="write", ok=False,
                                 detail=reason)
        self._intents.submit(self._send_failure, msg.host, msg.port + msg.tp_rank, note)

    def _send_failure(self, host: str, port: int, note: wire.Notification) -> None:
        # short deadline: the peer is often the reason the push failed (dead or hung), and
        # close() waits for queued notifications
        try:
            sidechannel.request(host, port, note, min(2.0, self.config.handshake_timeout),
                                self._secret)
        except KVLinkError as exc:
            log.info("could not tell %s:%d that %s will not be written: %s (it times out)",
                     host, port, note.req_id, exc)

    def expected_readers(self, reader_tp: int) -> int:
        """How many ranks of a ``reader_tp``-way consumer will say "done" to this rank (see
        :func:`kvlink.headmap.notify_targets`: replicas that were not read are told too)."""
        spec = self._require_spec()
        return sum(
            self.config.tp_rank in notify_targets(reader_tp, rank, self.config.tp_size,
                                                  spec.total_kv_heads, spec.mla)
            for rank in range(reader_tp))

    def stats(self) -> Mapping[str, TransportStats]:
        return {n: t.stats for n, t in self.transports.items()}

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        # flush queued "done" notifications (bounded by the side-channel timeout): cancelling
        # them would leave unread replicas holding blocks until their leases expire
        self._intents.shutdown(wait=True)
        self._notifier.shutdown(wait=True)
        for t in self.transports.values():
            t.close()
        self.transports.clear()
