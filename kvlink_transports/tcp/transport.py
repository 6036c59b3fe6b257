"""``tcp``: one-sided READ/WRITE emulated over plain TCP; works anywhere with only the core deps.

Each process runs a listener; for every accepted connection a server thread serves the peer's
READs straight out of registered memory (``sendmsg`` over memoryviews: the kernel gathers, no
user-space copy) and applies its WRITEs straight into registered memory (``recvmsg_into``: the
kernel scatters; :mod:`kvlink_transports.tcp.memory`). On the client side each peer gets one
connection and one thread that runs that peer's transfers in order; many transfers may be
posted at once (:mod:`kvlink_transports.tcp.client`).

Why not ZeroMQ for the bytes: ZMQ always receives into its own message buffers, so every byte
would be copied once more in user space. On loopback, where TCP is CPU-bound, that extra copy
cost a third of the throughput (measured 0.63x of a plain socket with a ZMQ data plane; the goal is
0.8x). ZMQ still carries the side channel, where latency and framing matter, not copies.

Every requested range is checked against registered memory by the side that owns the memory,
before a byte is read or written. A peer that dies fails its transfers at once (the connection
breaks); a peer that hangs fails them at the ``timeout_s`` deadline.

Grants (contract rule 8, :mod:`kvlink.grants`): every R/W header carries the ``ticket`` its
``post`` named. The memory key in the descriptor only lets a peer *connect*; with
``TransportContext.require_grants`` the owner serves a READ or WRITE only if
:meth:`TcpTransport.grant` made a window for that ticket, for that operation, covering every
extent (a pull READ window is READ-only: a reader cannot WRITE into the producer). Anything else
is answered ``E`` naming why, counted in ``stats.refused`` and logged naming the agent; a
refused WRITE also closes its connection, since its payload follows and the stream cannot be
resynced. :meth:`TcpTransport.revoke` ends a window and returns True once no serving thread is
inside a socket call moving bytes under that ticket (one mid-transfer is cut: stopped before
its next socket call, and its connection shut down if it is still inside one ``_CUT_GRACE``
later). Without ``require_grants`` any peer holding the key may touch all registered memory (a
transport used on its own). The tcp memory key is one per owner, so the agent name a peer
gives (in its hello, or in a header) is its own claim: grants, not names, decide what it may
touch.

The bounds a peer meets before and after it authenticates, and the threads that serve it:
:mod:`kvlink_transports.tcp.server`.

Contract (``kvlink/transport.py``): a transfer is run by one thread, which marks it FAILED only
after it has left the socket call that moved its bytes, so FAILED is quiescent on this side.
:meth:`TcpTransport.close` shuts the listener down, wakes the accept thread (a socketpair it
selects on with the listener and the hellos: it closes those), shuts every connection down,
joins all threads within ``_CLOSE_WAIT`` seconds and only then closes the listening socket.
:meth:`TcpTransport.fence` revokes one agent's inbound connections and waits for their serving
threads to leave our memory; that agent is refused until :meth:`TcpTransport.connect` names it
again.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlink import native
from kvlink.errors import ConfigError, TransferError, TransportUnavailable
from kvlink.grants import make_grants
from kvlink.options import resolve
from kvlink.sockets import shutdown
from kvlink.transport import (
    DONE,
    Capabilities,
    Extents,
    Op,
    TransportContext,
    XferState,
    XferStatus,
    check_pairs,
)
from kvlink.wire import decode_versioned
from kvlink_transports.tcp.client import _Peer, _Xfer
from kvlink_transports.tcp.memory import _Memory
from kvlink_transports.tcp.server import _CUT_GRACE, _Notes, _Server, _Throttle
from kvlink_transports.tcp.wire import _MAX_EXTENTS, _VERSION, _Descriptor, _enc

if TYPE_CHECKING:
    from kvlink.landing import Signal

log = logging.getLogger("kvlink.tcp")

_CLOSE_WAIT = 2.0  # seconds close() waits, in all, for the transport's threads to end


class TcpTransport(_Server):
    name = "tcp"
    capabilities = Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}),
        memory_kinds=frozenset({"cpu", "cuda"}),  # cuda: staged through pinned host buffers
        same_host_only=False,
        native_notifications=True,
        python_threads=True,  # one thread per peer runs its transfers
        enforces_grants=True,  # the owner's serving thread checks every request (rule 8)
    )

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        self.options = resolve("tcp", self.options)  # defaults: kvlink.options.TcpOptions
        self.timeout = float(self.options["timeout_s"])
        # before authentication (module docstring, "Bounds")
        self.hello_timeout = float(self.options["hello_timeout_s"])
        self.max_unauthenticated = int(self.options["max_unauthenticated"])
        self.max_connections = int(self.options["max_connections"])
        # staged device memory moves after the caller's current stream at post (staging.py,
        # "Stream order"); False: no wait, for a caller that orders its streams itself
        self.stream_order = bool(self.options["stream_order"])
        # a peer's thread waits in C on an inbox of plain READs and WRITEs (client.py)
        self.reader_in_c = bool(self.options["reader_in_c"])
        #: each connection's socket buffers (wire._tune; None: by where the peer is)
        self.socket_buffer: int | None = self.options["socket_buffer_bytes"]
        if self.socket_buffer is not None and self.socket_buffer < 0:
            raise ConfigError(f"tcp option socket_buffer_bytes must be >= 0 (0: the kernel's): "
                              f"{self.socket_buffer!r}")
        self.keepalive = float(self.options["keepalive_s"])  # (kvlink.sockets.keepalive)
        port = int(self.options["port"])
        try:
            self._listener = socket.create_server((ctx.host, port), backlog=64)
        except OSError as exc:
            raise TransportUnavailable(
                f"tcp transport cannot listen on {ctx.host}:{port}: {exc}"
            ) from exc
        self.port = self._listener.getsockname()[1]
        self._listener.setblocking(False)  # the accept thread multiplexes it with the hellos
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the accept thread
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._token = secrets.token_bytes(16)
        self._grants = make_grants(native.load())
        self._finishing = threading.Lock()  # (_finish: each transfer ends once)
        self._throttle = _Throttle()
        self._memory = _Memory(())
        self._regions = ()
        self._copier = None
        self._pool = None
        self._chunk = 0
        self._lock = threading.Lock()
        self._xfers: dict[int, _Xfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbound = {}  # authenticated connections
        self._pending = 0  # connections whose hello is being read (the accept thread's)
        self._cuts = []  # revoke(): due, ticket, busy
        self._revoked = set()  # agents fenced off until connect() names them again
        self._notifs = _Notes(native.load())
        self._handles = itertools.count(1)
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept, name="kvlink-tcp-accept", daemon=True
        )
        self._acceptor.start()

    # -- contract
    def descriptor(self) -> bytes:
        return _enc.encode(
            _Descriptor(
                v=_VERSION,
                agent=self.ctx.agent_name,
                host=self.ctx.advertise_host or self.ctx.host,
                port=self.port,
                regions=[(r.addr, r.nbytes, r.device) for r in self._regions],
                token=self._token,
            )
        )

    def connect(self, peer: str, descriptor: bytes) -> None:
        desc = decode_versioned(descriptor, _Descriptor, _VERSION, f"tcp descriptor from {peer}")
        with self._lock:
            if self._closed:
                raise TransportUnavailable("tcp transport is closed")
            self._revoked.discard(peer)  # a new handshake re-admits a fenced peer
            old = self._peers.pop(peer, None)
            self._peers[peer] = _Peer(self, peer, desc)
        if old is not None:
            old.close(f"peer {peer} reconnected")

    def disconnect(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            old.close(f"peer {peer} disconnected")

    #: posts take a landing ``signal`` (kvlink.landing), applied on the peer's thread once the
    #: owner acknowledged the transfer's last bytes (before it is DONE)
    signals = True

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"", signal: Signal | None = None,
    ) -> int:
        t0 = time.perf_counter()
        check_pairs(local, remote)
        idx = self._memory.table.locate(local, "local extent")
        handle = next(self._handles)
        xfer = _Xfer(
            op,
            np.ascontiguousarray(local),
            np.ascontiguousarray(remote),
            notify,
            int(local["len"].sum()),
            t0,
            ticket=bytes(ticket),
            signal=signal,
        )
        if ((op is Op.WRITE or (notify is None and signal is None))
                and remote.shape[0] <= _MAX_EXTENTS and self._memory.native is not None
                and self._memory.direct is not None):  # (straight from/into host memory)
            # (a WRITE's notification goes in its header, its signal is applied by C)
            xfer.landed = np.zeros(1, dtype=np.uint32)
        with self._lock:
            target = self._peers.get(peer)
        if target is not None:  # a caller bug: raise before a handle exists
            target.remote_table.locate(xfer.remote, "remote extent")
        with self._lock:
            self._xfers[handle] = xfer
        if target is None:
            why = "the transport is closed" if self._closed else "it is not connected"
            self._finish(xfer, XferState(XferStatus.FAILED, f"peer {peer}: {why}"))
        elif self._mark_caller_stream(xfer, idx):  # else FAILED: CUDA refused the mark
            try:
                target.submit((handle, xfer))
            except TransportUnavailable as exc:
                self._finish(xfer, XferState(XferStatus.FAILED, str(exc)))
        self._account(post_seconds=time.perf_counter() - t0, descriptors=int(local.shape[0]))
        return handle

    def _mark_caller_stream(self, xfer: _Xfer, idx: np.ndarray) -> bool:
        """On the caller's thread: for staged local extents, mark the caller's current stream
        of our device (READ: the kernels still using the destination, WRITE: those still
        writing the source), for :meth:`_order_after_post`. False (the transfer FAILED) where
        CUDA refused."""
        copier = self._copier
        if copier is None or not self.stream_order or xfer.local.shape[0] == 0:
            return True
        regions = self._memory.table.regions
        staged = bool(self.options["stage_host_memory"]) or any(
            regions[int(i)].memory_kind != "cpu" for i in np.unique(idx))
        if not staged:
            return True
        try:
            xfer.mark = copier.mark()
        except (RuntimeError, OSError) as exc:
            self._finish(xfer, XferState(XferStatus.FAILED, f"tcp: cannot order the transfer "
                                         f"after the caller's stream: {exc}"))
            return False
        return True

    def _order_after_post(self, xfer: _Xfer) -> None:
        """On the peer's thread: the staging stream waits for the caller's mark (device side);
        the mark is used up. A CUDA error here fails the transfer before any byte moved."""
        mark, xfer.mark = xfer.mark, None
        if mark is not None:
            assert self._copier is not None
            try:
                self._copier.after(mark)
            except (RuntimeError, OSError) as exc:
                raise TransferError(f"cannot order the transfer after the caller's stream: "
                                    f"{exc}") from exc

    def poll(self, handle: int) -> XferState:
        xfer = self._xfers.get(handle)
        if xfer is None:
            return XferState(XferStatus.FAILED, f"unknown or released handle {handle}")
        if xfer.state.status is XferStatus.PENDING and xfer.has_landed:
            # every byte in (kvlink's C helper said so): its bookkeeping here, on the caller's
            # thread (a READ C took from the inbox has no other; the peer's thread, where it
            # took one in Python, may be waiting for the GIL)
            self._finish(xfer, DONE)
        return xfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            self._xfers.pop(handle, None)

    def notifications(self) -> list[tuple[str, bytes]]:
        return self._notifs.take()

    def notify(self, peer: str, message: bytes) -> None:
        target = self._peers.get(peer)
        if target is None:
            raise TransportUnavailable(f"peer {peer} is not connected")
        target.submit((None, message))

    def close(self) -> None:
        """Stop accepting (the port refuses), break every connection, join every thread.

        ``shutdown`` on the listener is what wakes the accept thread: ``close`` alone leaves it
        blocked in ``accept()`` on the still-listening socket, which kept accepting (and serving)
        connections after close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            inbound = list(self._inbound.values())
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._wake()
        for p in peers:
            p.close("transport closed")
        for c in inbound:
            self._grants.fence(c.state)
            shutdown(c.conn)
        deadline = time.monotonic() + _CLOSE_WAIT
        threads = [self._acceptor, *(p.thread for p in peers), *(c.thread for c in inbound)]
        for th in threads:
            if th is not threading.current_thread():
                th.join(max(deadline - time.monotonic(), 0.0))
        # after the accept thread left select() (it closed the hellos it was reading)
        self._listener.close()
        if not self._acceptor.is_alive():
            self._wake_r.close()
        self._wake_w.close()
        alive = [th.name for th in threads if th.is_alive()]
        if alive:
            log.warning("tcp: threads still running %.1fs after close: %s", _CLOSE_WAIT, alive)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed

    def fence(self, peer: str, timeout: float) -> bool:
        """Revoke agent ``peer``'s inbound access: refuse its new connections and requests
        until :meth:`connect` names it again, break its connections, and wait (up to
        ``timeout`` s) for their serving threads to leave any socket call into our memory.
        True once they have: no byte of a transfer ``peer`` initiated can land any more."""
        with self._lock:
            self._revoked.add(peer)
            mine = [c for c in self._inbound.values() if c.agent == peer]
        for c in mine:
            self._grants.fence(c.state)
            shutdown(c.conn)
        deadline = time.monotonic() + timeout
        for c in mine:
            c.thread.join(max(deadline - time.monotonic(), 0.0))
        ok = not any(c.thread.is_alive() for c in mine)
        log.info("tcp: fenced agent %s (%d connection(s))%s", peer, len(mine),
                 "" if ok else f"; still serving after {timeout:.1f}s")
        return ok

    def grant(self, ticket: bytes, op: Op, extents: Extents) -> None:
        """Serve peers' ``op`` requests under ``ticket`` inside ``extents`` (rule 8; enforced
        when ``ctx.require_grants``)."""
        self._grants.grant(ticket, op, extents)

    def revoke(self, ticket: bytes, timeout: float = 0.0) -> bool:
        """Refuse ``ticket``'s requests from now on, and cut one being served: it stops before
        its next socket call, and if still inside one after ``_CUT_GRACE`` s (a slow or hung
        peer), its connection is shut down, which ends the call. True once, within
        ``timeout`` s, no serving thread is inside a socket call under it.

        Why a grace, not a shutdown at once: a thread whose last socket call just returned
        still shows the ticket for a moment, and the peer, having all its bytes, may already
        have moved on; shutting its connection would fail its next transfer for nothing."""
        ticket = bytes(ticket)
        self._grants.revoke(ticket)  # first: a connection admitted after it cannot start
        with self._lock:
            inbound = list(self._inbound.values())
        busy = [inbound[i] for i in self._grants.cut(ticket, [c.state for c in inbound])]
        if not busy:
            return True
        with self._lock:  # the accept thread shuts down what is still stuck at the grace's end
            self._cuts.append((time.monotonic() + _CUT_GRACE, ticket, busy))
        self._wake()
        ok = self._grants.wait(ticket, [c.state for c in busy], timeout)
        log.info("tcp: revoked a grant in use by %s%s", sorted({str(c.agent) for c in busy}),
                 "" if ok else f"; still moving bytes after {timeout:.1f}s")
        return ok

    def inflight(self) -> int:
        return sum(1 for x in list(self._xfers.values())
                   if x.state.status is XferStatus.PENDING and not x.has_landed)

    def _finish(self, xfer: _Xfer, state: XferState) -> None:
        """``xfer`` ends as ``state`` — once: a landed READ is finished by whichever of the
        caller's poll and the peer's thread comes first."""
        with self._finishing:
            if xfer.finished:
                return
            xfer.finished = True
        mark, xfer.mark = xfer.mark, None  # ended before its first copy: hand the mark back
        if mark is not None and self._copier is not None:
            self._copier.drop(mark)
        if xfer.state.status is not XferStatus.PENDING:
            return
        if state.status is XferStatus.DONE:
            if xfer.signal is not None and not xfer.has_landed:  # (landed: C applied it)
                xfer.signal.apply()  # the bytes are there: say so before DONE is seen
            self._account(
                transfers=1, bytes=xfer.nbytes, xfer_seconds=time.perf_counter() - xfer.t_post
            )
        else:
            self._account(failed=1)
        xfer.state = state
