"""The side channel: handshakes and notifications over plain TCP, bounded before authentication.

Each producer (and, in push mode, each consumer) runs one :class:`SideChannelServer`: one
thread, one listening TCP port, every connection read non-blocking from one ``selectors`` loop.
Every frame is a 4-byte little-endian length (:data:`FRAME`) and one :mod:`kvlink.wire`
message; each frame is answered by one frame, in order. The same port serves one-shot calls
(:func:`request`: connect, one exchange, close — handshakes) and the kept-open connections of
:mod:`kvlink.channel` (one per peer, every per-request message). The server's thread is the one
that answers: a frame wakes it out of ``epoll`` with the GIL released, no I/O-thread hops. The
handler runs on that thread, one message at a time, for every peer: it must not block.

Who may connect: the handshake hands out what is needed to reach registered memory, so with a
shared secret (config or ``KVLINK_SECRET``) a connection authenticates before anything but a
handshake-sized frame is read: ``Hello`` (client nonce) -> ``Welcome`` (server nonce), a key
derived from both, then :class:`wire.Sealed` frames, HMAC-SHA256 over a counter that only grows
(replayed and reordered frames are refused). A lone :class:`wire.Signed` message (single-use
server nonce from a ``Challenge``) is taken too. Without a secret the server binds loopback
only, unless told explicitly that the network is trusted (then it warns).

Bounds, with and without a secret (issue 20, item 4): a frame's body is read as it arrives —
never allocated at its announced length — and a length over the connection's bound is answered
by an ``ErrorReply`` (code ``too_large``) naming the bound, then the connection is closed (the
stream cannot resync). With a secret the bound is :data:`PREAUTH_BYTES` until the connection
authenticated (its first valid ``Sealed`` or ``Signed`` frame), :data:`REQUEST_BYTES` after;
without one, :data:`REQUEST_BYTES` from the first frame (and the connection counts as
authenticated at its first message). A frame started must be complete within
``frame_timeout``; a connection must authenticate within ``auth_timeout`` of its accept;
authenticated connections may idle. At most ``max_pending`` connections wait to authenticate —
one more closes the oldest of them, so idle sockets cannot lock a legitimate peer out — and at
most ``max_connections`` in all (beyond: the oldest unauthenticated one is closed, or, with
none, the new one refused). So before authentication the server holds at most ``max_pending``
x 64 KiB of frames (4 MiB); an authenticated peer may hold 4 MiB per connection. Closes and
refusals are logged, at most one line a second of each kind.

Why no ZMQ any more: ZMQ's ``MAXMSGSIZE`` bounds each frame of a multipart message, not the
message, and no libzmq option bounds a whole one — 24 frames of 15 MiB were buffered (360 MiB,
three peers 1.2 GB) inside libzmq before any of our code, secret or not, saw a byte.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import typing
from collections.abc import Callable

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

log = logging.getLogger("kvlink.sidechannel")

SESSION_LABEL = b"kvlink-session-v1"
FRAME = struct.Struct("<I")  # a frame's length prefix
#: a frame's bound until its connection authenticated (Hello, Challenge, Signed handshakes)
PREAUTH_BYTES = 64 << 10
#: a request frame's bound after (a Batch of many calls; replies may be wire.MAX_MESSAGE_BYTES)
REQUEST_BYTES = 8 << 20  # a call with wire.MAX_BLOCK_IDS block ids encodes to about 5 MiB
MAX_CONNECTIONS = 1024  # connections one server holds at most
MAX_PENDING = 64  # of them, not yet authenticated
AUTH_TIMEOUT = 10.0  # s from accept to authenticated
FRAME_TIMEOUT = 10.0  # s from a frame's first byte to its last
_DRAIN = 1.0  # s a refused connection is read (and dropped) after its error reply, then closed
_SWEEP = 0.1  # s between deadline checks
_STEP = 0.05  # s: request() looks at its cancel event at least this often
_RETRY = 0.05  # s between request()'s connection attempts to a port nobody listens on
_SCRATCH = 256 << 10  # bytes one recv takes at most
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


def seal(key: bytes, counter: int, batch: wire.Batch | bytes) -> wire.Sealed:
    """``batch`` (or its encoding) under a session key, as frame number ``counter``."""
    body = batch if isinstance(batch, bytes) else wire.encode(batch)
    return wire.Sealed(v=wire.WIRE_VERSION, counter=counter, mac=seal_mac(key, counter, body),
                       body=body)


def frame(msg: wire._Msg) -> bytes:
    """``msg`` as one length-prefixed frame."""
    body = wire.encode(msg)
    return FRAME.pack(len(body)) + body


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


class _Peer:
    """One accepted connection: its partial input, unsent output, deadlines and session."""

    __slots__ = ("authed", "closed", "counter", "drain_until", "events", "ident", "inbuf",
                 "key", "opened", "out", "out_since", "sock", "started", "where")

    def __init__(self, sock: socket.socket, ident: int, where: str, now: float) -> None:
        self.sock = sock
        self.ident = ident
        self.where = where
        self.opened = now
        self.inbuf = bytearray()  # an incomplete frame, never more than its bound
        self.started = 0.0  # when the first byte of the incomplete frame came (0: none)
        self.out = bytearray()
        self.out_since = 0.0
        self.authed = False
        self.key: bytes | None = None  # the session's, once Hello was answered
        self.counter = 0  # the last Sealed frame's
        self.drain_until = 0.0  # refused: its input is dropped until it closes or this passes
        self.closed = False
        self.events = selectors.EVENT_READ

    def __repr__(self) -> str:
        return f"connection {self.ident} from {self.where}"


_HANDOFF = 0.005  # seconds serve_ready waits for the server's thread to finish its round


class SideChannelServer:
    """Answers requests on ``host:port`` with ``handler(msg)`` from one daemon thread.

    ``port=0`` binds an ephemeral port (see :attr:`port`). Handler exceptions become
    ErrorReply answers; the server itself never dies on a bad message. The keyword limits
    are the module's bounds (see the module docstring); tests shorten them.
    """

    def __init__(self, host: str, port: int, handler: Handler, name: str = "kvlink-side",
                 secret: bytes | None = None, allow_insecure: bool = False, *,
                 max_connections: int = MAX_CONNECTIONS, max_pending: int = MAX_PENDING,
                 auth_timeout: float = AUTH_TIMEOUT, frame_timeout: float = FRAME_TIMEOUT,
                 preauth_bytes: int = PREAUTH_BYTES, request_bytes: int = REQUEST_BYTES
                 ) -> None:
        if secret is None and not is_loopback(host) and not allow_insecure:
            raise ConfigError(
                f"refusing to bind an unauthenticated side channel on {host}: set a shared "
                "secret (KVLINK_SECRET or config 'secret'), or allow_insecure on a trusted network")
        self._handler = handler
        self._secret = secret
        self._nonces = _Nonces()
        self._max_conns = max_connections
        self._max_pending = max(1, min(max_pending, max_connections))
        self._auth_timeout = auth_timeout
        self._frame_timeout = frame_timeout
        self._preauth = preauth_bytes
        self._request = request_bytes
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise SideChannelError(f"cannot bind side channel on {host}:{port}: {exc}") from exc
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        #: kept for HandshakeResponse.session_port: sessions are served on the same port
        self.session_port: int = self.port
        if secret is None and not is_loopback(host):
            log.warning("UNAUTHENTICATED side channel bound on %s:%d: any peer that reaches it can "
                        "read registered memory; configure KVLINK_SECRET", host, self.port)
        self._peers: dict[int, _Peer] = {}
        self._pending: collections.OrderedDict[int, _Peer] = collections.OrderedDict()
        self._ids = 0
        self._scratch = bytearray(_SCRATCH)
        self._warned: dict[str, tuple[float, int]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._listening = True
        self._name = name
        #: who serves ready connections now: the server's thread, or a caller in serve_ready
        self._serving = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """Open connections, those not yet authenticated, and those authenticated."""
        peers = list(self._peers.values())
        return {"connections": len(peers), "pending": len(self._pending),
                "authenticated": sum(p.authed for p in peers)}

    # ------------------------------------------------------------------ the loop
    def serve_ready(self) -> int:
        """Serve, on the calling thread and without waiting, whatever has arrived; returns how
        many events were served (0 also when the server's thread is serving right now).

        Why: the server's thread wakes out of ``epoll`` with the GIL released, then needs the
        GIL to run the handler; a caller that polls in a tight Python loop gives it up only
        every ``sys.getswitchinterval()`` (5 ms), so each message to it waited up to 5 ms (a
        layer-wise push of 80 layers: 80 such waits). A caller that serves its own inbox in
        its poll takes the messages at once. Call it with no lock held that the handler takes.

        If the server's thread is serving right now, this waits for it (at most
        ``_HANDOFF`` seconds) rather than returning: that thread, holding the serving lock,
        needs the GIL back after each socket call, which a caller that returned at once and
        went on polling would give it only every switch interval — a race the server's
        thread sometimes won, and then a layer-wise push took 20-270 ms instead of 1.5 (one
        H200). Waiting on the lock releases the GIL, so the server's thread finishes at once.
        """
        if self._stop.is_set() or not self._serving.acquire(timeout=_HANDOFF):
            return 0
        try:
            ready = self._sel.select(0)
            self._dispatch(ready)
            return len(ready)
        finally:
            self._serving.release()

    def _dispatch(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Serve one round of ``select``'s events (with ``_serving`` held). An event may be
        stale, served already by the other thread: every socket is non-blocking and a dropped
        peer is skipped."""
        for key, events in ready:
            peer = key.data
            if peer is None:
                self._accept()
            elif isinstance(peer, _Peer):
                self._serve(peer, events)
            else:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass

    def _run(self) -> None:
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_sweep:
                    with self._serving:
                        self._sweep(now)
                    next_sweep = now + _SWEEP
                ready = self._sel.select(max(0.0, next_sweep - time.monotonic()))
                with self._serving:
                    self._dispatch(ready)
        except Exception:  # a bug here must not leave the port bound and silent
            log.exception("side channel %s: its loop failed", self._name)
        finally:
            self._serving.acquire()  # a caller's serve_ready is over before the sockets close
            for peer in list(self._peers.values()):
                if peer.out:  # answers given: out with them, if the kernel takes them now
                    try:
                        peer.sock.send(peer.out)
                    except OSError:
                        pass
                self._drop(peer)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _serve(self, peer: _Peer, events: int) -> None:
        if peer.closed:  # dropped by an earlier event of this round
            return
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(peer)
            if events & selectors.EVENT_READ and not peer.closed:
                self._read(peer)
        except Exception:  # our bug: this connection goes, the server stays
            log.exception("side channel %s: failed serving %r", self._name, peer)
            self._drop(peer)

    def _warn(self, kind: str, message: str) -> None:
        """A warning, at most one a second of each kind (a flood must not flood the log)."""
        now = time.monotonic()
        last, muted = self._warned.get(kind, (-1e9, 0))
        if now - last < 1.0:
            self._warned[kind] = (last, muted + 1)
            return
        more = f" (and {muted} more like it in the last {now - last:.0f} s)" if muted else ""
        log.warning("side channel %s:%d: %s%s", self.host, self.port, message, more)
        self._warned[kind] = (now, 0)

    def _accept(self) -> None:
        for _ in range(64):  # then the loop looks at the other connections again
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: stop accepting for a sweep
                self._warn("accept", f"accept failed: {exc}; pausing")
                self._sel.unregister(self._listener)
                self._listening = False
                return
            where = addr[0] if isinstance(addr, tuple) else str(addr)
            if len(self._peers) >= self._max_conns:
                if not self._pending:
                    self._warn("refused", f"refused a connection from {where}: "
                               f"{len(self._peers)} open (the most it holds)")
                    sock.close()
                    continue
                self._evict(f"{len(self._peers)} connections open (the most it holds)")
            elif len(self._pending) >= self._max_pending:
                self._evict(f"{len(self._pending)} connections not authenticated (the most it "
                            "holds)")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._ids += 1
            peer = _Peer(sock, self._ids, where, time.monotonic())
            self._peers[peer.ident] = self._pending[peer.ident] = peer
            self._sel.register(sock, selectors.EVENT_READ, peer)

    def _evict(self, why: str) -> None:
        """Close the oldest connection not yet authenticated, for a new one: refusing the new
        one instead would let idle sockets lock every legitimate peer out."""
        _, oldest = self._pending.popitem(last=False)
        self._warn("evicted", f"closed {oldest!r}, not authenticated after "
                   f"{time.monotonic() - oldest.opened:.1f}s: {why}")
        self._drop(oldest)

    def _sweep(self, now: float) -> None:
        """Close connections past a deadline (see the module docstring)."""
        if not self._listening:
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._listening = True
        for peer in list(self._peers.values()):
            why = ""
            if peer.drain_until:
                if now >= peer.drain_until:
                    self._drop(peer)
                continue
            if not peer.authed and now - peer.opened > self._auth_timeout:
                why = f"not authenticated within {self._auth_timeout:g}s"
            elif peer.started and now - peer.started > self._frame_timeout:
                why = f"a frame not completed within {self._frame_timeout:g}s"
            elif peer.out and now - peer.out_since > self._frame_timeout:
                why = f"its answers not read within {self._frame_timeout:g}s"
            if why:
                self._warn("deadline", f"closed {peer!r}: {why}")
                self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        self._peers.pop(peer.ident, None)
        self._pending.pop(peer.ident, None)
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError, OSError):
            pass
        peer.sock.close()
        peer.inbuf, peer.out = bytearray(), bytearray()

    def _want(self, peer: _Peer, events: int) -> None:
        if peer.events != events and not peer.closed:
            peer.events = events
            self._sel.modify(peer.sock, events, peer)

    # ------------------------------------------------------------------ one connection
    def _read(self, peer: _Peer) -> None:
        if peer.drain_until:
            want = _SCRATCH
        else:  # never more than the bound ahead: an unauthenticated frame holds <= 64 KiB
            want = max(1, min(_SCRATCH, FRAME.size + self._bound(peer) - len(peer.inbuf)))
        try:
            got = peer.sock.recv_into(self._scratch, want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.info("side channel %r ended: %s", peer, exc)
            self._drop(peer)
            return
        if got == 0:  # the client closed it
            self._drop(peer)
            return
        if peer.drain_until:  # refused: what it still sends is dropped
            return
        if not peer.inbuf:
            peer.started = time.monotonic()
        peer.inbuf += memoryview(self._scratch)[:got]
        self._frames(peer)

    def _bound(self, peer: _Peer) -> int:
        """The largest frame ``peer`` may send now."""
        return self._request if peer.authed or self._secret is None else self._preauth

    def _frames(self, peer: _Peer) -> None:
        """Answer every complete frame in ``peer.inbuf``, in order."""
        buf, pos = peer.inbuf, 0
        while len(buf) - pos >= FRAME.size:
            (n,) = FRAME.unpack_from(buf, pos)
            bound = self._bound(peer)
            if n > bound:
                self._refuse(peer, n, bound)
                return
            if len(buf) - pos - FRAME.size < n:
                break
            body = bytes(buf[pos + FRAME.size:pos + FRAME.size + n])
            pos += FRAME.size + n
            reply = self._answer(peer, body)
            if reply is None:  # a batch of reports that want no answer
                continue
            answer = frame(reply)
            if len(answer) > FRAME.size + wire.MAX_MESSAGE_BYTES:  # no client would take it
                answer = frame(wire.ErrorReply(
                    v=wire.WIRE_VERSION, code="too_large", message=f"an answer of "
                    f"{len(answer)} B exceeds the {wire.MAX_MESSAGE_BYTES} B bound"))
            self._send(peer, answer)
            if peer.closed:
                return
        if pos:  # a fresh buffer: the old one's allocation goes with it
            peer.inbuf = bytearray(buf[pos:])
            peer.started = time.monotonic() if peer.inbuf else 0.0

    def _refuse(self, peer: _Peer, n: int, bound: int) -> None:
        """An oversized frame: say so, naming the bound, and close (the stream cannot resync).
        Its input is read and dropped for a moment first, so the answer is not lost in a
        reset."""
        when = ("before authentication" if not peer.authed and self._secret is not None
                else "of a request")
        message = (f"a frame of {n} B exceeds the {bound} B bound {when}; closing the "
                   "connection")
        self._warn("too_large", f"{peer!r}: {message}")
        peer.inbuf, peer.started = bytearray(), 0.0
        peer.drain_until = time.monotonic() + _DRAIN
        self._send(peer, frame(wire.ErrorReply(v=wire.WIRE_VERSION, code="too_large",
                                               message=message)))

    def _send(self, peer: _Peer, data: bytes) -> None:
        if not peer.out:
            peer.out_since = time.monotonic()
        peer.out += data
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        """Send what the kernel takes now; while answers wait, the peer's input waits too."""
        while peer.out:
            try:
                sent = peer.sock.send(peer.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.info("side channel %r ended: %s", peer, exc)
                self._drop(peer)
                return
            del peer.out[:sent]
        if peer.out:  # a refused peer's input is still read (and dropped) meanwhile
            self._want(peer, selectors.EVENT_WRITE | (selectors.EVENT_READ if peer.drain_until
                                                      else 0))
        else:
            peer.out = bytearray()
            if peer.drain_until:  # its answer is out: end our half, read until it ends its
                shutdown_write(peer.sock)
            self._want(peer, selectors.EVENT_READ)

    def _authenticated(self, peer: _Peer) -> None:
        if not peer.authed:
            peer.authed = True
            self._pending.pop(peer.ident, None)

    def _answer(self, peer: _Peer, body: bytes) -> wire._Msg | None:
        try:
            msg = wire.decode(body)
            if isinstance(msg, (wire.Hello, wire.Sealed, wire.Batch)):
                return self._session_frame(peer, msg)
            if self._secret is not None:
                if isinstance(msg, wire.Challenge):
                    return wire.Challenge(v=wire.WIRE_VERSION, nonce=self._nonces.issue())
                msg = self._verify(msg)
            elif isinstance(msg, wire.Signed):
                msg = wire.decode(msg.body)  # a peer with a secret talking to one without
            self._authenticated(peer)
        except WireError as exc:
            log.warning("side channel rejected a message: %s", exc)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="bad_message",
                                   message=str(exc)[:wire.MAX_TEXT_LEN])
        except AuthError as exc:
            log.warning("side channel refused a peer: %s", exc)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="auth",
                                   message=str(exc)[:wire.MAX_TEXT_LEN])
        return self._handle(msg)

    def _session_frame(self, peer: _Peer, msg: wire.Hello | wire.Sealed | wire.Batch
                       ) -> wire._Msg | None:
        """A session's frame (:mod:`kvlink.channel`, :func:`request`): open its session, or
        answer every call of its batch in one :class:`wire.Replies`."""
        if isinstance(msg, wire.Hello):
            if self._secret is None:  # nothing to agree on: any batch is taken as it is
                self._authenticated(peer)
                return wire.Welcome(v=wire.WIRE_VERSION, nonce=b"")
            if not 8 <= len(msg.nonce) <= 64:
                raise AuthError(f"a Hello nonce of {len(msg.nonce)} B (8-64 expected)")
            ours = secrets.token_bytes(16)
            peer.key, peer.counter = session_key(self._secret, msg.nonce, ours), 0
            return wire.Welcome(v=wire.WIRE_VERSION, nonce=ours)
        if isinstance(msg, wire.Sealed):
            if self._secret is not None:
                if peer.key is None:
                    raise AuthError("no session on this connection (the server restarted, or "
                                    "it was closed): say Hello again")
                if msg.counter <= peer.counter:
                    raise AuthError(f"frame counter {msg.counter} after {peer.counter}: "
                                    "replayed or reordered")
                if not hmac.compare_digest(msg.mac, seal_mac(peer.key, msg.counter, msg.body)):
                    raise AuthError("bad session MAC: the peers' secrets differ")
                peer.counter = msg.counter
                self._authenticated(peer)  # it holds the key
            batch = wire.decode(msg.body, wire.Batch)
        elif self._secret is not None:
            raise AuthError("an unsealed batch, and this side channel requires authentication")
        else:
            batch = msg
        self._authenticated(peer)
        answers = []
        for c in batch.calls:
            reply = self._handle(c.msg)
            if c.id:
                answers.append(wire.Answer(c.id, reply))
            elif isinstance(reply, wire.ErrorReply):  # nobody hears it: say it here
                log.info("side channel: an unanswered %s was refused (%s): %s",
                         type(c.msg).__name__, reply.code, reply.message)
        if batch.calls and not answers:
            return None  # only reports that want no answer: no frame back
        return wire.Replies(v=wire.WIRE_VERSION, answers=answers)

    def _handle(self, msg: object) -> wire.Reply:
        try:
            return self._handler(msg)
        except IncompatibleSpecError as exc:
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="incompatible",
                                   message=str(exc)[:wire.MAX_TEXT_LEN])
        except Exception as exc:  # the handler's bug must not kill the server thread
            log.exception("side channel handler failed on %s", type(msg).__name__)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="handler_error",
                                   message=f"{type(exc).__name__}: {exc}"[:wire.MAX_TEXT_LEN])

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
        """Stop serving: every connection and the port are closed when this returns (unless
        called from the handler, on the server's own thread: then right after it)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
            if self._thread.is_alive():
                log.warning("side channel %s: its handler did not return within 2 s of close",
                            self._name)


def shutdown_write(sock: socket.socket) -> None:
    """End our half of the stream (what was sent still arrives), keep reading."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


