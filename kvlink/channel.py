"""Kept-open side-channel connections: one per peer, one session, one frame per step.

:func:`kvlink.sidechannel.request` opens a DEALER per call (and, with a secret, fetches a nonce
first): two or three round trips and a socket per message, fine for a handshake, too slow for
the messages every request sends (read reports, "written" notes, releases). This module is the
per-request path, and it never blocks:

- :meth:`Channels.call` queues a message and returns a :class:`Pending`; :meth:`Channels.flush`
  sends everything queued for a peer as one :class:`kvlink.wire.Batch` frame; :meth:`Channels.pump`
  takes whatever answers have arrived and expires calls past their deadline. All of it runs on
  the caller's thread (the worker's ``poll``): no thread pool, nothing waiting for the GIL.
- With a shared secret a connection authenticates once: ``Hello`` (client nonce) ->
  ``Welcome`` (server nonce), the session key derived from both, then every frame is
  :class:`kvlink.wire.Sealed` with a counter that only grows (replay and reordering refused).
- A frame the server cannot take (no session: it restarted; a bad MAC) is answered by a bare
  ``ErrorReply``: every call on that connection fails with it, and the next call opens a new
  connection and session. Replies to calls that already timed out are dropped by id.

Not thread-safe by design beyond one lock that makes concurrent use correct, not fast: the
worker drives it from its caller's thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time

import zmq

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import (
    AuthError,
    IncompatibleSpecError,
    KVLinkError,
    PeerUnreachable,
    SideChannelError,
)
from kvlink.sidechannel import endpoint, seal_mac, session_key

log = logging.getLogger("kvlink.channel")

_CALLS_PER_FRAME = 512  # a frame stays far below wire.MAX_MESSAGE_BYTES
_ERRORS: dict[str, type[KVLinkError]] = {"incompatible": IncompatibleSpecError, "auth": AuthError}


def error_of(where: str, reply: wire.ErrorReply) -> KVLinkError:
    """The exception an ``ErrorReply`` means, with the peer's code in ``code``."""
    err = _ERRORS.get(reply.code, SideChannelError)(f"{where} answered {reply.code}: "
                                                     f"{reply.message}")
    err.code = reply.code
    return err


class Pending:
    """The answer to one queued message, once :meth:`Channels.pump` has seen it."""

    __slots__ = ("_error", "_reply", "asked", "deadline", "what")

    def __init__(self, what: str, asked: float, deadline: float) -> None:
        self.what = what
        self.asked = asked  # monotonic time it was queued: a grant's clock starts no later
        self.deadline = deadline
        self._reply: wire.Reply | None = None
        self._error: KVLinkError | None = None

    def done(self) -> bool:
        return self._reply is not None or self._error is not None

    def exception(self) -> KVLinkError | None:
        return self._error

    def result(self) -> wire.Reply:
        """The reply; raises what an ``ErrorReply``, a timeout or a broken session means."""
        if self._error is not None:
            raise self._error
        if self._reply is None:
            raise KVLinkError(f"{self.what}: no answer yet (pump() first)")
        return self._reply

    def _settle(self, reply: wire.Reply | None, error: KVLinkError | None = None) -> None:
        if self.done():
            return
        if isinstance(reply, wire.ErrorReply):
            error, reply = error_of(self.what, reply), None
        self._reply, self._error = reply, error


@dataclasses.dataclass
class _Conn:
    where: str
    sock: zmq.Socket[bytes]
    queued: list[tuple[int, wire.Request, Pending]] = dataclasses.field(default_factory=list)
    waiting: dict[int, Pending] = dataclasses.field(default_factory=dict)
    nonce: bytes = b""  # our Hello's nonce while the session opens
    key: bytes | None = None
    counter: int = 0
    hello_deadline: float = 0.0


