"""Worker side: register memory, handshake, post READ/WRITE, poll, report.

Never decides policy (that is the scheduler's): it is told which blocks to move and reports
which requests finished or failed. Only handshakes run on helper threads (a slow peer never
blocks the caller); everything per request — planning, posting, polling, the read report and
its verdict — runs on the caller's thread inside :meth:`KVWorker.read` / :meth:`KVWorker.poll`,
over one kept-open session per peer (:mod:`kvlink.channel`), so a caller that polls in a tight
loop starves nothing the request waits for.

Block ownership (the invariant: a block is reused only when no peer can still touch it):

- **Pull, validate after read.** A producer holds a request's blocks in :attr:`KVWorker.leases`
  (:class:`kvlink.scheduler.BlockLeases`). A reader told the hold's generation (with the block
  ids, as a router passes them) posts its READ at once and reports ``ReadDone`` (generation,
  block ids) after: intact only if that generation still holds those blocks, which — the
  generation minted before any reader knew it — means held for the whole READ. Otherwise the
  reader first sends a ``ReadIntent`` (the block ids
  it will read, the producer incarnation it handshook with) and gets a ``ReadGrant`` (the
  lease's generation and how long it holds). It does not post past that deadline. After its
  READ is DONE it sends ``ReadDone`` with the generation and gets a ``ReadVerdict``: only
  "intact" makes the request finished; a lease that ended under the READ makes it failed. A
  READ that fails (or is never posted) sends ``ReadDone(ok=False)``, releasing the producer at
  once. Unread replicas (heterogeneous TP) are released the same way, finished or failed.
- **Push, cancel and ack** (:mod:`kvlink.push`): a push carries an id and a time to live; the
  prefill never posts after either runs out or a cancel arrives; a decode that timed out
  cancels and frees its blocks only on an answer, or once its transport fenced the prefill off.
- **Incarnation.** Every handshake answer carries the producer's random incarnation; intents
  and done reports carry it back. A restarted producer answers "stale", and the reader
  handshakes again instead of reading through old mappings or keys. Peers are cached by engine
  id *and* address, so two engines sharing an id are never mixed up.
- **Transport contract** (:mod:`kvlink.transport`): FAILED means no byte can still land, so a
  failed part is safe to report. A failed transfer does not tear down the peer: other
  requests' transfers to it keep going.

:meth:`KVWorker.close` returns within ``close_timeout`` whatever the peers do: queued reports
get until then, the rest are cancelled.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvlink import localkey, sidechannel, wire
from kvlink.channel import Channels, Pending
from kvlink.compat import WIRE_VERSION, compat_hash
from kvlink.errors import (
    ConfigError,
    KVLinkError,
    TransferCancelled,
    TransferRefused,
    TransportUnavailable,
)
from kvlink.grants import block_extents, push_ticket, read_ticket
from kvlink.headmap import HeadRead, map_heads, notify_targets, push_targets
from kvlink.holdboard import HoldBoard, fingerprint
from kvlink.hostid import host_id
from kvlink.integrity import Checker, Level, Planes, spec_planes
from kvlink.layout import KVCacheSpec
from kvlink.peers import Peer, PeerTable
from kvlink.peers import RemoteEngine as RemoteEngine  # re-exported: the public API
from kvlink.plan import Plan, PlanTable
from kvlink.push import PushKey, PushSlots, PushWait, Rank, push_key
from kvlink.scheduler import BlockLeases, Grant, Refusal, Refused, Released, new_generation
from kvlink.transport import (
    Op,
    Runs,
    Transport,
    TransportContext,
    TransportStats,
    XferStatus,
    create_transport,
)

log = logging.getLogger("kvlink.worker")
_XFER_SECONDS_KEPT = 4096  # finished requests whose transport time KVWorker.xfer_seconds keeps
_NOTES_KEPT = 65536  # "written" notifications waiting for poll()
_TRANSFERS_KEPT = 65536  # ended transfers KVWorker.transfers keeps until a caller takes them
T = TypeVar("T")
V = TypeVar("V")


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
    allow_insecure: bool = False  # bind an unauthenticated side channel on a non-loopback host
    lease_seconds: float = 120.0  # producer: how long a held request waits for its readers
    read_seconds: float = 30.0  # producer: a granted READ extends its lease this far (a hint)
    intent_timeout: float = 10.0  # reader: how long to retry a request not held (yet)
    close_timeout: float = 2.0  # close() returns within this, cancelling what it cannot send
    #: least privilege on the data plane (docs/security.md): a transport that can enforce it
    #: serves a peer's transfer only inside what this worker granted for it — a reader the
    #: blocks of a hold it was told the generation of, READ only; a pushing prefill the
    #: blocks reserved for that push, WRITE only, until the push ends. False: any peer that
    #: passed the handshake may touch all registered memory
    grants: bool = True
    #: prefill in push mode: take decodes' push requests (push_requests()); False: refuse them
    #: ("this rank serves pulls"), so nothing queues on a rank that never takes them
    serve_pushes: bool = False
    #: end-to-end KV integrity (kvlink.integrity, docs/integrity.md): "off", "sample" (about
    #: one block in 32 of every request, and its last) or "full". A producer sends its digests
    #: with every "intact" verdict; a reader with it on fails a receive whose landed KV differs,
    #: or that came without digests (fail closed)
    integrity: str = "off"
    #: same-host readers validate READs in shared memory instead of asking us after each one
    #: (kvlink.holdboard): a producer publishes its holds there; a reader uses the boards
    #: it is offered. False: every READ is validated by a round trip
    hold_board: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.tp_size > wire.MAX_TP:
            raise ConfigError(f"tp_size {self.tp_size} exceeds {wire.MAX_TP}")
        wire.check_id(self.engine_id, "engine_id")
        if not self.transports:
            raise ConfigError("transports must name at least one transport")
        Level.parse(self.integrity, "integrity")
        for key in ("handshake_timeout", "lease_seconds", "read_seconds", "intent_timeout",
                    "close_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)!r}")


@dataclasses.dataclass(frozen=True)
class _Go:
    """A part may be posted: the peer, and the generation its READ is validated against (with
    the local deadline of an intent's grant; a READ told its generation has none)."""

    peer: Peer
    generation: int = 0
    deadline: float = float("inf")


@dataclasses.dataclass
class Phases:
    """Where one finished request's time went, in seconds (see :attr:`KVWorker.phases`):
    ``wait`` handshake or read intent before the first post, ``plan`` block planning, ``post``
    the transports' post calls, ``transfer`` post to the last part's DONE, ``verdict`` DONE to
    the producer's answer (pull) — all on the caller's thread, measured by its clock."""

    wait: float = 0.0
    plan: float = 0.0
    post: float = 0.0
    transfer: float = 0.0
    verdict: float = 0.0


class Transfer(NamedTuple):
    """One transfer this rank posted, once the transport said DONE or FAILED (see
    :attr:`KVWorker.transfers`): a plain tuple, so recording it costs one append on the poll
    path. A request has one per part it posted (more with heterogeneous TP, or a READ posted
    again after a refusal)."""

    transport: str  # the transport this peer was reached over (chosen per peer)
    post_seconds: float  # host time inside the transport's post call
    nbytes: int
    descriptors: int  # extents posted (after kvlink's coalescing)
    xfer_seconds: float  # post to completion (see KVWorker.xfer_seconds for the clock)
    ok: bool  # DONE; False: FAILED (refused ones included), nothing more can land


@dataclasses.dataclass
class _Part:
    read: HeadRead
    peer: cf.Future[Peer]
    intent: Pending | None = None  # READ without a generation: the grant, asked
    handle: int | None = None
    go: _Go | None = None
    done: bool = False
    error: str | None = None
    plan: Plan | Runs | None = None
    verdict: Pending | None = None  # READ: the producer's answer to ReadDone
    asks: int = 0  # "not held yet" answers so far
    retry_at: float = 0.0  # when to ask again after "not held yet"
    restarts: int = 0  # "stale" answers: the producer restarted, handshake again
    reask: bool = False  # a READ's report answered "not held yet": report again at retry_at
    refused: bool = False  # the owner refused the READ (nothing moved): verdict = its intent
    failure: str | None = None  # a READ told its generation FAILED: did the producer restart?
    board: bool = False  # READ: validated on the producer's hold board once it is DONE
    nbytes: int = 0  # bytes this part's post moves
    t_post: float = 0.0
    post_seconds: float = 0.0  # inside the transport's post call
    t_done: float = 0.0
    xfer_seconds: float = 0.0  # transport post to completion (see KVWorker.xfer_seconds)

    @property
    def settled(self) -> bool:
        """Nothing of this part is moving or awaited any more."""
        return self.done or (self.error is not None and self.handle is None
                             and self.verdict is None)


@dataclasses.dataclass
class _Request:
    req_id: str
    op: Op
    remote: RemoteEngine
    local_ids: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    parts: list[_Part]
    t_start: float
    generation: int | None = None  # READ: the hold's, passed with the block ids (no intent)
    t_mono: float = dataclasses.field(default_factory=time.monotonic)  # start, monotonic
    nbytes: int = 0
    phases: Phases = dataclasses.field(default_factory=Phases)
    push: wire.PushRequest | None = None  # prefill side of a push: the decode's request
    push_key: PushKey | None = None
    lease: tuple[str, int] | None = None  # a push from held blocks: (request, generation)
    fingerprint: int | None = None  # of remote_ids, for the hold board (once per request)
    #: a push with integrity on: (decode block ids, digests, folded) for its "written" note
    digests: tuple[list[int], bytes, bool] | None = None
    #: one layer range of a layer-wise push: [from, to), and the push's id (see _Layered)
    layers: tuple[int, int] | None = None
    layered: str | None = None


@dataclasses.dataclass
class _Layered:
    """Prefill side of one layer-wise push (:meth:`KVWorker.push` with ``layers``): each call
    posts one range as its own WRITE; the decode hears of each range once it landed, and of
    the push ("written", or why not) once every range is DONE, or once it failed and nothing
    of it is in flight."""

    msg: wire.PushRequest
    key: PushKey
    layers: int  # the cache's: the push is written when [0, layers) is
    lease: tuple[str, int] | None  # (held request, generation): validated once at the end
    next_layer: int = 0
    inflight: set[str] = dataclasses.field(default_factory=set)  # its ranges' request ids
    error: str | None = None
    #: ranges DONE since the last poll, told the decode at the poll's end, merged (an 80-layer
    #: push that lands while the caller waits on its forward is one note, not 80)
    landed: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Awaiting:
    """Push mode, decode side: the request's remote and its ownership state."""

    remote: RemoteEngine
    wait: PushWait
    local_ids: npt.NDArray[np.int64]  # the blocks reserved for it (checked at "written")
    asked: list[Pending] = dataclasses.field(default_factory=list)
    #: layer-wise pushes: per prefill rank, the layer ranges that have landed
    layers: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    cancels: dict[int, Pending] = dataclasses.field(default_factory=dict)


def _push_rid(msg: wire.PushRequest) -> str:
    """The id :meth:`KVWorker.poll` reports a push under (one per decode rank and attempt)."""
    return f"push:{msg.engine_id}/{msg.tp_rank}/{msg.push_id}/{msg.req_id}"


class KVWorker:
    """One TP rank's transfer engine; usable without vLLM."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.spec: KVCacheSpec | None = None
        self.agent_name = f"{config.engine_id}/{config.tp_rank}/{os.getpid()}-{time.time_ns()}"
        #: random per worker: a peer that sees it change knows we restarted
        self.incarnation = secrets.randbits(62) + 1
        self.transports: dict[str, Transport] = {}
        self._server: sidechannel.SideChannelServer | None = None
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # what the side channel thread shares with the caller's
        self._side_notifs: list[wire.Notification] = []
        self._push_inbox: list[wire.PushRequest] = []
        self._push_slots = PushSlots()
        # (engine, rank) -> agents that handshook with us: fenced off when a push goes silent
        self._handshook: dict[tuple[str, int], set[str]] = {}
        self._awaiting: dict[str, _Awaiting] = {}
        self._abort = threading.Event()
        self._calls: set[cf.Future[Any]] = set()
        self.peers = PeerTable(config.engine_id, self.agent_name, config.tp_rank,
                               config.tp_size, self._require_spec, self.transports, self._call,
                               lambda fn, remote, rank: self._submit(self._pool, fn, remote,
                                                                     rank))
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlink-hs",
                                           initializer=self._thread_init)
        #: producer side: the requests held for readers (see the module docstring)
        self.leases = BlockLeases(config.lease_seconds, read_seconds=config.read_seconds,
                                  on_release=self._revoke_hold)
        self.integrity = Checker(Level(config.integrity))
        #: producer: our holds in shared memory for same-host readers (created at register)
        self.board: HoldBoard | None = None
        #: reader: READs validated on a producer's hold board, without a round trip
        self.board_validated = 0
        #: prefill: layer-wise pushes being written, by the id push() returned; and why the
        #: ended ones ended (a late range of one is refused naming it)
        self._layered: dict[str, _Layered] = {}
        self._layered_ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._slices: dict[tuple[int, int, int], tuple[KVCacheSpec, KVCacheSpec]] = {}
        self._secret = sidechannel.secret_from_env(config.secret)
        #: messages refused because they did not come from the transfer's peer (a release
        #: without the hold's generation, a note for another push, a hold not from our own
        #: scheduler), by kind; the data plane's own refusals are in stats()[name].refused
        self.refusals: collections.Counter[str] = collections.Counter()
        self._engine_key: bytes | None = None  # for our scheduler's holds (kvlink.localkey)
        # every per-request message (intents, reports, notes, cancels) goes through kept-open
        # connections, driven from the caller's thread (see kvlink.channel)
        self._chan = Channels(self._secret)
        self._told: list[Pending] = []  # reports nobody waits for, kept to log failures
        self._readers: dict[int, int] = {}  # consumer TP -> readers per hold (see below)
        self.finished_bytes = 0
        self.raw_descriptors = 0  # before coalescing, over finished requests
        self.descriptors = 0
        #: finished request id -> transport-level seconds, post to completion (the slowest
        #: part): the transport's own timing where it has one (NIXL telemetry ``xferDuration``,
        #: with the nixl option ``telemetry``), else post() call to DONE seen by poll().
        #: Excludes handshake, read intents and the step loop. Callers pop what they read.
        self.xfer_seconds: dict[str, float] = {}
        #: finished request id -> where its time went (:class:`Phases`). Callers pop them.
        self.phases: dict[str, Phases] = {}
        #: every transfer posted that ended, in order (:class:`Transfer`), for per-transport
        #: metrics; :meth:`take_transfers` drains it. Bounded: the oldest drop if nobody does
        self.transfers: collections.deque[Transfer] = collections.deque(maxlen=_TRANSFERS_KEPT)
        #: reports nobody waits for (releases, read reports, "written" notes) that could not
        #: be delivered, since start (each is logged)
        self.reports_failed = 0
        #: takes ``wire.Hold`` messages of our own engine's scheduler (the vLLM connector sets
        #: it); called on the side channel's thread. None: they are refused
        self.hold_hook: Callable[[wire.Hold], None] | None = None

    # ------------------------------------------------------------------ setup
    def register(self, spec: KVCacheSpec, planes: Planes | None = None) -> None:
        """Register the cache with every configured transport that can take it; start serving.

        ``planes``: the framework's own logical views of the cache (``integrity.tensor_planes``)
        for integrity digests; default: views of the memory as ``spec`` describes it."""
        if spec.tp_size != self.config.tp_size or spec.tp_rank != self.config.tp_rank:
            spec = dataclasses.replace(spec, tp_size=self.config.tp_size,
                                       tp_rank=self.config.tp_rank)
        self.spec = spec
        if self.integrity.on:
            self.integrity.planes = planes if planes is not None else spec_planes(spec)
        ctx = TransportContext(agent_name=self.agent_name, host=self.config.host,
                               advertise_host=self.config.advertise_host, host_id=host_id(),
                               require_grants=self.config.grants)
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
            if self.config.hold_board and self.board is None:
                self.board = HoldBoard.create()
            port = self.config.side_port + self.config.tp_rank if self.config.side_port else 0
            self._server = sidechannel.SideChannelServer(
                self.config.host, port, self._on_side_message,
                name=f"kvlink-side-{self.config.tp_rank}", secret=self._secret,
                allow_insecure=self.config.allow_insecure)
            log.info("rank %d side channel on %s:%d", self.config.tp_rank, self.config.host,
                     self._server.port)

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

    def _require_spec(self) -> KVCacheSpec:
        if self.spec is None:
            raise ConfigError("register() a KV cache before transferring")
        return self.spec

    # ------------------------------------------------------------------ side-channel calls
    def _submit(self, pool: cf.ThreadPoolExecutor, fn: Callable[..., T],
                *args: Any) -> cf.Future[T]:
        """Run ``fn`` on ``pool``, tracked so close() can wait for it (bounded) or cancel it."""
        fut = pool.submit(fn, *args)
        with self._lock:
            self._calls.add(fut)
        fut.add_done_callback(self._forget_call)
        return fut

    def _forget_call(self, fut: cf.Future[Any]) -> None:
        with self._lock:
            self._calls.discard(fut)

    def _call(self, host: str, port: int, msg: wire._Msg,
              timeout: float | None = None) -> wire._Msg:
        return sidechannel.request(host, port, msg, timeout or self.config.handshake_timeout,
                                   self._secret, cancel=self._abort)

    # ------------------------------------------------------------------ side channel server
    def _on_side_message(self, msg: object) -> wire.Reply:
        if isinstance(msg, wire.HandshakeRequest):
            return self._answer_handshake(msg)
        if isinstance(msg, wire.ReadIntent):
            return self._answer_intent(msg)
        if isinstance(msg, wire.ReadDone):
            return self._answer_done(msg)
        if isinstance(msg, wire.Notification):
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
        if isinstance(msg, wire.PushRequest):
            return self._answer_push(msg)
        if isinstance(msg, wire.Hold):
            return self._answer_hold(msg)
        if isinstance(msg, wire.PushCancel):
            with self._lock:
                state = self._push_slots.cancel(push_key(msg.engine_id, msg.tp_rank, msg.req_id,
                                                         msg.push_id))
            log.info("push of %s to %s rank %d cancelled by the decode: %s", msg.req_id,
                     msg.engine_id, msg.tp_rank, state)
            return wire.PushState(v=WIRE_VERSION, state=state)
        return wire.ErrorReply(v=WIRE_VERSION, code="unsupported",
                               message=f"{type(msg).__name__} not handled here")

    def _answer_handshake(self, req: wire.HandshakeRequest) -> wire.Reply:
        spec = self._require_spec()
        ours = compat_hash(spec.geometry())
        if req.compat != ours:  # also between compatible TP sizes (a one-head page's layout
            # is "any"): the peer compares the values and names the ones that differ
            log.debug("handshake from %s (rank %d) with compat %s != ours %s", req.engine_id,
                      req.tp_rank, req.compat, ours)
        with self._lock:
            self._handshook.setdefault((req.engine_id, req.tp_rank), set()).add(req.agent_name)
        return wire.HandshakeResponse(
            v=WIRE_VERSION, engine_id=self.config.engine_id, agent_name=self.agent_name,
            tp_rank=self.config.tp_rank, tp_size=self.config.tp_size, host_id=host_id(),
            compat=ours, spec=wire.SpecMsg.of(spec), transports=self._offer(req),
            incarnation=self.incarnation,
            session_port=self._server.session_port if self._server is not None else 0,
            board=self._board_offer(req),
        )

    def _board_offer(self, req: wire.HandshakeRequest) -> wire.BoardMsg | None:
        if self.board is None or req.host_id != host_id():
            return None
        offer = self.board.offer()
        return wire.BoardMsg(name=offer.name, token=offer.token)

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

    def engine_key(self) -> bytes:
        """The key our own engine's scheduler signs its holds with (:mod:`kvlink.localkey`)."""
        if self._engine_key is None:
            self._engine_key = localkey.engine_key(self.config.engine_id, self._secret)
        return self._engine_key

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

    # ------------------------------------------------------------------ handshake (client)
    def _peer(self, remote: RemoteEngine, rank: int,
              incarnation: int | None = None) -> cf.Future[Peer]:
        return self.peers.get(remote, rank, incarnation)

    def forget_peer(self, engine_id: str, rank: int) -> None:
        """Drop cached handshake state of ``engine_id``'s ``rank`` at every address (the next
        request handshakes again). Its transfers in flight turn FAILED (quiescent)."""
        self.peers.forget(engine_id, rank)

    def connected_peers(self) -> list[str]:
        """Agent names of peers with live handshake state."""
        return self.peers.connected()

    def _send(self, host: str, port: int, msg: wire.Request,
              timeout: float | None = None) -> Pending:
        """Queue ``msg`` on the kept-open connection to ``host:port`` (sent at the end of this
        call's :meth:`read`/:meth:`poll`); its answer is taken by a later :meth:`poll`."""
        return self._chan.call(host, port, msg, timeout or self.config.handshake_timeout)

    def _tell(self, host: str, port: int, msg: wire.Request, quiet: bool = False) -> None:
        """Send a report nobody waits for (a release, a "written" note): a failure is logged.
        ``quiet``: not even its answer (kvlink.channel: the server answers nothing)."""
        self._told.append(self._chan.call(host, port, msg,
                                          min(2.0, self.config.handshake_timeout), quiet))

    def _log_told(self) -> None:
        if not self._told:
            return
        keep = []
        for pending in self._told:
            if not pending.done():
                keep.append(pending)
            elif pending.exception() is not None:
                self.reports_failed += 1
                log.info("could not tell %s: %s", pending.what, pending.exception())
        self._told = keep

    # ------------------------------------------------------------------ transfers
    def read(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike, generation: int | None = None) -> None:
        """Pull a request's blocks (non-blocking); completion is reported by :meth:`poll`.

        Finished means the producer confirmed its lease was intact for the whole READ.
        ``generation``: the producer's hold (:meth:`hold`'s answer, passed along with the block
        ids): the READ is posted here, at once (once the peer's handshake is cached), and
        validated after; without it, a read intent asks the producer for the generation first
        (one more round trip)."""
        if generation is not None and not 0 < generation < 2**63:
            raise ConfigError(f"request {req_id}: generation must be a positive 63-bit "
                              f"integer, got {generation!r}")
        self._start(req_id, Op.READ, remote, local_ids, remote_ids, generation=generation)

    def write(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
              remote_ids: npt.ArrayLike) -> None:
        """Push a request's blocks into the remote's blocks (non-blocking)."""
        self._start(req_id, Op.WRITE, remote, local_ids, remote_ids)

    def _start(self, req_id: str, op: Op, remote: RemoteEngine, local_ids: npt.ArrayLike,
               remote_ids: npt.ArrayLike, reads: list[HeadRead] | None = None,
               push: wire.PushRequest | None = None, key: PushKey | None = None,
               generation: int | None = None, lease: tuple[str, int] | None = None,
               digests: tuple[list[int], bytes, bool] | None = None,
               layers: tuple[int, int] | None = None, layered: str | None = None) -> None:
        spec = self._require_spec()
        wire.check_id(req_id if push is None else push.req_id, "request id")
        if req_id in self._requests:
            raise ConfigError(f"request {req_id!r} is already in flight")
        lids = spec.check_block_ids(local_ids, "local")
        rids = np.asarray(remote_ids)
        if rids.ndim != 1 or rids.shape != lids.shape:
            raise ConfigError(f"request {req_id}: {lids.shape[0]} local vs "
                              f"{np.shape(rids)} remote block ids")
        rids = rids.astype(np.int64)
        if reads is None:
            reads = map_heads(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        inc = push.incarnation if push is not None and push.incarnation else None
        req = _Request(req_id, op, remote, lids, rids,
                       [_Part(r, self._peer(remote, r.remote_rank, inc)) for r in reads],
                       time.perf_counter(), generation=generation, push=push, push_key=key,
                       lease=lease, digests=digests, layers=layers,
                       layered=layered)  # set before the first post: they decide how
        # "written" goes
        self._requests[req_id] = req
        self._step(req)  # a cached peer: posted now, on the caller's thread
        self._chan.flush()

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Advance every request; returns (finished ids, {failed id: reason}) since last call.

        A request is reported only when nothing of it can still move: finished (READ: the
        producer confirmed the lease intact) or failed (every part quiescent). Everything
        runs here, on the caller's thread: answers that arrived are taken, DONE transfers
        are reported, and every message this produced leaves in one frame per peer."""
        finished: set[str] = set()
        failed: dict[str, str] = {}
        if self._server is not None:  # what peers told us, taken now (not after a GIL switch)
            self._server.serve_ready()
        self._chan.pump()
        self._log_told()
        self._poll_pushed(finished, failed)
        if self._layered:
            self._poll_layered(finished, failed)
        threads = False
        for req in list(self._requests.values()):
            if self._step(req):
                self._report(req, finished, failed)
            else:
                threads = threads or any(
                    p.handle is not None and p.go is not None
                    and p.go.peer.transport.capabilities.python_threads for p in req.parts)
        if self._layered:
            self._tell_landed()
        self._chan.flush()
        if self._awaiting and not threads:  # a push comes in: a peer's WRITE into our blocks
            # may be served by a transport's own threads too
            threads = any(t.capabilities.python_threads for t in self.transports.values())
        if threads:  # let a transport's own threads move our bytes (see Capabilities)
            time.sleep(0)
        return finished, failed

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, waking early when a side-channel answer arrives
        (with the GIL released). For a caller with nothing else to do between polls."""
        self._chan.wait(timeout)

    def _step(self, req: _Request) -> bool:
        """Advance every part of ``req``; True once all of them are settled."""
        for part in req.parts:
            try:
                self._advance(req, part)
            except Exception as exc:  # a transport's bug must not kill the caller's loop
                log.exception("request %s: advancing a part failed", req.req_id)
                self._part_failed(req, part, f"{type(exc).__name__}: {exc}")
        return all(p.settled for p in req.parts)

    def _report(self, req: _Request, finished: set[str], failed: dict[str, str]) -> None:
        del self._requests[req.req_id]
        if req.layered is not None:
            self._report_layers(req, finished, failed)
            return
        errors = [p.error for p in req.parts if p.error]
        if req.op is Op.READ:  # replicas holding our heads that we did not read: a producer
            # takes a release only with the hold's generation (the one we read under, where
            # the producer ranks share it, as a generation minted by the caller is shared)
            granted = [p.go.generation for p in req.parts if p.go is not None and
                       p.go.generation]
            self.release(req.req_id, req.remote, {p.read.remote_rank for p in req.parts},
                         req.generation or (granted[0] if granted else None))
        if req.lease is not None and req.push is not None:
            intact = self.leases.finish_read(
                req.lease[0], f"{req.push.engine_id}/{req.push.tp_rank}", req.lease[1],
                not errors, self.expected_readers(req.push.tp_size))
            if not errors and not intact:
                errors.append(f"the lease of {req.lease[0]} ended under the WRITE: the "
                              "written bytes are not trusted")
        if errors:
            failed[req.req_id] = "; ".join(errors)
            log.warning("request %s failed: %s", req.req_id, failed[req.req_id])
            if req.push is not None:  # the decode is waiting: tell it (quiescent now)
                self._notify_written(req, ok=False, detail=failed[req.req_id])
        else:
            finished.add(req.req_id)
            if req.op is Op.WRITE and not self._notes_natively(req):
                rank = req.parts[0].read.remote_rank
                host, port = ((req.push.host, req.push.port + req.push.tp_rank)
                              if req.push is not None else
                              (req.remote.host, req.remote.port + rank))
                self._tell(host, port, self._written(req, True))
            self.finished_bytes += req.nbytes
            self._remember(self.xfer_seconds, req.req_id,
                       max((p.xfer_seconds for p in req.parts), default=0.0))
            now = time.perf_counter()
            req.phases.verdict = max((now - p.t_done for p in req.parts if p.t_done),
                                     default=0.0)
            self._remember(self.phases, req.req_id, req.phases)
            self.raw_descriptors += sum(p.plan.raw_descriptors for p in req.parts if p.plan)
            self.descriptors += sum(p.plan.descriptors for p in req.parts if p.plan)
        if req.push_key is not None:
            with self._lock:
                self._push_slots.finish(req.push_key, not errors)

    @staticmethod
    def _remember(kept: dict[str, V], key: str, value: V) -> None:
        kept[key] = value
        if len(kept) > _XFER_SECONDS_KEPT:  # nobody reads them: bounded
            del kept[next(iter(kept))]

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
        unreachable = part.peer.exception()
        where = f"{req.remote.engine_id} rank {part.read.remote_rank}"
        if unreachable is not None:  # or incompatible: nothing was granted or posted
            part.error = f"{where}: {unreachable}"
            return
        peer = part.peer.result()
        if req.op is not Op.READ:
            part.go = _Go(peer)
        elif req.generation is not None:
            part.go = _Go(peer, req.generation)
        elif part.intent is None:
            part.intent = self._send(req.remote.host, req.remote.port + part.read.remote_rank,
                                     wire.ReadIntent(v=WIRE_VERSION,
                                                     engine_id=self.config.engine_id,
                                                     req_id=req.req_id,
                                                     tp_rank=self.config.tp_rank,
                                                     incarnation=peer.incarnation,
                                                     block_ids=req.remote_ids.tolist()))
        elif part.intent.done():
            intent, part.intent = part.intent, None
            try:
                reply = intent.result()
            except KVLinkError as exc:
                if not self._again(req, part, exc, intent.asked):
                    part.error = f"{where}: refused the READ of {req.req_id}: {exc}"
                return
            if not isinstance(reply, wire.ReadGrant):
                part.error = (f"{where} answered {type(reply).__name__} to a read intent; "
                              "refusing to read unverified blocks")
                return
            part.go = _Go(peer, reply.generation, intent.asked + reply.expires_in)
        if part.go is not None:
            req.phases.wait = max(req.phases.wait, time.perf_counter() - req.t_start)

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
            if post_runs is not None:
                plan = table.runs(req.local_ids, req.remote_ids, local_checked=True,
                                  coalesce=getattr(transport, "coalesce_runs", True))
            if plan is None:
                plan = table.plan(req.local_ids, req.remote_ids, transport.extents)
        except KVLinkError as exc:
            self._part_failed(req, part, str(exc))
            return
        part.plan = plan
        part.t_post = time.perf_counter()
        req.phases.plan += part.t_post - t0
        ticket = (push_ticket(req.push.req_id, req.push.push_id) if req.push is not None
                  else read_ticket(req.req_id, go.generation) if go.generation else b"")
        try:
            if isinstance(plan, Runs):
                assert post_runs is not None
                part.handle = post_runs(req.op, go.peer.agent, plan, ticket=ticket)
            else:
                part.handle = transport.post(req.op, go.peer.agent, plan.local, plan.remote,
                                             note, ticket=ticket)
        except KVLinkError as exc:  # the contract says FAILED handle; be safe with any plugin
            self._part_failed(req, part, f"post to {go.peer.agent} failed: {exc}")
            return
        part.post_seconds = time.perf_counter() - part.t_post
        req.phases.post += part.post_seconds
        part.board = self._on_board(req, go)  # after the post: while the bytes move
        part.nbytes = plan.nbytes  # read now: a transport may recycle the extents once done
        req.nbytes += part.nbytes

    def _progress(self, req: _Request, part: _Part) -> None:
        assert part.go is not None and part.handle is not None
        transport = part.go.peer.transport
        state = transport.poll(part.handle)
        if state.status is XferStatus.PENDING:
            return
        part.t_done = time.perf_counter()
        req.phases.transfer = max(req.phases.transfer, part.t_done - part.t_post)
        part.xfer_seconds = self._transport_seconds(part)
        self.transfers.append(Transfer(
            transport.name, part.post_seconds, part.nbytes,
            part.plan.descriptors if part.plan is not None else 0, part.xfer_seconds,
            state.status is XferStatus.DONE))
        transport.release(part.handle)
        part.handle = None
        reason = f"{req.remote.engine_id} rank {part.read.remote_rank}: {state.reason}"
        if (state.status is XferStatus.FAILED and state.refused and req.generation is not None
                and part.t_post - req.t_start < self.config.intent_timeout):
            # nothing moved: the producer had not held it yet (we were told the generation
            # first), or no longer does. Ask which (an intent answers with the generation)
            part.failure, part.refused = reason, True
            part.verdict = self._send(req.remote.host, req.remote.port + part.read.remote_rank,
                                      wire.ReadIntent(v=WIRE_VERSION,
                                                      engine_id=self.config.engine_id,
                                                      req_id=req.req_id,
                                                      tp_rank=self.config.tp_rank,
                                                      incarnation=part.go.peer.incarnation,
                                                      block_ids=req.remote_ids.tolist()))
        elif state.status is XferStatus.FAILED and req.generation is not None and (
                part.restarts < 2):
            # quiescent by contract. Nothing asked the producer before this READ, so it may
            # have restarted since our handshake: its answer to the release says ("stale":
            # READ again after a new handshake); a dead one fails it within the report timeout
            part.failure = reason
            part.verdict = self._send(req.remote.host, req.remote.port + part.read.remote_rank,
                                      self._read_done(req, part, False),
                                      min(2.0, self.config.handshake_timeout))
        elif state.status is XferStatus.FAILED:  # quiescent by contract: safe to report
            self._part_failed(req, part, reason)
        elif req.op is Op.READ and part.go.generation:
            if part.board and self._board_still_shows(req, part.go):
                # still held now that the READ is over: intact (kvlink.holdboard). The report
                # only lets the producer count us done: nobody waits for its answer
                part.done = True
                self.board_validated += 1
                self._tell(req.remote.host, req.remote.port + part.read.remote_rank,
                           self._read_done(req, part, True), quiet=True)
            else:
                part.verdict = self._report_read(req, part, True)
        else:
            part.done = True

    def _on_board(self, req: _Request, go: _Go) -> bool:
        """Whether this READ will be validated on the producer's hold board: one is open and
        no digests are wanted (they come with the producer's verdict)."""
        board = go.peer.board if self.config.hold_board else None
        if board is None or req.op is not Op.READ or not go.generation or self.integrity.on:
            return False
        if req.fingerprint is None:
            req.fingerprint = fingerprint(req.remote_ids)
        return True

    @staticmethod
    def _board_still_shows(req: _Request, go: _Go) -> bool:
        board = go.peer.board
        return (board is not None and req.fingerprint is not None
                and board.still_holds(go.generation, req.fingerprint))

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
            self._check_landed(req, part, reply)
            return
        if isinstance(reply, wire.ReadVerdict):
            why = reply.reason
        elif reply is not None:
            why = f"answered {type(reply).__name__}"
        part.error = (f"{req.remote.engine_id} rank {part.read.remote_rank}: READ not "
                      f"confirmed, its bytes are not trusted: {why}")

    def _check_landed(self, req: _Request, part: _Part, verdict: wire.ReadVerdict) -> None:
        """An intact READ: with integrity on, its bytes count only if they digest like the
        producer's (the heads this part read; kvlink.integrity)."""
        spec = self._require_spec()
        r = part.read
        why = self.integrity.check(req.req_id, req.local_ids, req.remote_ids,
                                   (r.local_start, r.remote_start, r.count),
                                   verdict.digest_ids, verdict.digests, verdict.folded,
                                   spec.num_layers, spec.num_kv)
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
        part.go, part.plan, part.nbytes = None, None, 0

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
                             block_ids=(req.remote_ids.tolist()
                                        if req.generation is not None else None))

    def _report_read(self, req: _Request, part: _Part, ok: bool) -> Pending:
        return self._send(req.remote.host, req.remote.port + part.read.remote_rank,
                          self._read_done(req, part, ok))

    @staticmethod
    def _transport_seconds(part: _Part) -> float:
        """Post to completion of one finished part: the transport's own timing if it keeps one
        (``xfer_telemetry``: NIXL's ``xferDuration``, what vLLM's NixlConnector reports as
        ``vllm:nixl_xfer_time_seconds``), else our clock from post() to the poll that saw DONE."""
        transport = part.go.peer.transport if part.go is not None else None
        telemetry = getattr(transport, "xfer_telemetry", None)
        if telemetry is not None and part.handle is not None:
            try:
                entries = telemetry(part.handle)
            except KVLinkError:
                entries = []
            us = sum(float(e.get("xfer_us", 0.0)) for e in entries)
            if us > 0:
                return us / 1e6
        return time.perf_counter() - part.t_post

    def release(self, req_id: str, remote: RemoteEngine, skip: set[int] | None = None,
                generation: int | None = None) -> None:
        """Reader side: we are done with ``req_id`` without reading it (a full local prefix
        hit, an aborted request) from the producer ranks holding it for us, except ``skip``
        (those we read, or that wrote to us: they count us themselves). ``generation``: the
        hold's, where known (a producer ignores a release naming another hold of the same
        request id). Sent with the next frame to each peer (at the latest by the next
        :meth:`poll`)."""
        spec = self._require_spec()
        rest = notify_targets(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla) - (skip or set())
        for rank in sorted(rest):
            self._tell(remote.host, remote.port + rank,
                       wire.ReadDone(v=WIRE_VERSION, engine_id=self.config.engine_id,
                                     req_id=req_id, tp_rank=self.config.tp_rank,
                                     tp_size=self.config.tp_size, generation=generation or 0,
                                     ok=True))

    def _written(self, req: _Request, ok: bool, detail: str = "") -> wire.Notification:
        push = req.push
        ids, blob, folded = req.digests if ok and req.digests is not None else ([], b"", False)
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

    def _notify_written(self, req: _Request, ok: bool, detail: str = "") -> None:
        """A push that ended: say so to the decode rank (over the side channel)."""
        assert req.push is not None
        self._tell(req.push.host, req.push.port + req.push.tp_rank,
                   self._written(req, ok, detail))

    def take_transfers(self) -> list[Transfer]:
        """The transfers that ended since the last call (:attr:`transfers`), oldest first.
        Call it on the thread that polls (the deque is filled there)."""
        out = list(self.transfers)
        self.transfers.clear()
        return out

    def descriptor_counts(self) -> tuple[int, int]:
        """(before, after) coalescing, summed over finished requests."""
        return self.raw_descriptors, self.descriptors

    def pending(self) -> int:
        return len(self._requests) + len(self._awaiting)

    # ------------------------------------------------------------------ producer side
    def hold(self, req_id: str, block_ids: npt.ArrayLike, readers: int | None = None,
             generation: int | None = None) -> int:
        """Hold ``block_ids`` for ``req_id``'s readers (pull): they READ under the lease until
        all ``readers`` are done (``None``: as many as the first reader's TP says), the lease
        expires, or :meth:`abort`. :meth:`released` reports the end.

        Returns the hold's generation (``generation``: one minted by the caller, see
        :meth:`BlockLeases.hold`). A reader given it reads at once, with no round trip before
        its READ (see :meth:`read`); it is also what lets the reader in: with
        :attr:`WorkerConfig.grants`, transports that can enforce it serve READs of these blocks
        only to a transfer that names it, until the hold ends (:mod:`kvlink.grants`)."""
        wire.check_id(req_id, "request id")
        self._require_spec().check_block_ids(block_ids, "held")  # a window is granted over them
        if generation is not None and not 0 < generation < 2**63:
            raise ValueError(f"generation must be a positive 63-bit integer, got {generation!r}")
        gen = new_generation() if generation is None else generation
        # granted before the hold is visible: a reader told the generation may READ at once;
        # digested before too: the verdict of that READ carries them
        ticket = read_ticket(req_id, gen)
        self._grant(ticket, Op.READ, block_ids)
        self.integrity.fix(req_id, gen, block_ids)
        try:
            held = self.leases.hold(req_id, block_ids, readers, gen)
        except ValueError:
            if self.leases.generation_of(req_id) != gen:  # not the same hold delivered twice
                self.integrity.drop(req_id, gen)
                for t in self._enforcing():
                    t.revoke(ticket)
            raise
        if self.board is not None:  # after the hold exists; withdrawn as it ends
            self.board.publish(held, block_ids)
        return held

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

    # ------------------------------------------------------------------ push, decode side
    def expect_push(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
                    timeout: float = 60.0) -> None:
        """Decode side: ask the prefill ranks to WRITE this request into ``local_ids``.

        Finished once every prefill rank signalled "written". After ``timeout`` (or a refusal)
        the push is cancelled; it is reported failed only once no byte of it can still land
        (every rank answered the cancel, or its transport fenced the prefill off), so the
        caller may reuse the blocks the moment it is reported.
        """
        spec = self._require_spec()
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
        self._awaiting[req_id] = _Awaiting(remote, wait, lids, [
            self._send(remote.host, remote.port + rank, msg, ask) for rank in sorted(ranks)])
        self._chan.flush()

    def _public_host(self) -> str:
        """Where peers dial this rank back: a wildcard bind address is no address to dial."""
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.config.host

    def _cancel_push(self, remote: RemoteEngine, rank: int, wait: PushWait) -> Pending:
        return self._send(remote.host, remote.port + rank, wire.PushCancel(
            v=WIRE_VERSION, engine_id=self.config.engine_id, req_id=wait.req_id,
            tp_rank=self.config.tp_rank, push_id=wait.push_id),
            min(2.0, self.config.handshake_timeout))

    def _take_written(self) -> None:
        with self._lock:
            notes, self._side_notifs = self._side_notifs, []
        for t in self.transports.values():
            for peer, raw in t.notifications():
                try:
                    notes.append(wire.decode(raw, wire.Notification))
                except KVLinkError as exc:
                    log.warning("dropped a bad notification from %s: %s", peer, exc)
        for note in notes:
            aw = self._awaiting.get(note.req_id)
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
            why = self._check_pushed(aw, note) if note.ok else None
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
        for rank in aw.wait.ranks:
            upto = 0
            for start, stop in sorted(aw.layers.get(rank, ())):
                if start > upto:
                    break
                upto = max(upto, stop)
            landed.append(upto)
        return min(landed, default=0)

    def _check_pushed(self, aw: _Awaiting, note: wire.Notification) -> str | None:
        """With integrity on: None when the heads this prefill rank wrote digest like the
        prefill's; else the reason (kvlink.integrity), which fails the push."""
        if not self.integrity.on:
            return None
        spec = self._require_spec()
        read = next((r for r in map_heads(self.config.tp_size, self.config.tp_rank,
                                          aw.remote.tp_size, spec.total_kv_heads, spec.mla)
                     if r.remote_rank == note.tp_rank), None)
        if read is None:
            return f"integrity: rank {note.tp_rank} wrote heads we did not ask of it"
        why = self.integrity.check(aw.wait.req_id, aw.local_ids, aw.local_ids,
                                   (read.local_start, read.remote_start, read.count),
                                   note.digest_ids, note.digests, note.folded,
                                   spec.num_layers, spec.num_kv)
        if why is not None:
            log.warning("push of %s from %s rank %d: %s", aw.wait.req_id, note.engine_id,
                        note.tp_rank, why)
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
            if wait.outcome() is None and (wait.error is not None or now > wait.deadline):
                if not wait.cancelling:
                    wait.fail(f"prefill ranks {wait.unsettled()} of {aw.remote.engine_id} did "
                              "not push within the timeout")
                    wait.cancelling = True
                    log.warning("push of %s: %s; cancelling", req_id, wait.error)
                self._settle_cancels(aw, now)
            outcome = wait.outcome()
            if outcome is None:
                continue
            del self._awaiting[req_id]
            self._revoke_push(wait, 0.0)  # no WRITE of this push is taken from now on
            self.release(req_id, aw.remote, set(wait.ranks))  # replicas that did not write
            if outcome:
                finished.add(req_id)
            else:
                failed[req_id] = wait.error or "push failed"
                log.warning("push of %s failed: %s", req_id, failed[req_id])

    def _settle_cancels(self, aw: _Awaiting, now: float) -> None:
        """Cancel the ranks that may still write; settle each on its answer, or by fencing it
        off when it cannot answer. A rank nothing can settle keeps the blocks (quarantine)."""
        wait = aw.wait
        for rank in wait.unsettled():
            fut = aw.cancels.get(rank)
            if fut is None:
                if now >= wait.next_cancel:
                    aw.cancels[rank] = self._cancel_push(aw.remote, rank, wait)
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
        ticket = push_ticket(wait.req_id, wait.push_id)
        enforcing = self._enforcing()
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

    # ------------------------------------------------------------------ push, prefill side
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
            # integrity: the digests go with "written" (fixed at the hold, or now: the blocks
            # are final, they are being pushed)
            digests = (self.integrity.for_push(msg.req_id, local_ids, msg.block_ids, held)
                       if self.integrity.on else None)
            self._start(rid, Op.WRITE, remote, local_ids, msg.block_ids, reads, msg, key,
                        lease=held, digests=digests)
        except KVLinkError:
            with self._lock:
                self._push_slots.finish(key, False)
            self._unread_push(msg, lease, generation)
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
        if self.integrity.on:
            raise ConfigError(f"push of {msg.req_id}: integrity {self.integrity.level.value} "
                              "does not cover layer-wise pushes yet: push whole requests, or "
                              "integrity off")
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
                           None if lease is None else (lease, generation))
            self._layered[rid] = lay
        else:
            if start != lay.next_layer:
                raise ConfigError(f"push of {msg.req_id}: layers come in order; the next is "
                                  f"{lay.next_layer}, got [{start}, {stop})")
            if lay.error is not None:
                raise TransferCancelled(f"push of {msg.req_id}: {lay.error}")
            with self._lock:
                self._push_slots.resume(lay.key)
        sub = f"{rid}@{start}-{stop}"
        remote = RemoteEngine(msg.engine_id, msg.host, msg.port, msg.tp_size)
        reads = push_targets(self.config.tp_size, self.config.tp_rank, msg.tp_size,
                             msg.tp_rank, spec.total_kv_heads, spec.mla)
        try:
            self._start(sub, Op.WRITE, remote, local_ids, msg.block_ids, reads, msg, lay.key,
                        layers=(start, stop), layered=rid)
        except KVLinkError as exc:  # nothing of this range was posted
            lay.error = lay.error or f"layers [{start}, {stop}) not posted: {exc}"
            raise
        lay.inflight.add(sub)
        lay.next_layer = stop
        return rid

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

    def _report_layers(self, req: _Request, finished: set[str], failed: dict[str, str]
                       ) -> None:
        """One range of a layer-wise push ended (every part quiescent)."""
        assert req.layered is not None and req.layers is not None and req.push is not None
        lay = self._layered.get(req.layered)
        if lay is None:
            return
        lay.inflight.discard(req.req_id)
        errors = [p.error for p in req.parts if p.error]
        if errors:
            lay.error = lay.error or (f"layers [{req.layers[0]}, {req.layers[1]}): "
                                      + "; ".join(errors))
        else:
            self.finished_bytes += req.nbytes
            lay.landed.append(req.layers)
        self._finish_layered(req.layered, finished, failed)

    def _tell_landed(self) -> None:
        """Tell each decode the layer ranges of its push that landed in this poll, merged
        into as few notes as they allow. (A push that finished in this poll was told
        "written" instead, which says all of it landed.)"""
        for lay in self._layered.values():
            if not lay.landed:
                continue
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
        """Layer-wise pushes the decode cancelled between two ranges: end them."""
        for rid, lay in list(self._layered.items()):
            with self._lock:
                stopped = self._push_slots.stopped(lay.key)
            if stopped and lay.error is None:
                lay.error = f"cancelled by the decode after layer {lay.next_layer}"
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
        self._tell(msg.host, msg.port + msg.tp_rank,
                   self._note(msg.req_id, msg.push_id, ok=why is None, detail=why or ""))
        if why is None:
            finished.add(rid)
        else:
            failed[rid] = why
            log.warning("layer-wise push %s failed: %s", rid, why)

    def refuse_push(self, msg: wire.PushRequest, reason: str) -> None:
        """Prefill side: tell a decode rank its push will not come, so it fails the request
        now instead of holding its reserved blocks until its timeout (async)."""
        with self._lock:
            self._push_slots.cancel(push_key(msg.engine_id, msg.tp_rank, msg.req_id,
                                             msg.push_id))
        self._tell(msg.host, msg.port + msg.tp_rank,
                   self._note(msg.req_id, msg.push_id, ok=False, detail=reason))
        self._chan.flush()

    # ------------------------------------------------------------------ the rest
    def stats(self) -> Mapping[str, TransportStats]:
        return {n: t.stats for n, t in self.transports.items()}

    def close(self) -> None:
        """Stop serving, give queued reports until ``close_timeout``, cancel the rest, close
        the transports. Returns within about ``close_timeout`` whatever the peers do."""
        end = time.monotonic() + self.config.close_timeout
        if self._server is not None:
            self._server.close()
        if self.board is not None:  # readers' after-checks fail from now: our holds end
            self.board.close()
        self._pool.shutdown(wait=False)
        self._chan.flush()
        while self._chan.busy() and (left := end - time.monotonic()) > 0:
            self._chan.wait(min(left, 0.05))  # queued reports get until close_timeout
        self._chan.close()
        with self._lock:
            calls = list(self._calls)
        cf.wait(calls, timeout=max(0.0, end - time.monotonic()))
        self._abort.set()  # running handshakes give up within 50 ms
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.transports.values():
            t.close()
        self.transports.clear()