# ---------------------------------------------------------------------- one-shot calls
class _Call:
    """One blocking connection of :func:`request`: every wait in steps of at most 50 ms, so
    ``cancel`` is seen within that, and nothing past ``timeout``."""

    def __init__(self, host: str, port: int, what: str, timeout: float,
                 cancel: threading.Event | None) -> None:
        self.host, self.port, self.what = host, port, what
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.cancel = cancel
        self.why = ""  # the last connection attempt's failure
        self.sock: socket.socket | None = None

    def _left(self) -> float:
        if self.cancel is not None and self.cancel.is_set():
            raise PeerUnreachable(f"call to side channel {self.host}:{self.port} cancelled "
                                  f"(closing; {self.what} not answered)")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerUnreachable(
                f"no answer from side channel {self.host}:{self.port} within "
                f"{self.timeout:.1f}s (to {self.what}" + (f"; {self.why})" if self.why else ")"))
        return left

    def _pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := min(self._left(), end - time.monotonic())) > 0:
            if self.cancel is not None:
                self.cancel.wait(min(left, _STEP))
            else:
                time.sleep(left)

    def _ready(self, sock: socket.socket, event: int) -> bool:
        poller = select.poll()
        poller.register(sock, event)
        step = min(self._left(), _STEP) if self.cancel is not None else self._left()
        return bool(poller.poll(max(1, int(step * 1000 + 0.999))))

    def connect(self) -> socket.socket:
        """Connected, or PeerUnreachable at the deadline: a refused connection is tried again
        (a peer starting up binds a moment later), as ZMQ did."""
        try:
            info = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise PeerUnreachable(f"side channel {self.host}:{self.port}: {exc}") from exc
        family, kind, proto, _, addr = info[0]
        while True:
            self._left()
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            try:
                while err == errno.EINPROGRESS and not self._ready(sock, select.POLLOUT):
                    pass
            except BaseException:
                sock.close()
                raise
            if err == errno.EINPROGRESS:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                self.sock = sock
                return sock
            sock.close()
            self.why = f"connect: {os.strerror(err)}"
            self._pause(_RETRY)

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except (BlockingIOError, InterruptedError):
                self._ready(self.sock, select.POLLOUT)
            except OSError as exc:
                raise PeerUnreachable(f"side channel {self.host}:{self.port} closed the "
                                      f"connection ({exc}; {self.what} not answered)") from exc

    def _recv(self, n: int) -> bytes:
        assert self.sock is not None
        while True:
            try:
                got = self.sock.recv(n)
            except (BlockingIOError, InterruptedError):
                self._ready(self.sock, select.POLLIN)
                continue
            except OSError as exc:
                raise PeerUnreachable(f"side channel {self.host}:{self.port} closed the "
                                      f"connection ({exc}; {self.what} not answered)") from exc
            if not got:
                raise PeerUnreachable(f"side channel {self.host}:{self.port} closed the "
                                      f"connection ({self.what} not answered)")
            return got

    def reply(self) -> wire._Msg:
        """One answer frame, read as it arrives (never allocated at its announced length)."""
        buf = bytearray()
        while len(buf) < FRAME.size:
            buf += self._recv(FRAME.size - len(buf))
        (n,) = FRAME.unpack(buf)
        if n > wire.MAX_MESSAGE_BYTES:
            raise WireError(f"{self.host}:{self.port} announced an answer of {n} B (bound "
                            f"{wire.MAX_MESSAGE_BYTES} B)")
        body = bytearray()
        while len(body) < n:
            body += self._recv(min(n - len(body), _SCRATCH))
        return wire.decode(bytes(body))  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


