"""The side channel's server: :class:`SideChannelServer`, one thread running a ``selectors``
loop over one listening port and every connection, plus :meth:`~SideChannelServer.serve_ready`
for a caller that serves its own inbox from its poll. It enforces the bounds, deadlines,
connection caps and eviction that :mod:`kvlink.sidechannel` specifies."""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kvlink import wire
from kvlink.errors import (
    AuthError,
    ConfigError,
    IncompatibleSpecError,
    SideChannelError,
    WireError,
)
from kvlink.sidechannel.auth import (
    _mac,
    _Nonces,
    answer_key,
    is_loopback,
    seal,
    seal_mac,
    session_key,
)
from kvlink.sidechannel.framing import (
    _SCRATCH,
    FRAME,
    PREAUTH_BYTES,
    REQUEST_BYTES,
    frame,
    shutdown_write,
)
from kvlink.sockets import keepalive

log = logging.getLogger("kvlink.sidechannel")

MAX_CONNECTIONS = 1024  # connections one server holds at most
MAX_PENDING = 64  # of them, not yet authenticated
AUTH_TIMEOUT = 10.0  # s from accept to authenticated
FRAME_TIMEOUT = 10.0  # s from a frame's first byte to its last
#: s a kept-open session may be idle before the kernel probes its peer (kvlink.sockets): a
#: peer host that vanished without closing kept its session — and one of max_connections, which
#: authenticated sessions are never evicted from — for good
KEEPALIVE_S = 60.0
_DRAIN = 1.0  # s a refused connection is read (and dropped) after its error reply, then closed
_SWEEP = 0.1  # s between deadline checks
Handler = Callable[[object], "wire.Reply"]


class _Peer:
    """One accepted connection: its partial input, unsent output, deadlines and session."""

    __slots__ = ("answer_key", "answered", "authed", "closed", "counter", "drain_until",
                 "events", "ident", "inbuf", "key", "opened", "out", "out_since", "sock",
                 "started", "where")

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
        self.answer_key = b""  # what our answers are sealed with (auth.answer_key)
        self.answered = 0  # the last sealed answer's frame number (our side of the session)
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
    are the package's bounds (see :mod:`kvlink.sidechannel`); tests shorten them.
    """

    def __init__(self, host: str, port: int, handler: Handler, name: str = "kvlink-side",
                 secret: bytes | None = None, allow_insecure: bool = False, *,
                 max_connections: int = MAX_CONNECTIONS, max_pending: int = MAX_PENDING,
                 auth_timeout: float = AUTH_TIMEOUT, frame_timeout: float = FRAME_TIMEOUT,
                 preauth_bytes: int = PREAUTH_BYTES, request_bytes: int = REQUEST_BYTES,
                 keepalive_s: float = KEEPALIVE_S) -> None:
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
        self._keepalive = keepalive_s
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
            keepalive(sock, self._keepalive)
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
        """Close connections past a deadline (see :mod:`kvlink.sidechannel`)."""
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
        except WireError as exc:  # (a peer may send these as fast as it likes: throttled)
            self._warn("bad_message", f"side channel rejected a message from {peer!r}: {exc}")
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="bad_message",
                                   message=str(exc)[:wire.MAX_TEXT_LEN])
        except AuthError as exc:
            self._warn("auth", f"side channel refused {peer!r}: {exc}")
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
            peer.answer_key, peer.answered = answer_key(peer.key), 0
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
        replies = wire.Replies(v=wire.WIRE_VERSION, answers=answers)
        if peer.key is None:
            return replies
        # sealed too: the client takes no answer that whoever holds its address made up
        # (a process bound there after ours, a forger on the path) without the secret
        peer.answered += 1
        return seal(peer.answer_key, peer.answered, replies)

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
