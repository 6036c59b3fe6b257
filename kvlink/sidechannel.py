"""ZMQ side channel: handshakes and notifications, with a deadline on every call.

Each producer (and, in push mode, each consumer) runs one :class:`SideChannelServer`: a thread
with a ROUTER socket answering one request (or one :class:`wire.Batch`) with one reply, and a
*session port* — plain TCP, one thread per kept-open connection, blocked in ``recv`` — for
the per-request messages of peers that handshook (:mod:`kvlink.channel`). :func:`request`
opens a fresh DEALER per call (handshakes), so a call that timed out can never receive a stale
reply meant for it later.

Who may connect: the handshake hands out what is needed to read registered memory, so with a
shared secret (config or ``KVLINK_SECRET``) every request must be a :class:`wire.Signed` message:
HMAC-SHA256 over a single-use server nonce and the body, compared in constant time; a replayed
nonce is refused. Without a secret the server binds loopback only, unless told explicitly that
the network is trusted (then it warns).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq

from kvlink import wire
from kvlink.errors import (
    AuthError,
    ConfigError,
    IncompatibleSpecError,
    KVLinkError,
    PeerUnreachable,
    SideChannelError,
    WireError,
)
from kvlink.sockets import shutdown

log = logging.getLogger("kvlink.sidechannel")

SESSION_LABEL = b"kvlink-session-v1"
FRAME = struct.Struct("<I")  # a session frame's length prefix
_SESSION_CONNECTIONS = 1024  # kept-open session connections one server takes at most
Handler = Callable[[object], "wire.Reply"]


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secret_from_env(explicit: bytes | str | None = None) -> bytes | None:
    """The shared secret: explicit config wins, then ``KVLINK_SECRET``; None when neither."""
    value = explicit if explicit is not None else os.environ.get("KVLINK_SECRET")
    if value is None or value == "":
        return None
    return value.encode() if isinstance(value, str) else value


def _mac(secret: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, nonce + body, hashlib.sha256).digest()


def session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The key of one kept-open connection: both sides' nonces in it, so neither picks it."""
    return hmac.new(secret, SESSION_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def seal_mac(key: bytes, counter: int, body: bytes) -> bytes:
    return hmac.new(key, counter.to_bytes(8, "little") + body, hashlib.sha256).digest()


class _Nonces:
    """Outstanding single-use nonces with an expiry (bounded, so a flood cannot grow memory)."""

    def __init__(self, ttl: float = 30.0, limit: int = 4096) -> None:
        self.ttl = ttl
        self._issued: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._limit = limit

    def issue(self) -> bytes:
        nonce = secrets.token_bytes(16)
        self._issued[nonce] = time.monotonic() + self.ttl
        while len(self._issued) > self._limit:
            self._issued.popitem(last=False)
        return nonce

    def redeem(self, nonce: bytes) -> bool:
        deadline = self._issued.pop(nonce, None)
        return deadline is not None and time.monotonic() <= deadline


class _Sessions:
    """Keys of kept-open connections by ZMQ routing id (one per connection, picked by ZMQ, so
    a peer cannot take over another's), with the last counter seen. Bounded: the oldest
    session goes first, and its client simply opens a new one."""

    def __init__(self, limit: int = 4096) -> None:
        self._keys: collections.OrderedDict[bytes, tuple[bytes, int]] = (
            collections.OrderedDict())
        self._limit = limit

    def close(self, ident: bytes) -> None:
        self._keys.pop(ident, None)

    def open(self, ident: bytes, key: bytes) -> None:
        self._keys[ident] = (key, 0)
        self._keys.move_to_end(ident)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def unseal(self, ident: bytes, msg: wire.Sealed) -> bytes:
        got = self._keys.get(ident)
        if got is None:
            raise AuthError("no session on this connection (the server restarted, or it was "
                            "evicted): say Hello again")
        key, last = got
        if msg.counter <= last:
            raise AuthError(f"frame counter {msg.counter} after {last}: replayed or reordered")
        if not hmac.compare_digest(msg.mac, seal_mac(key, msg.counter, msg.body)):
            raise AuthError("bad session MAC: the peers' secrets differ")
        self._keys[ident] = (key, msg.counter)
        return msg.body


def read_frame(sock: socket.socket) -> bytes | None:
    """One length-prefixed frame off a blocking socket; None at a clean end of stream."""
    head = _read_exact(sock, FRAME.size)
    if head is None:
        return None
    (n,) = FRAME.unpack(head)
    if n > wire.MAX_MESSAGE_BYTES:
        raise WireError(f"a session frame of {n} B exceeds the {wire.MAX_MESSAGE_BYTES} B bound")
    body = _read_exact(sock, n)
    if body is None:
        raise WireError("the session connection closed inside a frame")
    return body


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise WireError(f"the session connection closed after {got} of {n} B")
        got += k
    return bytes(buf)


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers requests on ``host:port`` with ``handler(msg)`` from a daemon thread.

    ``port=0`` binds an ephemeral port (see :attr:`port`). Handler exceptions become
    ErrorReply answers; the server itself never dies on a bad message.
    """

    def __init__(self, host: str, port: int, handler: Handler, name: str = "kvlink-side",
                 secret: bytes | None = None, allow_insecure: bool = False,
                 session_port: int = 0) -> None:
        if secret is None and not is_loopback(host) and not allow_insecure:
            raise ConfigError(
                f"refusing to bind an unauthenticated side channel on {host}: set a shared "
                "secret (KVLINK_SECRET or config 'secret'), or allow_insecure on a trusted network")
        self._handler = handler
        self._secret = secret
        self._nonces = _Nonces()
        self._sessions = _Sessions()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(endpoint(host, 0).rsplit(":", 1)[0])
            else:
                self._sock.bind(endpoint(host, port))
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            raise SideChannelError(f"cannot bind side channel on {host}:{port}: {exc}") from exc
        self.host = host
        if secret is None and not is_loopback(host):
            log.warning("UNAUTHENTICATED side channel bound on %s:%d: any peer that reaches it can "
                        "read registered memory; configure KVLINK_SECRET", host, self.port)
        self._stop = threading.Event()
        self._sessions_lock = threading.Lock()  # sessions are opened from several threads
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        try:
            self._listener = socket.create_server((host, session_port), backlog=128)
        except OSError as exc:
            self._sock.close()
            raise SideChannelError(f"cannot bind the session port on {host}:{session_port}: "
                                   f"{exc}") from exc
        self.session_port: int = self._listener.getsockname()[1]
        self._name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept",
                                          daemon=True)
        self._acceptor.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[-1]
            reply = self._answer(ident, body)
            try:
                self._sock.send_multipart([ident, b"", wire.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.info("side channel reply dropped: %s", exc)
        self._sock.close(linger=0)

    # ------------------------------------------------------------------ kept-open sessions
    def _accept(self) -> None:
        """Kept-open session connections (:mod:`kvlink.channel`): plain TCP, one thread each,
        blocked in ``recv`` with the GIL released, so a frame wakes exactly the thread that
        answers it — no I/O-thread hops, which cost ZMQ 100-300 us a round trip here."""
        ids = 0
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._sessions_lock:
                if len(self._conns) >= _SESSION_CONNECTIONS or self._stop.is_set():
                    conn.close()
                    log.warning("side channel: refused a session connection (%d open)",
                                len(self._conns))
                    continue
                self._conns.add(conn)
                ids += 1
                t = threading.Thread(target=self._serve_session, args=(conn, b"tcp:%d" % ids),
                                     name=f"{self._name}-session", daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve_session(self, conn: socket.socket, ident: bytes) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._stop.is_set():
                body = read_frame(conn)
                if body is None:
                    return  # the client closed it
                reply = wire.encode(self._answer(ident, body))
                conn.sendall(FRAME.pack(len(reply)) + reply)
        except (OSError, WireError) as exc:
            log.info("side channel session %s ended: %s", ident.decode(), exc)
        finally:
            with self._sessions_lock:
                self._conns.discard(conn)
                self._sessions.close(ident)
            conn.close()

    def _answer(self, ident: bytes, body: bytes) -> wire._Msg:
        try:
            msg = wire.decode(body)
            if isinstance(msg, (wire.Hello, wire.Sealed, wire.Batch)):
                return self._session_frame(ident, msg)
            if self._secret is not None:
                if isinstance(msg, wire.Challenge):
                    return wire.Challenge(v=wire.WIRE_VERSION, nonce=self._nonces.issue())
                msg = self._verify(msg)
            elif isinstance(msg, wire.Signed):
                msg = wire.decode(msg.body)  # a peer with a secret talking to one without
        except WireError as exc:
            log.warning("side channel rejected a message: %s", exc)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="bad_message", message=str(exc))
        except AuthError as exc:
            log.warning("side channel refused a peer: %s", exc)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="auth", message=str(exc))
        return self._handle(msg)

    def _session_frame(self, ident: bytes, msg: wire.Hello | wire.Sealed | wire.Batch
                       ) -> wire._Msg:
        """A kept-open connection's frame (:mod:`kvlink.channel`): open its session, or
        answer every call of its batch in one :class:`wire.Replies`."""
        if isinstance(msg, wire.Hello):
            if self._secret is None:  # nothing to agree on: any batch is taken as it is
                return wire.Welcome(v=wire.WIRE_VERSION, nonce=b"")
            if not 8 <= len(msg.nonce) <= 64:
                raise AuthError(f"a Hello nonce of {len(msg.nonce)} B (8-64 expected)")
            ours = secrets.token_bytes(16)
            with self._sessions_lock:
                self._sessions.open(ident, session_key(self._secret, msg.nonce, ours))
            return wire.Welcome(v=wire.WIRE_VERSION, nonce=ours)
        if isinstance(msg, wire.Sealed):
            if self._secret is None:
                batch = wire.decode(msg.body, wire.Batch)
            else:
                with self._sessions_lock:
                    body = self._sessions.unseal(ident, msg)
                batch = wire.decode(body, wire.Batch)
        elif self._secret is not None:
            raise AuthError("an unsealed batch, and this side channel requires authentication")
        else:
            batch = msg
        return wire.Replies(v=wire.WIRE_VERSION, answers=[
            wire.Answer(c.id, self._handle(c.msg)) for c in batch.calls])

    def _handle(self, msg: object) -> wire.Reply:
        try:
            return self._handler(msg)
        except IncompatibleSpecError as exc:
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="incompatible", message=str(exc))
        except Exception as exc:  # the handler's bug must not kill the server thread
            log.exception("side channel handler failed on %s", type(msg).__name__)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="handler_error",
                                   message=f"{type(exc).__name__}: {exc}")

    def _verify(self, msg: object) -> object:
        assert self._secret is not None
        if not isinstance(msg, wire.Signed):
            raise AuthError(f"{type(msg).__name__} is not signed and this side channel "
                            "requires authentication")
        if not self._nonces.redeem(msg.nonce):
            raise AuthError("unknown, expired or replayed nonce")
        if not hmac.compare_digest(msg.mac, _mac(self._secret, msg.nonce, msg.body)):
            raise AuthError("bad HMAC: the peers' secrets differ")
        inner = wire.decode(msg.body)
        if isinstance(inner, (wire.Signed, wire.Challenge)):
            raise AuthError("nested authentication messages are not accepted")
        return inner

    def close(self) -> None:
        self._stop.set()
        shutdown(self._listener)
        self._listener.close()
        with self._sessions_lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            shutdown(conn)  # wakes its thread out of recv; it closes the socket
        end = time.monotonic() + 2
        for t in [self._thread, self._acceptor, *threads]:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=max(0.0, end - time.monotonic()))


def request(host: str, port: int, msg: wire._Msg, timeout: float,
            secret: bytes | None = None, cancel: threading.Event | None = None) -> wire._Msg:
    """One request, one reply, within ``timeout`` seconds (PeerUnreachable otherwise).

    With a secret, first fetch a nonce, then send the message signed (two round trips; only
    handshakes and notifications go this way, never the data path). ``cancel``: when set, the
    call gives up within 50 ms (a closing worker must not wait out a dead peer's timeout).
    An ``ErrorReply`` answer raises, with the peer's code in the exception's ``code``.
    """
    deadline = time.monotonic() + timeout
    if secret is not None:
        challenge = _exchange(host, port, wire.Challenge(v=wire.WIRE_VERSION, nonce=b""),
                              timeout, cancel)
        if not isinstance(challenge, wire.Challenge) or not challenge.nonce:
            raise AuthError(f"{host}:{port} did not hand out a nonce (does it have a secret?)")
        body = wire.encode(msg)
        msg = wire.Signed(v=wire.WIRE_VERSION, nonce=challenge.nonce,
                          mac=_mac(secret, challenge.nonce, body), body=body)
    return _exchange(host, port, msg, max(0.05, deadline - time.monotonic()), cancel)


def _exchange(host: str, port: int, msg: wire._Msg, timeout: float,
              cancel: threading.Event | None = None) -> wire._Msg:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    try:
        sock.connect(endpoint(host, port))
        sock.send_multipart([b"", wire.encode(msg)])
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            step = left if cancel is None else min(left, 0.05)
            if sock.poll(max(0, int(step * 1000)), zmq.POLLIN):
                break
            if cancel is not None and cancel.is_set():
                raise PeerUnreachable(f"call to side channel {host}:{port} cancelled (closing; "
                                      f"{type(msg).__name__} not answered)")
            if time.monotonic() >= end:
                raise PeerUnreachable(
                    f"no answer from side channel {host}:{port} within {timeout:.1f}s "
                    f"(to {type(msg).__name__})"
                )
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    reply: wire._Msg = wire.decode(frames[-1])
    if isinstance(reply, wire.ErrorReply):
        cls: type[KVLinkError] = {"incompatible": IncompatibleSpecError,
                                  "auth": AuthError}.get(reply.code, SideChannelError)
        err = cls(f"{host}:{port} answered {reply.code}: {reply.message}")
        err.code = reply.code
        raise err
    return reply
