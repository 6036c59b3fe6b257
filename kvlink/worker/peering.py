"""Talking to peers: the side channel both ways, shared by every job of the worker.

Client side: handshakes (cached per peer in :class:`kvlink.peers.PeerTable`, run on helper
threads tracked so :meth:`KVWorker.close` can bound them), and the per-request messages —
:meth:`_Peering._send` for an answer a later poll takes, :meth:`_Peering._tell` for a report
nobody waits for — over the kept-open sessions of :mod:`kvlink.channel`. Server side: our
answer to a handshake (what we offer that peer). Separate because pulls, holds and both sides
of a push all stand on it, and it knows nothing of any of them: the bottom of the worker's
stack of jobs (the state it works on is :class:`KVWorker`'s, set in its ``__init__``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvlink import sidechannel, wire
from kvlink.channel import Channels, Pending
from kvlink.compat import WIRE_VERSION, compat_hash
from kvlink.errors import ConfigError
from kvlink.holdboard import HoldBoard
from kvlink.hostid import host_id
from kvlink.layout import KVCacheSpec
from kvlink.peers import Peer, PeerTable, RemoteEngine
from kvlink.transport import Transport
from kvlink.worker.config import WorkerConfig
from kvlink.worker.ledger import Ledger

log = logging.getLogger("kvlink.worker")
T = TypeVar("T")
#: seconds a report queued by _tell_later waits at most for a poll that reports nothing:
#: about a decode step (a serving loop polls every step). Longer only holds the producer's
#: blocks longer where every poll finishes a request; shorter put the send on those requests'
#: path (one at a time, each finished by its first poll: the 70B request over cuda_ipc)
_LATER_MAX = 0.05
_LATER_BATCH = 32  # queued reports that leave with the next poll, whatever is in flight


class _Peering:
    """The side channel, as methods of the worker."""

    config: WorkerConfig
    spec: KVCacheSpec | None
    agent_name: str
    incarnation: int  # random per worker: a peer that sees it change knows we restarted
    transports: dict[str, Transport]
    peers: PeerTable
    board: HoldBoard | None  # our holds in shared memory, offered to same-host peers
    _server: sidechannel.SideChannelServer | None
    _lock: threading.Lock  # what the side channel thread shares with the caller's
    _secret: bytes | None
    _abort: threading.Event  # set at close: running handshakes give up
    _closed: bool  # close() ran: nothing new is taken
    _calls: set[cf.Future[Any]]  # handshakes running on helper threads
    # (engine, rank) -> agents that handshook with us: fenced off when a push goes silent
    _handshook: dict[tuple[str, int], set[str]]
    _chan: Channels
    _told: list[Pending]  # reports nobody waits for, kept to log failures
    _later: list[Callable[[], None]]  # reports that leave with a later poll (_tell_later)
    _later_since: float  # monotonic time the oldest of them was queued
    _ledger: Ledger  # (reports_owed counts what it owes peers too)
    reports_failed: int

    @property
    def side_port(self) -> int:
        if self._server is None:
            raise ConfigError("this worker runs no side channel server (serve=False)")
        return int(self._server.port)

    def _require_spec(self) -> KVCacheSpec:
        if self.spec is None or self._closed:
            raise ConfigError("this worker is closed" if self._closed else
                              "register() a KV cache before transferring")
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

    def _call(self, host: str, port: int, msg: wire._Msg, timeout: float | None = None,
              live_only: bool = False) -> wire._Msg:
        return sidechannel.request(host, port, msg, timeout or self.config.handshake_timeout,
                                   self._secret, cancel=self._abort, live_only=live_only)


    # ------------------------------------------------------------------ handshake (server)
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
    def _peer(self, remote: RemoteEngine, rank: int, incarnation: int | None = None,
              live: bool = False) -> cf.Future[Peer]:
        return self.peers.get(remote, rank, incarnation, live)

    def forget_peer(self, engine_id: str, rank: int) -> None:
        """Drop cached handshake state of ``engine_id``'s ``rank`` at every address (the next
        request handshakes again). Its transfers in flight turn FAILED (quiescent)."""
        self.peers.forget(engine_id, rank)

    def connected_peers(self) -> list[str]:
        """Agent names of peers with live handshake state."""
        return self.peers.connected()

    def _send(self, host: str, port: int, msg: wire.Request,
              timeout: float | None = None, live_only: bool = False) -> Pending:
        """Queue ``msg`` on the kept-open connection to ``host:port`` (sent at the end of this
        call's :meth:`read`/:meth:`poll`); its answer is taken by a later :meth:`poll`.
        ``live_only``: see :meth:`kvlink.channel.Channels.call`."""
        return self._chan.call(host, port, msg, timeout or self.config.handshake_timeout,
                               live_only=live_only)

    def _tell(self, host: str, port: int, msg: wire.Request, quiet: bool = False) -> None:
        """Send a report nobody waits for (a release, a "written" note): a failure is logged.
        ``quiet``: not even its answer (kvlink.channel: the server answers nothing)."""
        self._told.append(self._chan.call(host, port, msg,
                                          min(2.0, self.config.handshake_timeout), quiet))

    def _tell_later(self, report: Callable[[], None]) -> None:
        """Queue ``report`` (a call that tells a peer something) for a later :meth:`poll`:
        for reports whose only job is to let a peer release, made after the request they
        close is reported. Made and sent on the poll that reports the request, such a report
        was a third of a 4 MiB NIXL READ's time past its DONE on one H200 host (the socket
        send alone 50-60 us, cold). They leave with the next poll that reports nothing while
        nothing of ours is in flight, or with any poll once the oldest waited ``_LATER_MAX``
        or ``_LATER_BATCH`` are queued: then in one frame per peer. Not on a poll while our
        next request moves: sent there, they delayed its DONE by their send — the 70B request
        over cuda_ipc, polled in a loop, spent 0.22 ms from post to DONE without that against
        0.27-0.29 ms with it, same start (bench/results/gpu_checks_06055d9, ``pol``/``old``).
        Nor with the next :meth:`read`, after its post:
        the 70B TP8-rank request over cuda_ipc (a 0.09 ms copy) took 0.69-0.75 ms that way
        against 0.51-0.57 ms in the same start (bench/results/gpu_checks_6c7415b).
        A caller that stops polling sends them with :meth:`close` (``pending()`` and
        ``reports_owed`` count them)."""
        if not self._later:
            self._later_since = time.monotonic()
        self._later.append(report)

    def _later_overdue(self) -> bool:
        return (len(self._later) >= _LATER_BATCH
                or time.monotonic() - self._later_since >= _LATER_MAX)

    def _send_later(self) -> None:
        later, self._later = self._later, []
        for report in later:
            try:
                report()
            except Exception:  # a report must not kill the caller's loop
                self.reports_failed += 1
                log.exception("a queued report failed")

    @property
    def reports_owed(self) -> int:
        """Reports queued for a later :meth:`poll` (see :meth:`_tell_later`), and those of
        READs reported early, whose records a poll still owes (``_Requests._end_early``)."""
        return len(self._later) + len(self._ledger.later)

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
