"""Kept-open side-channel connections: one per peer, one session, one frame per step.

:func:`kvlink.sidechannel.request` opens a connection per call (and, with a secret, opens a
session first): two round trips and a socket per message, fine for a handshake, too slow for
the messages every request sends (read reports, "written" notes, releases). This module is the
per-request path, and it never blocks:

- :meth:`Channels.call` queues a message and returns a :class:`Pending`; :meth:`Channels.flush`
  sends everything queued for a peer as one :class:`kvlink.wire.Batch` frame (split where it
  would pass the server's :data:`~kvlink.sidechannel.REQUEST_BYTES`); :meth:`Channels.pump`
  takes whatever answers have arrived and expires calls past their deadline. All of it runs on
  the caller's thread (the worker's ``poll``): no thread pool, nothing waiting for the GIL.
- With a shared secret a connection authenticates once: ``Hello`` (client nonce) ->
  ``Welcome`` (server nonce), the session key derived from both, then every frame is
  :class:`kvlink.wire.Sealed` with a counter that only grows (replay and reordering refused).
  The server reads at most :data:`~kvlink.sidechannel.PREAUTH_BYTES` before the first sealed
  frame proved the key, so a larger first frame is preceded by an empty sealed one.
- A frame the server cannot take (no session: it restarted; a bad MAC) is answered by a bare
  ``ErrorReply``: every call on that connection fails with it, and the next call opens a new
  connection and session. Replies to calls that already timed out are dropped by id.

The pipe is one plain TCP connection to the peer's side channel port (the same port its
handshakes use: :mod:`kvlink.sidechannel` serves both), length-prefixed frames read and written
non-blocking from the caller's thread. Plain TCP, not ZMQ: ZMQ hands every frame to its I/O
thread and back, four thread wake-ups a round trip, measured 126 us (343 us with the cores idle
2 ms between requests) against 16 us (61 us) for plain TCP on the same loopback; and ZMQ could
not bound a whole multipart message on the server (see :mod:`kvlink.sidechannel`).

A connection that breaks with calls unanswered (reset, closed, refused) sends them again on a
new one, which reaches whoever serves that address now (a restarted process answers "stale" and
the worker handshakes again); a port nobody listens on is tried again every 50 ms until the
calls' deadlines, as ZMQ's reconnects did — but a ``live_only`` call (a question only the
process we talked to can answer) fails at once there. A call that times out resets its
connection.

One lock makes concurrent use correct, not fast: the worker drives it from its caller's thread.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import math
import secrets
import select
import socket
import threading
import time

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import (
    AuthError,
    IncompatibleSpecError,
    KVLinkError,
    PeerUnreachable,
    SideChannelError,
)
from kvlink.sidechannel import (
    FRAME,
    KEEPALIVE_S,
    PREAUTH_BYTES,
    REQUEST_BYTES,
    answer_key,
    seal,
    session_key,
    unseal_answers,
)
from kvlink.sockets import keepalive

log = logging.getLogger("kvlink.channel")

_CALLS_PER_FRAME = 512  # at most; fewer where the frame would pass REQUEST_BYTES
_SEALED = 256  # bytes a Sealed envelope adds to its batch, at most
_RETRY = 0.05  # s between connection attempts to a peer that refused (or never answered)
# bytes a recv asks for: answers are small, and CPython allocates the whole size first (a
# 1 MiB ask cost 5 us more per answer than this, in malloc, on every pump)
_RECV = 1 << 16
_ERRORS: dict[str, type[KVLinkError]] = {"incompatible": IncompatibleSpecError, "auth": AuthError}


def error_of(where: str, reply: wire.ErrorReply) -> KVLinkError:
    """The exception an ``ErrorReply`` means, with the peer's code in ``code``."""
    err = _ERRORS.get(reply.code, SideChannelError)(f"{where} answered {reply.code}: "
                                                     f"{reply.message}")
    err.code = reply.code
    return err


def _refused(why: object) -> bool:
    """Whether a connection ended because nobody listens at its address."""
    return getattr(why, "errno", None) == errno.ECONNREFUSED


class Pending:
    """The answer to one queued message, once :meth:`Channels.pump` has seen it."""

    __slots__ = ("_error", "_reply", "asked", "deadline", "live_only", "what")

    def __init__(self, what: str, asked: float, deadline: float,
                 live_only: bool = False) -> None:
        self.what = what
        self.asked = asked  # monotonic time it was queued: a grant's clock starts no later
        self.deadline = deadline
        self.live_only = live_only  # see Channels.call
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