class Channels:
    """One kept-open connection per (host, port); see the module docstring."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.frames_sent = 0
        self.calls_sent = 0

    def call(self, host: str, port: int, msg: wire.Request, timeout: float) -> Pending:
        """Queue ``msg`` for ``host:port``; it leaves on the next :meth:`flush`."""
        with self._lock:
            conn = self._conn(host, port)
            now = time.monotonic()
            pending = Pending(f"{conn.where} ({type(msg).__name__})", now, now + timeout)
            conn.queued.append((next(self._ids), msg, pending))
            return pending

    def flush(self) -> None:
        """Send every queued message, one frame per peer (a session opens first if needed)."""
        with self._lock:
            for conn in list(self._conns.values()):
                if conn.queued:
                    self._send(conn)

    def pump(self) -> None:
        """Take every answer that has arrived; fail calls past their deadline. Never blocks."""
        with self._lock:
            now = time.monotonic()
            for key, conn in list(self._conns.items()):
                while conn.waiting or conn.nonce:
                    try:
                        frames = conn.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(key, conn, frames[-1])
                    if self._conns.get(key) is not conn:
                        break
                if self._conns.get(key) is not conn:
                    continue
                for cid, pending in list(conn.waiting.items()):
                    if now >= pending.deadline:
                        del conn.waiting[cid]
                        pending._settle(None, PeerUnreachable(
                            f"no answer from side channel {pending.what} in time"))
                if conn.nonce and now >= conn.hello_deadline:
                    self._reset(key, conn, PeerUnreachable(
                        f"side channel {conn.where} did not open a session in time"))
                else:
                    self._expire_queued(conn, now)

    def busy(self) -> bool:
        """Anything queued or awaiting an answer."""
        with self._lock:
            return any(c.queued or c.waiting or c.nonce for c in self._conns.values())

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` for any answer (with the GIL released in ZMQ), then pump."""
        with self._lock:
            poller = zmq.Poller()
            for conn in self._conns.values():
                if conn.waiting or conn.nonce:
                    poller.register(conn.sock, zmq.POLLIN)
        if poller.sockets:
            poller.poll(max(0, int(timeout * 1000)))
        self.pump()

    def close(self, why: str = "closing") -> None:
        """Fail what is outstanding and close every connection."""
        with self._lock:
            for key, conn in list(self._conns.items()):
                self._reset(key, conn, PeerUnreachable(f"call to {conn.where} cancelled ({why})"))

    # ------------------------------------------------------------------ internals
    def _conn(self, host: str, port: int) -> _Conn:
        conn = self._conns.get((host, port))
        if conn is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
            sock.connect(endpoint(host, port))
            conn = self._conns[(host, port)] = _Conn(f"{host}:{port}", sock)
        return conn

    def _send(self, conn: _Conn) -> None:
        if self._secret is not None and conn.key is None:
            if not conn.nonce:  # open the session; the queue leaves once it is welcomed
                conn.nonce = secrets.token_bytes(16)
                conn.hello_deadline = max(p.deadline for _, _, p in conn.queued)
                self._put(conn, wire.Hello(v=WIRE_VERSION, nonce=conn.nonce))
            return
        while conn.queued:
            chunk, conn.queued = conn.queued[:_CALLS_PER_FRAME], conn.queued[_CALLS_PER_FRAME:]
            batch = wire.Batch(v=WIRE_VERSION, calls=[wire.Call(cid, m) for cid, m, _ in chunk])
            frame: wire._Msg = batch
            if conn.key is not None:
                conn.counter += 1
                body = wire.encode(batch)
                frame = wire.Sealed(v=WIRE_VERSION, counter=conn.counter,
                                    mac=seal_mac(conn.key, conn.counter, body), body=body)
            for cid, _, pending in chunk:
                conn.waiting[cid] = pending
            self._put(conn, frame)
            self.calls_sent += len(chunk)

    def _put(self, conn: _Conn, msg: wire._Msg) -> None:
        try:
            conn.sock.send_multipart([b"", wire.encode(msg)], zmq.NOBLOCK)
            self.frames_sent += 1
        except zmq.ZMQError as exc:  # the peer's queue is full: those calls time out
            log.info("side channel frame to %s not sent: %s", conn.where, exc)

    def _take(self, key: tuple[str, int], conn: _Conn, body: bytes) -> None:
        try:
            reply = wire.decode(body)
        except KVLinkError as exc:
            log.warning("dropped a malformed answer from %s: %s", conn.where, exc)
            return
        if isinstance(reply, wire.Replies):
            for ans in reply.answers:
                pending = conn.waiting.pop(ans.id, None)
                if pending is not None:
                    pending._settle(ans.msg)
        elif isinstance(reply, wire.Welcome) and conn.nonce and self._secret is not None:
            conn.key = session_key(self._secret, conn.nonce, reply.nonce)
            conn.nonce = b""
            self._send(conn)
        elif isinstance(reply, wire.ErrorReply):  # the frame as a whole was refused
            self._reset(key, conn, error_of(conn.where, reply))
        else:
            log.warning("unexpected %s from %s dropped", type(reply).__name__, conn.where)

    def _expire_queued(self, conn: _Conn, now: float) -> None:
        keep = []
        for item in conn.queued:
            if now >= item[2].deadline:
                item[2]._settle(None, PeerUnreachable(f"{item[2].what}: not sent in time"))
            else:
                keep.append(item)
        conn.queued = keep

    def _reset(self, key: tuple[str, int], conn: _Conn, error: KVLinkError) -> None:
        """Fail everything on ``conn`` and drop it: the next call opens a fresh one."""
        for _, _, pending in conn.queued:
            pending._settle(None, error)
        for pending in conn.waiting.values():
            pending._settle(None, error)
        conn.sock.close(linger=0)
        if self._conns.get(key) is conn:
            del self._conns[key]
        if not isinstance(error, PeerUnreachable) or "cancelled" not in str(error):
            log.info("side channel connection to %s reset: %s", conn.where, error)

