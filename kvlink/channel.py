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

Two pipes carry the frames. Before a handshake said where the peer's session port is, a
ZMQ DEALER to its side channel; after (:meth:`Channels.learn`), one plain TCP connection to that
port, read and written non-blocking from the caller's thread. Why both: ZMQ hands every frame
to its I/O thread and back, four thread wake-ups a round trip, measured 126 us (343 us with the
cores idle 2 ms between requests) against 16 us (61 us) for plain TCP on the same loopback —
most of a small request's time. ZMQ stays for what comes before a handshake.

One lock makes concurrent use correct, not fast: the worker drives it from its caller's thread.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import secrets
import select
import socket
import threading
import time
from typing import Protocol

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
from kvlink.sidechannel import FRAME, endpoint, seal_mac, session_key

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


class _Pipe(Protocol):
    def put(self, body: bytes) -> None: ...  # raises OSError when the connection is gone
    def take(self) -> list[bytes]: ...  # frames that arrived; raises OSError when gone
    def pollable(self) -> zmq.Socket[bytes] | int: ...
    def close(self) -> None: ...


class _ZmqPipe:
    """A DEALER to a side channel's ROUTER (before a handshake named the session port)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.sock.connect(endpoint(host, port))

    def put(self, body: bytes) -> None:
        try:
            self.sock.send_multipart([b"", body], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's queue is full: those calls time out
            log.info("side channel frame not sent: %s", exc)

    def take(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.sock.recv_multipart(zmq.NOBLOCK)[-1])
            except zmq.Again:
                return out

    def pollable(self) -> zmq.Socket[bytes]:
        return self.sock

    def close(self) -> None:
        self.sock.close(linger=0)


class _TcpPipe:
    """One plain TCP connection to a side channel's session port, never blocking: frames
    are ``FRAME``-prefixed; what the kernel does not take now is sent by the next call."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        err = self.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            self.sock.close()
            raise OSError(err, f"cannot connect to the session port {host}:{port}: "
                          f"{errno.errorcode.get(err, err)}")
        self._out = bytearray()
        self._in = bytearray()

    def put(self, body: bytes) -> None:
        if len(body) > wire.MAX_MESSAGE_BYTES:
            raise OSError(errno.EMSGSIZE, f"a frame of {len(body)} B")
        self._out += FRAME.pack(len(body))
        self._out += body
        self._send()

    def _send(self) -> None:
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ENOTCONN:  # still connecting
                    return
                raise
            del self._out[:n]

    def take(self) -> list[bytes]:
        self._send()
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno == errno.ENOTCONN:
                    break
                raise
            if not chunk:
                raise ConnectionResetError(errno.ECONNRESET, "the session port closed")
            self._in += chunk
        out = []
        while len(self._in) >= FRAME.size:
            (n,) = FRAME.unpack_from(self._in)
            if n > wire.MAX_MESSAGE_BYTES:
                raise OSError(errno.EMSGSIZE, f"an answer frame of {n} B")
            if len(self._in) < FRAME.size + n:
                break
            out.append(bytes(self._in[FRAME.size:FRAME.size + n]))
            del self._in[:FRAME.size + n]
        return out

    def pollable(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class _Conn:
    where: str
    pipe: _Pipe
    queued: list[tuple[int, wire.Request, Pending]] = dataclasses.field(default_factory=list)
    waiting: dict[int, tuple[wire.Request, Pending]] = dataclasses.field(default_factory=dict)
    nonce: bytes = b""  # our Hello's nonce while the session opens
    key: bytes | None = None
    counter: int = 0
    hello_deadline: float = 0.0
    broken: str = ""  # a send failed: the connection is gone


class Channels:
    """One kept-open connection per (host, port); see the module docstring."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._session_ports: dict[tuple[str, int], int] = {}  # side channel -> session port
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

    def learn(self, host: str, port: int, session_port: int) -> None:
        """A handshake with ``host:port`` named its session port: calls go there from now on
        (a connection open to an older one is closed once nothing awaits an answer on it)."""
        with self._lock:
            if not session_port or self._session_ports.get((host, port)) == session_port:
                return
            self._session_ports[(host, port)] = session_port
            conn = self._conns.get((host, port))
            if conn is not None and not (conn.queued or conn.waiting or conn.nonce):
                self._reset((host, port), conn, PeerUnreachable("replaced"))

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
                if conn.broken:
                    if isinstance(conn.pipe, _TcpPipe):
                        self._fall_back(key, conn, conn.broken)
                    else:
                        self._reset(key, conn, PeerUnreachable(
                            f"side channel {conn.where}: {conn.broken}"))
                    continue
                if conn.waiting or conn.nonce:
                    try:
                        frames = conn.pipe.take()
                    except OSError as exc:
                        if isinstance(conn.pipe, _TcpPipe):
                            self._fall_back(key, conn, exc)
                        else:
                            self._reset(key, conn, PeerUnreachable(
                                f"side channel {conn.where}: {exc}"))
                        continue
                    for body in frames:
                        self._take(key, conn, body)
                        if self._conns.get(key) is not conn:
                            break
                if self._conns.get(key) is not conn:
                    continue
                late = [p for _, p in conn.waiting.values() if now >= p.deadline]
                if late:
                    # a peer that let a call time out is gone or wedged: drop the connection,
                    # and with it what may still sit in its queues, so no stale frame reaches
                    # whoever serves that address next (a restarted process)
                    self._reset(key, conn, PeerUnreachable(
                        f"no answer from side channel {late[0].what} in time"))
                    continue
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
        """Block up to ``timeout`` seconds (at least 1 ms while a ZMQ pipe is awaited: ZMQ polls
        in milliseconds), waking early when an answer arrives, with the GIL released; then
        pump. Never a busy return, so a caller may loop on it."""
        with self._lock:
            busy = [c.pipe for c in self._conns.values() if c.waiting or c.nonce]
        timeout = max(0.0, timeout)
        if any(isinstance(p, _ZmqPipe) for p in busy):  # ZMQ polls in whole milliseconds
            poller = zmq.Poller()
            for p in busy:
                poller.register(p.pollable(), zmq.POLLIN)
            poller.poll(max(1, round(timeout * 1000)))
        elif busy:
            select.select([p.pollable() for p in busy], [], [], timeout)
        else:  # nothing awaited here: a plain sleep
            time.sleep(timeout)
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
            session = self._session_ports.get((host, port))
            pipe: _Pipe
            try:
                pipe = (_TcpPipe(host, session) if session else
                        _ZmqPipe(self._ctx, host, port))
            except OSError as exc:  # fails its calls at their deadline, in pump()
                log.info("session port of %s:%d: %s; using its side channel", host, port, exc)
                pipe = _ZmqPipe(self._ctx, host, port)
            where = f"{host}:{port}" + (f" (session port {session})" if session else "")
            conn = self._conns[(host, port)] = _Conn(where, pipe)
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
            for cid, m, pending in chunk:
                conn.waiting[cid] = (m, pending)
            self._put(conn, frame)
            self.calls_sent += len(chunk)

    def _put(self, conn: _Conn, msg: wire._Msg) -> None:
        try:
            conn.pipe.put(wire.encode(msg))
            self.frames_sent += 1
        except OSError as exc:  # gone: its calls fail in the next pump()
            log.info("side channel frame to %s not sent: %s", conn.where, exc)
            conn.broken = f"{exc}"

    def _take(self, key: tuple[str, int], conn: _Conn, body: bytes) -> None:
        try:
            reply = wire.decode(body)
        except KVLinkError as exc:
            log.warning("dropped a malformed answer from %s: %s", conn.where, exc)
            return
        if isinstance(reply, wire.Replies):
            for ans in reply.answers:
                got = conn.waiting.pop(ans.id, None)
                if got is not None:
                    got[1]._settle(ans.msg)
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

    def _fall_back(self, key: tuple[str, int], conn: _Conn, why: object) -> None:
        """The session connection broke (refused, reset, closed) with calls unanswered: its
        server is gone — it answers every frame it takes before it closes — so they go again
        through the side channel, which reaches whoever serves that address now (a restarted
        process answers "stale" and the worker handshakes again). Until a handshake names a
        session port again, the side channel carries everything to that address."""
        log.info("session connection %s broke (%s); using its side channel", conn.where, why)
        self._session_ports.pop(key, None)
        del self._conns[key]
        conn.pipe.close()
        fresh = self._conn(*key)
        fresh.queued = [(cid, m, p) for cid, (m, p) in conn.waiting.items()] + conn.queued
        self._send(fresh)

    def _reset(self, key: tuple[str, int], conn: _Conn, error: KVLinkError) -> None:
        """Fail everything on ``conn`` and drop it: the next call opens a fresh one."""
        for _, _, pending in conn.queued:
            pending._settle(None, error)
        for _, pending in conn.waiting.values():
            pending._settle(None, error)
        conn.pipe.close()
        if self._conns.get(key) is conn:
            del self._conns[key]
        if not isinstance(error, PeerUnreachable) or "cancelled" not in str(error):
            log.info("side channel connection to %s reset: %s", conn.where, error)

