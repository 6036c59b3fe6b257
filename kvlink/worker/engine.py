"""The worker itself (:class:`KVWorker`): its state, setup, the poll loop, close.

:class:`KVWorker` is one object with one lock and one set of state, made of the jobs in this
package stacked bottom to top, each a mixin in its own module that declares the attributes it
uses (``__init__`` here sets them all): :mod:`~kvlink.worker.peering` (the side channel both
ways), :mod:`~kvlink.worker.holds` (producer side of a pull), :mod:`~kvlink.worker.parts`
(one part of a transfer, handshake to verdict), :mod:`~kvlink.worker.requests` (a request
begun and reported), then the two sides of push mode, :mod:`~kvlink.worker.decode_push` and
:mod:`~kvlink.worker.prefill_push`. This module keeps what touches all of them: registering
the cache and starting the side channel server, dispatching what peers send to the job that
answers it, :meth:`KVWorker.poll`, and :meth:`KVWorker.close`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvlink import sidechannel, wire
from kvlink.channel import Channels, Pending
from kvlink.compat import WIRE_VERSION
from kvlink.errors import (
    ConfigError,
    KVLinkError,
    LayoutError,
    TransportUnavailable,
    UnknownTransportError,
)
from kvlink.headmap import HeadRead, check_tp, rank_heads
from kvlink.holdboard import BoardView, HoldBoard
from kvlink.hostid import host_id
from kvlink.integrity import Checker, Level, Planes, spec_planes
from kvlink.landing import LandingBoard, LandingView
from kvlink.layout import KVCacheSpec
from kvlink.leases import BlockLeases
from kvlink.peers import PeerTable, RemoteEngine
from kvlink.push import PushSlots
from kvlink.transport import (
    Op,
    Transport,
    TransportContext,
    TransportStats,
    XferStatus,
    create_transport,
)
from kvlink.worker.config import WorkerConfig
from kvlink.worker.decode_push import _DecodePush
from kvlink.worker.ledger import OWED_MAX, Ledger
from kvlink.worker.prefill_push import _PrefillPush
from kvlink.worker.records import (
    Phases,
    Transfer,
    _Awaiting,
    _Layered,
    _PeerLane,
    _Request,
    _Route,
)

log = logging.getLogger("kvlink.worker")
#: seconds a poll that finished requests may skip the rest of its work (the inbox, the other
#: requests) after one that did all of it, or after one that found nothing else to do
#: (KVWorker._quiet): a serving loop polls every step, and a reply or a report waiting 2 ms
#: more costs nobody; a request reported a whole poll later costs its caller that poll
#: (~0.15 ms cold on one H200 host: docs/history/e2e.md, "Launch first"), and asking again on the
#: poll that finishes it ~10 us (bench/results/gpu_stamps_e98e4fa/)
_FULL_EVERY = 0.002
#: seconds a poll with nothing else to do may go without a whole one: its requests all
#: with their transports or just reported, the side channel idle, no push, no layer-wise
#: range, no report overdue (:meth:`KVWorker._quiet`). The rest of a poll then has nothing
#: to take but what the side channel's server thread serves anyway (this bound is hygiene:
#: the told reports' log). A request that waited for it was reported that much later: on
#: one H200, 0.05 s here put a whole poll (~40 us cold) into the window of about every other
#: 70B request of bench/e2e_request.py, which starts one every ~40 ms (both from the stamps
#: in bench/results/gpu_checks_quiet_polls/)
_QUIET_FOR = 1.0


@dataclasses.dataclass
class GraceStats:
    """What the polls' waits for copies about to end did (``poll_grace_us``,
    :attr:`KVWorker.poll_grace`): whether the grace pays, read back."""

    waits: int = 0  # polls that waited
    reported: int = 0  # requests those waits reported
    timed_out: int = 0  # waits that reached the grace with a copy still moving
    seconds: float = 0.0  # time spent waiting, in all


class KVWorker(_PrefillPush, _DecodePush):
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
        #: whether a transport of ours moves its transfers on Python threads of its own (a
        #: poll then lets them run: _moved_by_threads), fixed by register()
        self._threaded = False
        self._lock = threading.Lock()  # what the side channel thread shares with the caller's
        self._side_notifs: list[wire.Notification] = []
        self._push_inbox: list[wire.PushRequest] = []
        self._push_slots = PushSlots()
        # (engine, rank) -> agents that handshook with us: fenced off when a push goes silent
        self._handshook: dict[tuple[str, int], set[str]] = {}
        self._awaiting: dict[str, _Awaiting] = {}
        #: until when a poll that reports requests may return before the rest of its work:
        #: after a whole poll, and after one that found nothing else to do (_quiet)
        self._full_by = 0.0
        self._quiet_by = 0.0
        #: READs whose records this poll's first look made while their copies ran: looked at
        #: once more as the poll ends (_look_again)
        self._recorded: list[_Request] = []
        self._grace = config.poll_grace_us * 1e-6  # (seconds: see _await_ends)
        self.poll_grace = GraceStats()
        self._landings_ended: list[_Awaiting] = []  # their slots, given back at the next poll
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
                                  renew_limit=config.renew_limit, on_release=self._revoke_hold)
        self.integrity = Checker(Level(config.integrity))
        #: producer: our holds in shared memory for same-host readers (created at register)
        self.board: HoldBoard | None = None
        #: reader: READs validated on a producer's hold board, without a round trip
        self.board_validated = 0
        #: decode: our awaited pushes' slots for same-host prefills (created at register);
        #: push ranks counted written from it, without their note (kvlink.landing)
        self.landing: LandingBoard | None = None
        self.board_landed = 0
        self._ended_pushes: collections.OrderedDict[tuple[str, int], None] = (
            collections.OrderedDict())  # ended on the board: their late notes are welcome
        self._hold_views: dict[str, BoardView | None] = {}  # prefills' boards, by name
        #: prefill: decodes' landing boards by name (kvlink.worker.prefill_push)
        self._landing_views: dict[str, LandingView | None] = {}
        self._landing_closed: list[LandingView] = []
        #: prefill: layer-wise pushes being written, by the id push() returned; and why the
        #: ended ones ended (a late range of one is refused naming it)
        self._layered: dict[str, _Layered] = {}
        self._layered_ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._slices: dict[tuple[int, int, int], tuple[KVCacheSpec, KVCacheSpec]] = {}
        self._lanes: dict[tuple[int, HeadRead, Op, bool], _PeerLane] = {}  # see parts._post_lane
        #: (remote, integrity on) -> its route (see requests._read_now)
        self._routes: dict[tuple[RemoteEngine, bool], _Route] = {}
        self._last_route: tuple[RemoteEngine | None, _Route | None] = (None, None)
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
        self._later: list[Callable[[], None]] = []  # reports for a later poll (_tell_later)
        self._later_since = 0.0
        #: closed (close()): nothing new is taken; the requests in flight at the close are
        #: reported failed by the next poll
        self._closed = False
        self._left_at_close: dict[str, str] = {}
        self._readers: dict[int, int] = {}  # consumer TP -> readers per hold (see below)
        #: what callers read back (transfers, xfer_seconds, phases, counts; see the
        #: properties below), written off the request's path
        self._ledger = Ledger()
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
        for integrity digests; default: views of the memory as ``spec`` describes it.

        Once per worker (a ConfigError the second time: another cache is another worker).
        Where it fails, what it had opened is closed again (transports, boards, the side
        channel): a worker whose setup failed holds no port, thread or shared memory."""
        if self._closed:
            raise ConfigError("this worker is closed (make another one)")
        if self.spec is not None:
            raise ConfigError("this worker registered its cache already: a worker serves one "
                              "cache (make another worker for another)")
        try:
            self._register(spec, planes)
        except BaseException:
            self._unregister()
            raise

    def _unregister(self) -> None:
        """Close what a failed :meth:`register` opened (each close is quiet: the cause of the
        failure is what the caller hears)."""
        opened: list[Any] = [*self.transports.values(), self._server, self.board, self.landing]
        for thing in opened:
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()
        self.transports.clear()
        self._server = self.board = self.landing = None
        self.spec = None

    def _register(self, spec: KVCacheSpec, planes: Planes | None) -> None:
        if spec.tp_size != self.config.tp_size or spec.tp_rank != self.config.tp_rank:
            spec = dataclasses.replace(spec, tp_size=self.config.tp_size,
                                       tp_rank=self.config.tp_rank)
        _check_heads(spec)
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
            except ConfigError:  # a bad option is the caller's to correct, not a transport
                raise  # that is missing here (it was skipped, said at INFO only)
            except KVLinkError as exc:
                reasons.append(f"{name}: {exc}")
                # a name nothing registered is a typo, not a library missing on this host
                (log.warning if isinstance(exc, UnknownTransportError) else log.info)(
                    "transport %s unavailable: %s", name, exc)
                continue
            self.transports[name] = t
        self._threaded = any(t.capabilities.python_threads for t in self.transports.values())
        if not self.transports:
            raise TransportUnavailable("no configured transport can serve this cache: "
                                       + "; ".join(reasons))
        log.info("rank %d registered %d region(s), %.1f MiB, transports %s",
                 self.config.tp_rank, len(spec.regions),
                 sum(r.nbytes for r in spec.regions) / 2**20, list(self.transports))
        if self.config.serve:
            if self.config.hold_board and self.board is None:
                self.board = HoldBoard.create()
            if self.config.landing_board and self.landing is None:
                self.landing = LandingBoard.create()
            port = self.config.side_port + self.config.tp_rank if self.config.side_port else 0
            self._server = sidechannel.SideChannelServer(
                self.config.host, port, self._on_side_message,
                name=f"kvlink-side-{self.config.tp_rank}", secret=self._secret,
                allow_insecure=self.config.allow_insecure)
            log.info("rank %d side channel on %s:%d", self.config.tp_rank, self.config.host,
                     self._server.port)

    def _thread_init(self) -> None:
        # UCX (and CUDA IPC) need a CUDA context on the thread that connects.
        if self.spec is not None and self.spec.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(int(self.spec.device.split(":")[1]))

    # ------------------------------------------------------------------ side channel server
    def _on_side_message(self, msg: object) -> wire.Reply:
        if isinstance(msg, wire.HandshakeRequest):
            return self._answer_handshake(msg)
        if isinstance(msg, wire.ReadIntent):
            return self._answer_intent(msg)
        if isinstance(msg, wire.ReadDone):
            return self._answer_done(msg)
        if isinstance(msg, wire.Notification):
            return self._answer_note(msg)
        if isinstance(msg, wire.PushRequest):
            return self._answer_push(msg)
        if isinstance(msg, wire.Hold):
            return self._answer_hold(msg)
        if isinstance(msg, wire.PushCancel):
            return self._answer_cancel(msg)
        if isinstance(msg, wire.Renew):
            return self._answer_renew(msg)
        return wire.ErrorReply(v=WIRE_VERSION, code="unsupported",
                               message=f"{type(msg).__name__} not handled here")

    def poll(self, *, grace: bool = True) -> tuple[set[str], dict[str, str]]:
        """Advance every request; returns (finished ids, {failed id: reason}) since last call.

        A request is reported only when nothing of it can still move: finished (READ: the
        producer confirmed the lease intact) or failed (every part quiescent). Everything
        runs here, on the caller's thread: answers that arrived are taken, DONE transfers
        are reported, and every message this produced leaves in one frame per peer.
        ``grace``: this poll may wait up to ``poll_grace_us`` for a copy about to end
        (:meth:`_await_ends`); False for a poll the caller follows with work of its own
        before it could take a report (vLLM's connector, before a forward)."""
        finished: set[str] = set()
        failed: dict[str, str] = {}
        if self._closed:  # what was in flight at the close, once
            failed, self._left_at_close = self._left_at_close, {}
            return finished, failed
        if self._awaiting:  # pushes written on our landing board need no message
            self._poll_landed(finished)
        stepped = self._poll_moving(finished, failed) if self._requests and not finished else ()
        now = time.monotonic()
        ended = finished or failed
        if (ended or stepped) and ((ended and now < max(self._full_by, self._quiet_by)) or (
                now < self._full_by + _QUIET_FOR and self._quiet(stepped, now))):
            # reported at once: the rest of a poll (the inbox, every other request) is
            # most of its time, and a request's (a layer-wise push's exposed) time ends
            # here — as long as a whole poll ran within _FULL_EVERY, so nothing else waits
            # longer than that and one poll. (Every other poll ran whole before 9f1d728:
            # one request at a time, each finished by its first poll, paid for it every
            # other request.) With nothing else to do (quiet), for _QUIET_FOR: a caller
            # polling in a tight loop then sees a copy land within one short poll, and a
            # caller that polls only now and then (each poll past the window) too. A quiet
            # answer counts like a whole poll for the polls that finish requests within
            # _FULL_EVERY of it (the one that sees a copy land, after one that saw it moving)
            if not ended and self._ledger.owed():  # its requests' copies are running: the
                self._ledger.settle()  # records of those before them are written meanwhile
            if self._recorded:
                self._look_again(finished, failed)
            if stepped and grace and self._grace:
                self._await_ends(stepped, finished, failed)
            self._chan.flush()  # what ending them queued (a release to replicas)
            return finished, failed
        self._full_by = now + _FULL_EVERY
        if self._landings_ended:
            self._end_landings()
        if self._server is not None and not finished:  # what peers told us, taken now (not
            # after a GIL switch) — unless a push just finished: its report goes first (a
            # select hands the GIL to the server's thread), the server's thread serves them
            self._server.serve_ready()
        self._chan.pump()
        self._log_told()
        self._poll_pushed(finished, failed)
        if self._layered:
            self._poll_layered(finished, failed)
        threads = False
        behind: set[str] = set()  # layer-wise pushes with a range still on the wire
        for req in list(self._requests.values()):  # (in the order they were started)
            if req.req_id in stepped:  # looked at above, in this poll: still moving
                threads = threads or self._moved_by_threads(req)
                continue
            if req.layered in behind and all(p.handle is not None for p in req.parts):
                # a later range of a push whose earlier one is not done: its push cannot end
                # before that one anyway, so it is looked at once that one is (a prefill that
                # runs ahead of its GPU has every layer in flight: asking each of them at every
                # poll made the forward's host loop quadratic in the layers)
                threads = threads or self._moved_by_threads(req)
                continue
            if self._step(req):
                self._report(req, finished, failed)
            else:
                if req.layered is not None:
                    behind.add(req.layered)
                threads = threads or self._moved_by_threads(req)
        if self._layered:
            self._tell_landed()
        if self._recorded:
            self._look_again(finished, failed)
        if stepped and grace and self._grace:
            self._await_ends(stepped, finished, failed)
        if self._ledger.later:  # (requests that ended early owe their producers a report)
            self._ledger.settle()
        if self._later and ((not finished and not self._requests) or self._later_overdue()):
            self._send_later()  # what earlier polls' requests owe peers (_tell_later)
        self._chan.flush()
        self._ledger.settle()
        if self._awaiting and not threads:  # a push comes in: a peer's WRITE into our blocks
            # may be served by a transport's own threads too
            threads = self._threaded
        if threads:  # let a transport's own threads move our bytes (see Capabilities)
            time.sleep(0)
        return finished, failed

    def _quiet(self, stepped: set[str] | tuple[()], now: float) -> bool:
        """Whether this poll's first look (``stepped``: the requests it found still moving,
        the others it reported) was all there is to do: every request left is with its
        transport, moved by no Python thread of a transport (those need the GIL handed over:
        a whole poll does), and nothing else waits — no push, no layer-wise range, no report
        overdue, no answer or session on the side channel, not many records owed. A quiet
        answer stands for _FULL_EVERY from ``now``, as a whole poll does (see :meth:`poll`)."""
        requests = self._requests
        quiet = (len(stepped) == len(requests) and not self._awaiting
                 and self._ledger.owed() < OWED_MAX
                 and not self._layered and not self._landings_ended
                 and not (self._later and self._later_overdue()) and self._chan.idle()
                 and not (self._threaded and requests and any(self._moved_by_threads(r)
                                                              for r in requests.values())))
        if quiet:
            self._quiet_by = now + _FULL_EVERY
        return quiet

    def _poll_moving(self, finished: set[str], failed: dict[str, str]) -> set[str]:
        """A poll's first look: requests whose every part is with its transport (posted, not
        yet seen DONE), before the inbox and everything else — one that finishes on its
        board's word is reported by this poll at once. Returns the ids looked at (and still
        in flight). Layer-wise ranges wait for the main loop (their order matters there)."""
        stepped: set[str] = set()
        for req in list(self._requests.values()):
            if req.layered is not None:
                continue
            for p in req.parts:  # (a loop, not any() over a generator: calls are cold here)
                if p.handle is None:
                    break
            else:  # (a READ launched on a route makes its records here: _step, first)
                recording = req.route is not None
                if not self._look(req, finished, failed):
                    stepped.add(req.req_id)
                    if recording:
                        self._recorded.append(req)
        return stepped

    def _look(self, req: _Request, finished: set[str], failed: dict[str, str]) -> bool:
        """One look at a request in flight: a READ that may end on its transports' word and
        its after-check (:meth:`_end_early`) is looked at so, else it is stepped; True where
        it was reported. The first look at a READ launched on its route makes its records and
        binds its probes first (a caller that slept past its copy sees it ended there)."""
        if req.route is not None:
            self._record_launch(req)
            self._bind_probes(req)
        if req.early:
            ended = self._end_early(req, finished)
            if ended is None:
                return False
            if ended:
                return True
            req.early = False  # (the step decides from here: nothing was taken)
        if self._step(req):
            self._report(req, finished, failed)
            return True
        return False

    def _look_again(self, finished: set[str], failed: dict[str, str]) -> None:
        """The READs whose records this poll's first look made (:meth:`_poll_moving`), looked
        at once more as the poll ends. Their copies ran while the records were made and the
        rest of the poll was done, and may have landed since the first look: reported by this
        poll, not the next. On one H200 host the 70B request's first poll looked ~5 us before
        its copy ended; a caller sleeping 0.2 ms between polls then saw it a sleep later
        (docs/e2e.md)."""
        recorded, self._recorded = self._recorded, []
        for req in recorded:
            if self._requests.get(req.req_id) is req:
                self._look(req, finished, failed)

    def _await_ends(self, stepped: set[str], finished: set[str], failed: dict[str, str]
                    ) -> None:
        """Wait, at the end of a poll, for the copies of the requests its first look found
        moving (``stepped``) that their transports expect to end within ``poll_grace_us``
        (the optional ``ends_in`` hook: cuda_ipc), soonest first, and report those that do —
        at most ``poll_grace_us`` in all. A caller that sleeps between polls (or a scheduler
        that polls once a step) would see such a copy a sleep (a step) later; on one H200
        host the poll after a 70B READ's ``read()`` looked tens of microseconds before its
        copy ended once the host outran it (docs/history/e2e.md, "A lane's end marked by its
        stream"). The wait spins on the transports' polls, each a word read for cuda_ipc."""
        soon: list[tuple[float, str]] = []
        for rid in stepped:
            req = self._requests.get(rid)
            left = None if req is None else self._ends_in(req)
            if left is not None and left <= self._grace:
                soon.append((left, rid))
        if not soon:
            return
        stats = self.poll_grace
        stats.waits += 1
        t0 = time.perf_counter()
        end = t0 + self._grace
        for _, rid in sorted(soon):
            req = self._requests.get(rid)
            if req is None:
                continue
            while self._moving(req):
                if time.perf_counter() >= end:
                    stats.timed_out += 1
                    stats.seconds += time.perf_counter() - t0
                    return
            if self._look(req, finished, failed):
                stats.reported += 1
        stats.seconds += time.perf_counter() - t0

    @staticmethod
    def _moving(req: _Request) -> bool:
        """Whether a part of ``req`` is still with its transport, moving: read off each part's
        ``probe`` where it has one (one word, no bookkeeping), else its transport's poll."""
        for p in req.parts:
            if p.handle is None or p.go is None:
                continue
            if p.probe is not None and req.early:
                if p.probe() is None:
                    return True
            elif p.go.peer.transport.poll(p.handle).status is XferStatus.PENDING:
                return True
        return False

    @staticmethod
    def _ends_in(req: _Request) -> float | None:
        """Seconds until every part of ``req`` is expected to have ended, by its transports'
        ``ends_in`` (None: a part without one, or not with its transport)."""
        left = 0.0
        for p in req.parts:
            ends_in = None if p.handle is None or p.go is None else getattr(
                p.go.peer.transport, "ends_in", None)
            got = None if ends_in is None else ends_in(p.handle)
            if got is None:
                return None
            left = max(left, got)
        return left

    @staticmethod
    def _moved_by_threads(req: _Request) -> bool:
        """Whether a part of ``req`` in flight is moved by a transport's own Python threads."""
        return any(p.handle is not None and p.go is not None
                   and p.go.peer.transport.capabilities.python_threads for p in req.parts)

    def explain(self, req_id: str) -> str | None:
        """Where a request in flight stands, in one line: each part's step (the handshake,
        the read intent and its "not held yet" answers, moving over which transport, the
        producer's answer to its report, failing until quiescent), or a push's ranks — for a
        log when a request takes long (the vLLM connector's synchronous loads say it after
        a second). None where ``req_id`` is not in flight. On the thread that polls."""
        now = time.monotonic()
        req = self._requests.get(req_id)
        if req is not None:
            parts = "; ".join(f"{req.remote.engine_id} rank {p.read.remote_rank}: "
                              f"{p.describe(now)}" for p in req.parts)
            return f"{req.op.name} of {req_id}, {now - req.t_mono:.1f} s in flight: {parts}"
        aw = self._awaiting.get(req_id)
        if aw is None:
            return None
        w = aw.wait
        ranks = ", ".join(f"rank {r} {state.value}" for r, state in sorted(w.ranks.items()))
        return (f"push of {req_id} awaited for {now - w.started:.1f} s (its deadline in "
                f"{w.deadline - now:.1f} s): {ranks}"
                + (f"; failing: {w.error}" if w.error is not None else ""))

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, waking early when a side-channel answer arrives
        (with the GIL released). For a caller with nothing else to do between polls."""
        self._chan.wait(timeout)

    def take_transfers(self) -> list[Transfer]:
        """The transfers that ended since the last call (:attr:`transfers`), oldest first.
        Call it on the thread that polls (the deque is filled there)."""
        transfers = self.transfers
        out = list(transfers)
        transfers.clear()
        return out

    def descriptor_counts(self) -> tuple[int, int]:
        """(before, after) coalescing, summed over finished requests."""
        return self.raw_descriptors, self.descriptors

    # what callers read back: written by the ledger off the request's path, settled here first
    # (read them on the thread that polls: settling releases the transports' handles)
    @property
    def transfers(self) -> collections.deque[Transfer]:
        """Every transfer posted that ended, in order (:class:`Transfer`), for per-transport
        metrics; :meth:`take_transfers` drains it. Bounded: the oldest drop if nobody does."""
        self._ledger.settle()
        return self._ledger.transfers

    @property
    def xfer_seconds(self) -> dict[str, float]:
        """Finished request id -> transport-level seconds, post to completion (the slowest
        transfer): the transport's own timing where it has one (NIXL telemetry
        ``xferDuration``, with the nixl option ``telemetry``), else post() call to the end
        seen by poll(). Excludes handshake, read intents and the step loop. Callers pop what
        they read (bounded: the oldest drop)."""
        self._ledger.settle()
        return self._ledger.xfer_seconds

    @property
    def phases(self) -> dict[str, Phases]:
        """Finished request id -> where its time went (:class:`Phases`). Callers pop them."""
        self._ledger.settle()
        return self._ledger.phases

    @property
    def finished_bytes(self) -> int:
        """Bytes of the requests reported finished, since start."""
        self._ledger.settle()
        return self._ledger.finished_bytes

    @property
    def raw_descriptors(self) -> int:
        """Extents before coalescing, over finished requests."""
        self._ledger.settle()
        return self._ledger.raw_descriptors

    @property
    def descriptors(self) -> int:
        """Extents posted (after coalescing), over finished requests."""
        self._ledger.settle()
        return self._ledger.descriptors

    def pending(self) -> int:
        """Requests in flight, pushes awaited, and reports owed to peers (a poll sends them).

        A layer-wise push counts until it ended, also between two ranges (none of it in
        flight): only a poll ends it — cancelled by its decode, which keeps its blocks until
        told, or past its time to live — and tells its decode. Counted by its ranges alone, a
        caller polling while anything is pending stopped with the push open, its decode's
        blocks quarantined and the hold it writes from taken."""
        between = sum(not lay.inflight for lay in self._layered.values()) if self._layered else 0
        return (len(self._requests) + len(self._awaiting) + between + len(self._later)
                + len(self._ledger.later))

    # ------------------------------------------------------------------ the rest
    def stats(self) -> Mapping[str, TransportStats]:
        return {n: t.stats for n, t in self.transports.items()}

    def close(self) -> None:
        """Stop serving, give queued reports until ``close_timeout``, cancel the rest, close
        the transports. Returns within about ``close_timeout`` whatever the peers do. The
        requests in flight then are reported failed by the next :meth:`poll` (nothing of
        them moves any more); every other call raises a ConfigError from then on."""
        if self._closed:
            return
        end = time.monotonic() + self.config.close_timeout
        if self._server is not None:
            self._server.close()
        if self.board is not None:  # readers' after-checks fail from now: our holds end
            self.board.close()
        self._pool.shutdown(wait=False)
        self._ledger.settle()  # (releases its handles: before the transports close)
        self._send_later()
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
        # after the transports: none of their signals can reach a landing board any more
        for view in [*self._landing_views.values(), *self._landing_closed]:
            if view is not None:
                view.close()
        self._landing_views.clear()
        self._landing_closed.clear()
        if self.landing is not None:
            self.landing.close()
        for hv in self._hold_views.values():
            if hv is not None:
                hv.close()
        self._hold_views.clear()
        # a layer-wise push under the id push() returned, not its ranges' own (internal) ids:
        # the caller never saw those, and the push itself was never reported
        self._left_at_close = {r: "the worker was closed with it in flight" for r in [
            *(r for r, req in self._requests.items() if req.layered is None),
            *self._layered, *self._awaiting]}
        self._requests.clear()
        self._layered.clear()
        self._awaiting.clear()
        self._later.clear()
        self._routes.clear()
        self._last_route = (None, None)
        self._closed = True


def _check_heads(spec: KVCacheSpec) -> None:
    """The heads the cache holds are the ones the head map gives this rank, else LayoutError.

    Every map (which remote ranks a rank reads, which heads of their pages, which replicas it
    tells) is worked out from ``total_kv_heads`` and the TP size alone, never from the pages'
    ``num_kv_heads``: a spec whose total is the rank's own count (``total_kv_heads`` left 0
    under TP > 1) mapped each rank ``total // tp`` heads of pages holding more, and a READ or
    push moved that slice of every page and reported success, the rest of each page stale.
    """
    if spec.mla:
        return
    check_tp(spec.total_kv_heads, spec.tp_size, "tp_size")
    _, count = rank_heads(spec.total_kv_heads, spec.tp_size, spec.tp_rank)
    if count != spec.num_kv_heads:
        raise LayoutError(
            f"the KV cache holds {spec.num_kv_heads} kv head(s) per page, but total_kv_heads="
            f"{spec.total_kv_heads} over tp_size={spec.tp_size} gives rank {spec.tp_rank} "
            f"{count}: pass KVCacheSpec.total_kv_heads, the KV heads of all TP ranks")