_REQUESTS = typing.get_args(wire.Request)


def _raise_error(where: str, reply: wire._Msg) -> None:
    if isinstance(reply, wire.ErrorReply):
        cls: type[KVLinkError] = {"incompatible": IncompatibleSpecError,
                                  "auth": AuthError}.get(reply.code, SideChannelError)
        err = cls(f"{where} answered {reply.code}: {reply.message}")
        err.code = reply.code
        raise err


def request(host: str, port: int, msg: wire._Msg, timeout: float,
            secret: bytes | None = None, cancel: threading.Event | None = None) -> wire._Msg:
    """One request, one reply, within ``timeout`` seconds (PeerUnreachable otherwise).

    A fresh connection per call (so a call that timed out can never receive a stale reply
    meant for it later), closed after. With a secret, a session first: ``Hello`` ->
    ``Welcome``, then ``msg`` as the one call of one :class:`wire.Sealed` batch — two round
    trips, and ``msg`` may be as large as a kept-open session's frames (:data:`REQUEST_BYTES`).
    Only handshakes go this way, never the data path (:mod:`kvlink.channel`). ``cancel``: when
    set, the call gives up within 50 ms (a closing worker must not wait out a dead peer's
    timeout). An ``ErrorReply`` answer raises, with the peer's code in the exception's
    ``code``: AuthError (``auth``), IncompatibleSpecError (``incompatible``), else
    SideChannelError.
    """
    where = f"{host}:{port}"
    if secret is not None and not isinstance(msg, _REQUESTS):
        raise TypeError(f"{type(msg).__name__} is not a request (wire.Request)")
    call = _Call(host, port, type(msg).__name__, timeout, cancel)
    try:
        call.connect()
        if secret is None:
            call.send(frame(msg))
            reply = call.reply()
        else:
            nonce = secrets.token_bytes(16)
            call.send(frame(wire.Hello(v=wire.WIRE_VERSION, nonce=nonce)))
            welcome = call.reply()
            _raise_error(where, welcome)
            if not isinstance(welcome, wire.Welcome) or not welcome.nonce:
                raise AuthError(f"{where} did not open an authenticated session (does it have "
                                "a secret?)")
            key = session_key(secret, nonce, welcome.nonce)
            body = wire.encode(wire.Batch(v=wire.WIRE_VERSION, calls=[wire.Call(1, msg)]))  # type: ignore[arg-type]
            frames = [seal(key, 1, body)]
            if len(body) + 256 > PREAUTH_BYTES:  # prove the key first, in a frame it reads
                frames = [seal(key, 1, wire.Batch(v=wire.WIRE_VERSION, calls=[])),
                          seal(key, 2, body)]
            call.send(b"".join(frame(f) for f in frames))
            for _ in frames:
                reply = call.reply()
                _raise_error(where, reply)
            if not isinstance(reply, wire.Replies) or [a.id for a in reply.answers] != [1]:
                raise SideChannelError(f"{where} answered a {type(reply).__name__} to a "
                                       "session's call")
            reply = reply.answers[0].msg
    finally:
        call.close()
    _raise_error(where, reply)
    return reply


def _exchange(host: str, port: int, msg: wire._Msg, timeout: float,
              cancel: threading.Event | None = None) -> wire._Msg:
    """``msg`` as it is, on a fresh connection: one frame out, one back (no session)."""
    return request(host, port, msg, timeout, None, cancel)