class _TcpPipe:
    """One plain TCP connection to a side channel, never blocking: frames are
    ``FRAME``-prefixed; what the kernel does not take now is sent by the next call."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(self.sock, KEEPALIVE_S)  # (kept open: a producer host that vanishes)
        self.sock.setblocking(False)
        err = self.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            self.sock.close()
            raise OSError(err, f"cannot connect to the side channel {host}:{port}: "
                          f"{errno.errorcode.get(err, err)}")
        self._out = bytearray()
        self._in = bytearray()

    def put(self, body: bytes) -> None:
        if len(body) > REQUEST_BYTES:
            raise OSError(errno.EMSGSIZE, f"a frame of {len(body)} B")
        self._out += FRAME.pack(len(body))
        self._out += body
        self._send()

    def wants_write(self) -> bool:
        return bool(self._out)

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
        """Frames that arrived; raises OSError when the connection is gone — once the frames
        that came before its end were taken (a server answers, then may close at once)."""
        gone: OSError | None = None
        try:
            self._send()
        except OSError as exc:
            gone = exc
        while True:
            try:
                chunk = self.sock.recv(_RECV)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    gone = gone or exc
                break
            if not chunk:
                gone = gone or ConnectionResetError(errno.ECONNRESET,
                                                    "the side channel closed it")
                break
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
        if gone is not None and not out:
            raise gone
        return out  # (gone with frames: the next take() finds the end again)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class _Conn:
    where: str
    addr: tuple[str, int]
    pipe: _TcpPipe | None = None  # None: not connected yet (or, after retry_at, again)
    queued: list[tuple[int, wire.Request, Pending]] = dataclasses.field(default_factory=list)
    waiting: dict[int, tuple[wire.Request, Pending]] = dataclasses.field(default_factory=dict)
    nonce: bytes = b""  # our Hello's nonce while the session opens
    key: bytes | None = None
    counter: int = 0
    answers: bytes | None = None  # the key the server seals its answers with
    answered_at: int = 0  # the last sealed answer's frame number
    hello_deadline: float = 0.0
    broken: str = ""  # a send failed: the connection is gone
    refused: bool = False  # ... because nobody listens at the address (ECONNREFUSED)
    retry_at: float = 0.0  # connect no earlier than this (the last attempt got nothing)
    answered: int = 0  # frames that came back on this connection
    why: str = ""  # why the last connection to this address broke

    def said(self) -> str:
        return f" (the last connection: {self.why})" if self.why else ""


class Channels:
    """One kept-open connection per (host, port); see the module docstring."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        self._conns: dict[tuple[str, int], _Conn] = {}
        #: addresses that have answered a call of ours (see :meth:`heard`)
        self._heard: set[tuple[str, int]] = set()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.frames_sent = 0
        self.calls_sent = 0

    def call(self, host: str, port: int, msg: wire.Request, timeout: float,
             quiet: bool = False, live_only: bool = False) -> Pending:
        """Queue ``msg`` for ``host:port``; it leaves on the next :meth:`flush`. ``quiet``: a
        report that wants no answer (call id 0): its Pending settles with ``Ack`` once the
        frame is sent, and the server answers nothing — no answer to read on the caller's
        next poll. Sent is not delivered: a connection that breaks after the frame left
        loses it (one still queued goes on the next connection, like any call).

        ``live_only``: a question only the process we talked to can answer (what became of a
        READ of its memory), so nobody listening at the address (connection refused) fails
        it at once instead of at its deadline: that process is gone, and whoever starts there
        next never held what it asks about. Without it a dead prefill held a synchronous
        load's forward for the report timeout (2 s)."""
        with self._lock:
            conn = self._conn(host, port)
            now = time.monotonic()
            pending = Pending(f"{conn.where} ({type(msg).__name__})", now, now + timeout,
                              live_only)
            conn.queued.append((0 if quiet else next(self._ids), msg, pending))
            return pending

    def heard(self, host: str, port: int) -> bool:
        """Whether ``host:port`` has answered a call of ours: a process was there. A question
        only that process can answer is then ``live_only`` (:meth:`call`): nobody listening
        there any more means it is gone, not that it has yet to start."""
        with self._lock:
            return (host, port) in self._heard

    def idle(self) -> bool:
        """Whether a :meth:`pump` has nothing to do now: no call awaits its answer, no session
        is opening, nothing is queued or broken."""
        with self._lock:  # (a loop, not any() over a generator: a poll's path, cold)
            for c in self._conns.values():
                if c.waiting or c.nonce or c.queued or c.broken:
                    return False
            return True

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
                    self._fall_back(key, conn, conn.broken)
                    continue
                if conn.pipe is None:  # waiting to connect again
                    if conn.queued and now >= conn.retry_at:
                        self._send(conn)
                elif conn.waiting or conn.nonce:
                    try:
                        frames = conn.pipe.take()
                    except OSError as exc:
                        self._fall_back(key, conn, exc)
                        continue
                    conn.answered += len(frames)
                    if frames:
                        self._heard.add(key)
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
                        f"no answer from side channel {late[0].what} in time{conn.said()}"))
                    continue
                if conn.nonce and now >= conn.hello_deadline:
                    self._reset(key, conn, PeerUnreachable(
                        f"side channel {conn.where} did not open a session in time"
                        f"{conn.said()}"))
                else:
                    self._expire_queued(conn, now)
                    if not (conn.queued or conn.waiting or conn.nonce or conn.pipe):
                        del self._conns[key]  # never connected, nothing left to send

    def busy(self) -> bool:
        """Anything queued or awaiting an answer."""
        with self._lock:
            return any(c.queued or c.waiting or c.nonce for c in self._conns.values())

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds, waking early when an answer arrives, with the GIL
        released; then pump. Never a busy return, so a caller may loop on it. ``poll`` counts
        whole milliseconds: a shorter wait sleeps its length and takes what came meanwhile
        (rounded up, a 0.2 ms wait for a READ that no message ends slept 1 ms: the vLLM
        worker's waits for a load, bench/results/vllm_pd_sync_*)."""
        timeout = max(0.0, timeout)
        poller = select.poll()  # not select(): a serving process may hold fds past 1024
        awaited = False
        with self._lock:
            now = time.monotonic()
            for c in self._conns.values():
                if c.broken:
                    timeout = 0.0  # pump() takes it now
                elif c.pipe is None:
                    if c.queued:
                        timeout = min(timeout, max(0.0, c.retry_at - now))
                elif c.waiting or c.nonce or c.pipe.wants_write():
                    awaited = True
                    poller.register(c.pipe.fileno(), select.POLLIN
                                    | (select.POLLOUT if c.pipe.wants_write() else 0))
        if awaited and timeout >= 0.001:
            poller.poll(math.ceil(timeout * 1000))
        else:  # nothing awaited here, or less than poll's millisecond: a plain sleep
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
            conn = self._conns[(host, port)] = _Conn(f"{host}:{port}", (host, port))
        return conn

    def _send(self, conn: _Conn) -> None:
        if conn.pipe is None:
            if time.monotonic() < conn.retry_at:
                return  # pump() connects once it is time
            try:
                conn.pipe = _TcpPipe(*conn.addr)
            except OSError as exc:  # refused at once: pump() tries again (until deadlines)
                conn.broken, conn.refused = f"{exc}", _refused(exc)
                return
        if self._secret is not None and conn.key is None:
            if not conn.nonce:  # open the session; the queue leaves once it is welcomed
                conn.nonce = secrets.token_bytes(16)
                conn.hello_deadline = max(p.deadline for _, _, p in conn.queued)
                self._put(conn, wire.encode(wire.Hello(v=WIRE_VERSION, nonce=conn.nonce)))
            return
        while conn.queued and not conn.broken:
            chunk = conn.queued[:_CALLS_PER_FRAME]
            body = self._batch(chunk)
            while len(body) + _SEALED > REQUEST_BYTES and len(chunk) > 1:
                chunk = chunk[:len(chunk) // 2]
                body = self._batch(chunk)
            conn.queued = conn.queued[len(chunk):]
            if len(body) + _SEALED > REQUEST_BYTES:  # one call alone: no server takes it
                cid, m, pending = chunk[0]
                pending._settle(None, SideChannelError(
                    f"{pending.what}: a message of {len(body)} B exceeds the side channel's "
                    f"{REQUEST_BYTES} B request bound"))
                continue
            frame = body if conn.key is None else wire.encode(self._seal(conn, body))
            self._put(conn, frame)
            if conn.broken:
                # not sent (the pipe raises only with the frame's tail unsent: no server took
                # it): back to the queue's head, which _fall_back sends again in order. Its
                # quiet calls were lost here before — out of the queue, never awaited, never
                # settled: a report (a release) whose frame did not leave was neither sent
                # again nor failed, and its Pending stayed open for good
                conn.queued = chunk + conn.queued
                return
            for cid, m, pending in chunk:
                if cid:
                    conn.waiting[cid] = (m, pending)
                else:  # sent: nothing comes back for it
                    pending._settle(wire.Ack(v=WIRE_VERSION))
            self.calls_sent += len(chunk)

    @staticmethod
    def _batch(chunk: list[tuple[int, wire.Request, Pending]]) -> bytes:
        return wire.encode(wire.Batch(v=WIRE_VERSION,
                                      calls=[wire.Call(cid, m) for cid, m, _ in chunk]))

    def _seal(self, conn: _Conn, body: bytes) -> wire.Sealed:
        assert conn.key is not None
        if conn.counter == 0 and len(body) + _SEALED > PREAUTH_BYTES:
            # the server reads no more than PREAUTH_BYTES before a sealed frame proved the key
            conn.counter += 1
            self._put(conn, wire.encode(seal(conn.key, conn.counter,
                                             wire.Batch(v=WIRE_VERSION, calls=[]))))
        conn.counter += 1
        return seal(conn.key, conn.counter, body)

    def _put(self, conn: _Conn, frame: bytes) -> None:
        assert conn.pipe is not None
        try:
            conn.pipe.put(frame)
            self.frames_sent += 1
        except OSError as exc:  # gone: its calls go again in the next pump()
            log.info("side channel frame to %s not sent: %s", conn.where, exc)
            conn.broken, conn.refused = f"{exc}", _refused(exc)

    def _take(self, key: tuple[str, int], conn: _Conn, body: bytes) -> None:
        sealed = False
        try:
            reply = wire.decode(body)
            if conn.answers is not None and isinstance(reply, wire.Sealed):
                counter = reply.counter
                reply = unseal_answers(conn.answers, conn.answered_at, reply, conn.where)
                conn.answered_at, sealed = counter, True
        except AuthError as exc:  # not our session's server: nothing it says is taken
            self._reset(key, conn, exc)
            return
        except KVLinkError as exc:
            log.warning("dropped a malformed answer from %s: %s", conn.where, exc)
            return
        if isinstance(reply, wire.Replies) and self._secret is not None and not sealed:
            self._reset(key, conn, AuthError(  # nothing it says is taken
                f"{conn.where} answered unsealed: a session's answers are sealed (it does "
                "not hold our secret, or is older than wire version 7)"))
        elif isinstance(reply, wire.Replies):
            for ans in reply.answers:
                got = conn.waiting.pop(ans.id, None)
                if got is not None:
                    got[1]._settle(ans.msg)
        elif isinstance(reply, wire.Welcome) and conn.nonce and self._secret is not None:
            if not reply.nonce:  # a server without a secret: it could not seal anything
                self._reset(key, conn, AuthError(f"{conn.where} did not open an "
                                                 "authenticated session (does it have a "
                                                 "secret?)"))
                return
            conn.key = session_key(self._secret, conn.nonce, reply.nonce)
            conn.answers, conn.answered_at = answer_key(conn.key), 0
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
                item[2]._settle(None, PeerUnreachable(
                    f"{item[2].what}: not sent in time{conn.said()}"))
            else:
                keep.append(item)
        conn.queued = keep

    def _fall_back(self, key: tuple[str, int], conn: _Conn, why: object) -> None:
        """The connection broke (refused, reset, closed): what it had queued, and what was
        sent on it unanswered, goes again on a new connection. Its server is gone — it answers
        every frame it takes before it closes — and a new connection reaches whoever serves
        that address now (a restarted process answers "stale" and the worker handshakes
        again). One that got nothing back (refused: nobody listens there yet) waits a moment
        first; the calls fail at their deadlines."""
        log.info("side channel connection to %s broke (%s)", conn.where, why)
        if conn.pipe is not None:
            conn.pipe.close()
        del self._conns[key]
        again = [(cid, m, p) for cid, (m, p) in conn.waiting.items()] + conn.queued
        if not again:
            return
        if not conn.answered and (conn.refused or _refused(why)):
            for _, _, pending in again:  # nobody listens: the process they ask about is gone
                if pending.live_only:
                    pending._settle(None, PeerUnreachable(
                        f"{pending.what}: nobody listens there (connection refused): the "
                        "process that held it is gone"))
            again = [item for item in again if not item[2].live_only]
            if not again:
                return
        fresh = self._conn(*key)
        fresh.queued = again
        if not conn.answered:
            fresh.retry_at = time.monotonic() + _RETRY
            fresh.why = f"{why}"
            self._expire_queued(fresh, time.monotonic())
            if not fresh.queued:
                del self._conns[key]
            return
        self._send(fresh)

    def _reset(self, key: tuple[str, int], conn: _Conn, error: KVLinkError) -> None:
        """Fail everything on ``conn`` and drop it: the next call opens a fresh one."""
        for _, _, pending in conn.queued:
            pending._settle(None, error)
        for _, pending in conn.waiting.values():
            pending._settle(None, error)
        if conn.pipe is not None:
            conn.pipe.close()
        if self._conns.get(key) is conn:
            del self._conns[key]
        if not isinstance(error, PeerUnreachable) or "cancelled" not in str(error):
            log.info("side channel connection to %s reset: %s", conn.where, error)
