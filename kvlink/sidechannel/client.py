"""The side channel's one-shot call: :func:`request` connects, exchanges one message (under a
session when there is a secret) and closes, every wait bounded by its deadline and its cancel
event. Handshakes go this way; the data path uses :mod:`kvlink.channel`."""

from __future__ import annotations

import errno
import os
import secrets
import select
import socket
import threading
import time
import typing

from kvlink import wire
from kvlink.errors import (
    AuthError,
    IncompatibleSpecError,
    KVLinkError,
    PeerUnreachable,
    SideChannelError,
    WireError,
)
from kvlink.sidechannel.auth import answer_key, seal, session_key, unseal_answers
from kvlink.sidechannel.framing import _SCRATCH, FRAME, PREAUTH_BYTES, frame

_STEP = 0.05  # s: request() looks at its cancel event at least this often
_RETRY = 0.05  # s between request()'s connection attempts to a port nobody listens on


class _Call:
    """One blocking connection of :func:`request`: every wait in steps of at most 50 ms, so
    ``cancel`` is seen within that, and nothing past ``timeout``."""

    def __init__(self, host: str, port: int, what: str, timeout: float,
                 cancel: threading.Event | None, live_only: bool = False) -> None:
        self.host, self.port, self.what = host, port, what
        self.live_only = live_only
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
        (a peer starting up binds a moment later), as ZMQ did — unless ``live_only``: the
        caller knows a process was serving there (see :func:`request`)."""
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
            if self.live_only and err == errno.ECONNREFUSED:
                raise PeerUnreachable(
                    f"side channel {self.host}:{self.port}: nobody listens there (connection "
                    f"refused; {self.what} not sent): the process that served there is gone")
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
            secret: bytes | None = None, cancel: threading.Event | None = None,
            live_only: bool = False) -> wire._Msg:
    """One request, one reply, within ``timeout`` seconds (PeerUnreachable otherwise).

    A fresh connection per call (so a call that timed out can never receive a stale reply
    meant for it later), closed after. With a secret, a session first: ``Hello`` ->
    ``Welcome``, then ``msg`` as the one call of one :class:`wire.Sealed` batch — two round
    trips, and ``msg`` may be as large as a kept-open session's frames (:data:`REQUEST_BYTES`).
    Only handshakes go this way, never the data path (:mod:`kvlink.channel`). ``cancel``: when
    set, the call gives up within 50 ms (a closing worker must not wait out a dead peer's
    timeout). An ``ErrorReply`` answer raises, with the peer's code in the exception's
    ``code``: AuthError (``auth``), IncompatibleSpecError (``incompatible``), else
    SideChannelError. ``live_only``: the caller knows a process served at ``host:port`` (it
    handed out what the caller asks about), so a refused connection fails at once: that
    process is gone, and whoever starts there next never held it.
    """
    where = f"{host}:{port}"
    if secret is not None and not isinstance(msg, _REQUESTS):
        raise TypeError(f"{type(msg).__name__} is not a request (wire.Request)")
    call = _Call(host, port, type(msg).__name__, timeout, cancel, live_only)
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
            answers, last = answer_key(key), 0
            for _ in frames:
                got = call.reply()
                _raise_error(where, got)  # (unsealed: it can only fail the call)
                if not isinstance(got, wire.Sealed):
                    raise AuthError(f"{where} answered a session's call unsealed: it does "
                                    "not hold our secret (or is older than wire version 7)")
                reply = unseal_answers(answers, last, got, where)
                last = got.counter
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
