"""ZMQ side channel: handshakes and notifications, with a deadline on every call.

Each producer (and, in push mode, each consumer) runs one :class:`SideChannelServer` thread: a
ROUTER socket answering one request with one reply. Clients open a fresh DEALER per call, so a
call that timed out can never receive a stale reply meant for it later.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable

import zmq

from kvlink import wire
from kvlink.errors import IncompatibleSpecError, PeerUnreachable, SideChannelError, WireError

log = logging.getLogger("kvlink.sidechannel")

Handler = Callable[[object], "wire._Msg"]


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers requests on ``host:port`` with ``handler(msg)`` from a daemon thread.

    ``port=0`` binds an ephemeral port (see :attr:`port`). Handler exceptions become
    ErrorReply answers; the server itself never dies on a bad message.
    """

    def __init__(self, host: str, port: int, handler: Handler, name: str = "kvlink-side") -> None:
        self._handler = handler
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
        if not is_loopback(host):
            log.warning("side channel bound on non-loopback %s:%d; peers that reach it can read "
                        "registered memory — restrict the network or configure a secret",
                        host, self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
            reply = self._answer(body)
            try:
                self._sock.send_multipart([ident, b"", wire.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.info("side channel reply dropped: %s", exc)
        self._sock.close(linger=0)

    def _answer(self, body: bytes) -> wire._Msg:
        try:
            msg = wire.decode(body)
        except WireError as exc:
            log.warning("side channel rejected a message: %s", exc)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="bad_message", message=str(exc))
        try:
            return self._handler(msg)
        except IncompatibleSpecError as exc:
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="incompatible", message=str(exc))
        except Exception as exc:  # the handler's bug must not kill the server thread
            log.exception("side channel handler failed on %s", type(msg).__name__)
            return wire.ErrorReply(v=wire.WIRE_VERSION, code="handler_error",
                                   message=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


def request(host: str, port: int, msg: wire._Msg, timeout: float) -> wire._Msg:
    """One request, one reply, within ``timeout`` seconds (PeerUnreachable otherwise)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    try:
        sock.connect(endpoint(host, port))
        sock.send_multipart([b"", wire.encode(msg)])
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise PeerUnreachable(
                f"no answer from side channel {host}:{port} within {timeout:.1f}s "
                f"(to {type(msg).__name__})"
            )
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    reply: wire._Msg = wire.decode(frames[-1])
    if isinstance(reply, wire.ErrorReply):
        cls = IncompatibleSpecError if reply.code == "incompatible" else SideChannelError
        raise cls(f"{host}:{port} answered {reply.code}: {reply.message}")
    return reply
