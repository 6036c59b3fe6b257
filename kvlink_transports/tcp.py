"""``tcp``: one-sided READ/WRITE emulated over ZeroMQ; works anywhere with only the core deps.

Each process runs one engine thread that owns every socket: a ROUTER serving peers' READs (reply
frames are zero-copy memoryviews of registered memory) and applying their WRITEs (received with
``recv_into`` straight into registered memory), plus one DEALER per connected peer for our own
transfers. Data travels as a stream of separate frames of about ``frame_bytes`` each, so the
receiver copies frame k while the kernel is still moving frame k+1. Both ends derive the framing
from the extent lengths alone. Every remote range is checked against registered memory before a
byte is read or written. Peer death is seen through ZMQ's socket monitor (in-flight transfers fail
at once) and, as a backstop, a per-transfer deadline.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvlink import hostmem
from kvlink.errors import ExtentOutOfBounds, TransportUnavailable, WireError
from kvlink.transport import (
    DONE,
    PENDING,
    Capabilities,
    Extents,
    Op,
    Region,
    RegionTable,
    Transport,
    TransportContext,
    XferState,
    XferStatus,
    check_pairs,
)
from kvlink.wire import extents_from_bytes, extents_to_bytes

log = logging.getLogger("kvlink.tcp")

_VERSION = 1
_ZERO_COPY_MIN = 64 << 10  # below this, copying into a zmq message beats zero-copy bookkeeping


class _Hdr(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    v: int
    op: str  # R read-req, W write-req, D data frame, A ack, E error, N notification
    handle: int = 0
    seq: int = 0
    agent: str = ""
    extents: bytes = b""
    notify: bytes | None = None
    reason: str = ""


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    endpoint: str
    regions: list[tuple[int, int, str]]


_hdr_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(_Hdr)
_desc_dec = msgspec.msgpack.Decoder(_Descriptor)


def _decode_hdr(buf: bytes) -> _Hdr:
    try:
        hdr = _hdr_dec.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad tcp frame header: {exc}") from exc
    if hdr.v != _VERSION:
        raise WireError(f"tcp frame version {hdr.v} unsupported (speaks {_VERSION})")
    return hdr


@dataclasses.dataclass
class _Xfer:
    handle: int
    op: Op
    peer: str
    local: Extents
    remote: Extents
    bounds: np.ndarray  # frame start indices + end
    notify: bytes | None
    deadline: float
    t_post: float
    nbytes: int
    next_frame: int = 0
    state: XferState = PENDING


@dataclasses.dataclass
class _Peer:
    name: str
    endpoint: str
    sock: zmq.Socket[bytes]
    mon: zmq.Socket[bytes]
    table: RegionTable
    inflight: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Inbound:
    """A peer's WRITE being applied to our memory."""

    extents: Extents
    bounds: np.ndarray
    notify: bytes | None
    agent: str
    next_frame: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)


class TcpTransport(Transport):
    name = "tcp"
    capabilities = Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}), memory_kinds=frozenset({"cpu"}),
        same_host_only=False, native_notifications=True,
    )

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        self.frame_bytes = int(self.options.get("frame_bytes", 1 << 20))
        self.timeout = float(self.options.get("timeout_s", 30.0))
        self._zctx = zmq.Context(io_threads=int(self.options.get("io_threads", 1)))
        self._server = self._zctx.socket(zmq.ROUTER)
        for s in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            self._server.setsockopt(s, 0)
        self._server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = int(self.options.get("port", 0))
        try:
            if port:
                self._server.bind(f"tcp://{ctx.host}:{port}")
            else:
                port = self._server.bind_to_random_port(f"tcp://{ctx.host}")
        except zmq.ZMQError as exc:
            self._server.close()
            self._zctx.term()
            raise TransportUnavailable(f"tcp transport cannot bind {ctx.host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{ctx.advertise_host or ctx.host}:{port}"
        self._wake_addr = f"inproc://kvlink-tcp-wake-{id(self)}"
        self._wake_pull = self._zctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_push = self._zctx.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_addr)
        self._cmd_lock = threading.Lock()
        self._cmds: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()
        self._xfers: dict[int, _Xfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbound: dict[tuple[bytes, int], _Inbound] = {}
        self._rejected: collections.deque[tuple[bytes, int]] = collections.deque(maxlen=4096)
        self._notifs: collections.deque[tuple[str, bytes]] = collections.deque()
        self._handles = itertools.count(1)
        self._table = RegionTable(())
        self._regions: tuple[Region, ...] = ()
        self._staging = bytearray(0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvlink-tcp", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ contract
    def register(self, regions: Sequence[Region]) -> None:
        bad = [r.device for r in regions if r.memory_kind != "cpu"]
        if bad:
            raise TransportUnavailable(f"tcp moves host memory only; got device {bad[0]!r} "
                                       "(use host staging, kv_buffer_device='cpu')")
        self._regions = tuple(self._regions) + tuple(regions)
        self._table = RegionTable(self._regions)

    def descriptor(self) -> bytes:
        return msgspec.msgpack.encode(_Descriptor(
            v=_VERSION, agent=self.ctx.agent_name, endpoint=self.endpoint,
            regions=[(r.addr, r.nbytes, r.device) for r in self._regions],
        ))

    def connect(self, peer: str, descriptor: bytes) -> None:
        try:
            desc = _desc_dec.decode(descriptor)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"bad tcp descriptor from {peer}: {exc}") from exc
        if desc.v != _VERSION:
            raise WireError(f"tcp descriptor version {desc.v} from {peer} unsupported")
        table = RegionTable([Region(a, n, d) for a, n, d in desc.regions])
        self._submit(("connect", peer, desc.endpoint, table))

    def disconnect(self, peer: str) -> None:
        self._submit(("disconnect", peer))

    def post(self, op: Op, peer: str, local: Extents, remote: Extents,
             notify: bytes | None = None) -> int:
        t0 = time.perf_counter()
        check_pairs(local, remote)
        self._table.locate(local, "local extent")
        handle = next(self._handles)
        xfer = _Xfer(
            handle=handle, op=op, peer=peer, local=np.ascontiguousarray(local),
            remote=np.ascontiguousarray(remote),
            bounds=hostmem.frame_bounds(local["len"], self.frame_bytes, _ZERO_COPY_MIN), notify=notify,
            deadline=time.monotonic() + self.timeout, t_post=time.perf_counter(),
            nbytes=int(local["len"].sum()),
        )
        with self._lock:
            self._xfers[handle] = xfer
        self._submit(("post", handle))
        self._account(post_seconds=time.perf_counter() - t0, descriptors=int(local.shape[0]))
        return handle

    def poll(self, handle: int) -> XferState:
        xfer = self._xfers.get(handle)
        if xfer is None:
            return XferState(XferStatus.FAILED, f"unknown or released handle {handle}")
        return xfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            self._xfers.pop(handle, None)

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def notify(self, peer: str, message: bytes) -> None:
        self._submit(("notify", peer, message))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._submit(("close",))
        self._thread.join(timeout=5)
        with self._cmd_lock:
            self._wake_push.close(linger=0)
        self._zctx.term()

    def inflight(self) -> int:
        return len(self._xfers)

    # ------------------------------------------------------------------ engine thread
    def _submit(self, cmd: tuple[Any, ...]) -> None:
        with self._cmd_lock:
            if self._wake_push.closed:
                raise TransportUnavailable("tcp transport is closed")
            self._cmds.append(cmd)
            self._wake_push.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        running = True
        while running:
            events = dict(poller.poll(100))
            if self._wake_pull in events:
                while True:
                    try:
                        self._wake_pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                while self._cmds and running:
                    cmd = self._cmds.popleft()
                    try:
                        running = self._command(cmd, poller)
                    except Exception as exc:
                        log.exception("tcp: command %s failed", cmd[0])
                        if cmd[0] == "post":
                            self._finish(cmd[1], XferState(XferStatus.FAILED, f"post failed: {exc}"))
            if self._server in events:
                self._drain(self._server, self._serve_one)
            for peer in list(self._peers.values()):
                if peer.sock in events:
                    self._drain(peer.sock, lambda s, p=peer: self._client_one(p))
                if peer.mon in events:
                    self._monitor(peer)
            self._expire()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "transport closed", poller)
        self._server.close(linger=0)
        self._wake_pull.close(linger=0)

    def _drain(self, sock: zmq.Socket[bytes], one: Any, budget: int = 256) -> None:
        """Handle queued messages, bounded so one busy socket cannot starve the others."""
        for _ in range(budget):
            if not sock.poll(0, zmq.POLLIN):
                return
            try:
                one(sock)
            except Exception as exc:  # a bad peer or a bug must not stop the engine thread
                log.warning("tcp: dropped a message: %s: %s", type(exc).__name__, exc)
                self._skip_rest(sock)

    def _command(self, cmd: tuple[Any, ...], poller: zmq.Poller) -> bool:
        kind = cmd[0]
        if kind == "close":
            return False
        if kind == "connect":
            _, name, ep, table = cmd
            old = self._peers.get(name)
            if old is not None:
                self._drop_peer(old, f"peer {name} reconnected", poller)
            sock = self._zctx.socket(zmq.DEALER)
            for s in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
                sock.setsockopt(s, 0)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(ep)
            self._peers[name] = _Peer(name, ep, sock, mon, table)
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        elif kind == "disconnect":
            peer = self._peers.get(cmd[1])
            if peer is not None:
                self._drop_peer(peer, f"peer {cmd[1]} disconnected by caller", poller)
        elif kind == "notify":
            peer = self._peers.get(cmd[1])
            if peer is None:
                log.warning("notification to unknown peer %s dropped", cmd[1])
            else:
                self._send(peer.sock, [_Hdr(_VERSION, "N", agent=self.ctx.agent_name,
                                            notify=cmd[2])])
        elif kind == "post":
            self._start(cmd[1])
        return True

    def _send(self, sock: zmq.Socket[bytes], parts: list[Any]) -> None:
        frames = [_hdr_enc.encode(p) if isinstance(p, _Hdr) else p for p in parts]
        sock.send_multipart(frames, copy=False)

    def _drop_peer(self, peer: _Peer, reason: str, poller: zmq.Poller) -> None:
        self._fail_peer(peer, reason)
        for s in (peer.sock, peer.mon):
            poller.unregister(s)
        peer.sock.disable_monitor()
        peer.mon.close(linger=0)
        peer.sock.close(linger=0)
        self._peers.pop(peer.name, None)

    def _fail_peer(self, peer: _Peer, reason: str) -> None:
        for h in list(peer.inflight):
            self._finish(h, XferState(XferStatus.FAILED, reason))

    def _monitor(self, peer: _Peer) -> None:
        while peer.mon.poll(0):
            evt = recv_monitor_message(peer.mon)
            if evt["event"] == zmq.EVENT_DISCONNECTED and peer.inflight:
                log.warning("tcp: peer %s (%s) disconnected; failing %d in-flight transfer(s)",
                            peer.name, peer.endpoint, len(peer.inflight))
                self._fail_peer(peer, f"peer {peer.name} ({peer.endpoint}) disconnected")

    def _expire(self) -> None:
        now = time.monotonic()
        for peer in self._peers.values():
            for h in list(peer.inflight):
                xfer = self._xfers.get(h)
                if xfer is not None and now > xfer.deadline:
                    self._finish(h, XferState(
                        XferStatus.FAILED,
                        f"no answer from peer {peer.name} ({peer.endpoint}) in {self.timeout:.1f}s"))
        stale = [k for k, w in self._inbound.items() if now - w.started > self.timeout]
        for key in stale:
            w = self._inbound.pop(key)
            log.warning("tcp: WRITE from %s abandoned after %d/%d frames", w.agent, w.next_frame,
                        len(w.bounds) - 1)

    def _finish(self, handle: int, state: XferState) -> None:
        xfer = self._xfers.get(handle)
        peer = self._peers.get(xfer.peer) if xfer else None
        if peer is not None:
            peer.inflight.discard(handle)
        if xfer is None or xfer.state.status is not XferStatus.PENDING:
            return
        if state.status is XferStatus.DONE:
            self._account(transfers=1, bytes=xfer.nbytes,
                          xfer_seconds=time.perf_counter() - xfer.t_post)
            if xfer.op is Op.READ and xfer.notify is not None and peer is not None:
                self._send(peer.sock, [_Hdr(_VERSION, "N", agent=self.ctx.agent_name,
                                            notify=xfer.notify)])
        else:
            self._account(failed=1)
        xfer.state = state

    # -- client side: our transfers
    def _start(self, handle: int) -> None:
        xfer = self._xfers.get(handle)
        if xfer is None:
            return
        peer = self._peers.get(xfer.peer)
        if peer is None:
            self._finish(handle, XferState(XferStatus.FAILED, f"peer {xfer.peer} not connected"))
            return
        try:
            peer.table.locate(xfer.remote, "remote extent")
        except ExtentOutOfBounds as exc:
            self._finish(handle, XferState(XferStatus.FAILED, str(exc)))
            return
        peer.inflight.add(handle)
        ext = extents_to_bytes(xfer.remote)
        if xfer.op is Op.READ:
            self._send(peer.sock, [_Hdr(_VERSION, "R", handle, agent=self.ctx.agent_name,
                                        extents=ext)])
            if xfer.nbytes == 0:
                self._finish(handle, DONE)
            return
        self._send(peer.sock, [_Hdr(_VERSION, "W", handle, agent=self.ctx.agent_name,
                                    extents=ext, notify=xfer.notify)])
        for k, part in enumerate(self._frames_of(xfer.local, xfer.bounds)):
            self._send(peer.sock, [_Hdr(_VERSION, "D", handle, k), part])

    def _client_one(self, peer: _Peer) -> None:
        sock = peer.sock
        try:
            hdr = _decode_hdr(sock.recv())
        except WireError as exc:
            log.warning("tcp: bad frame from %s: %s", peer.name, exc)
            self._skip_rest(sock)
            return
        xfer = self._xfers.get(hdr.handle)
        live = xfer is not None and xfer.state.status is XferStatus.PENDING
        if hdr.op == "D":
            if not live or xfer is None or hdr.seq != xfer.next_frame:
                self._skip_rest(sock)
                if live:
                    self._finish(hdr.handle, XferState(XferStatus.FAILED, "frame out of order"))
                return
            self._recv_frame(sock, xfer.local, xfer.bounds, hdr.seq)
            xfer.next_frame += 1
            if xfer.next_frame == len(xfer.bounds) - 1:
                self._finish(hdr.handle, DONE)
        elif hdr.op == "A" and live:
            self._finish(hdr.handle, DONE)
        elif hdr.op == "E" and live:
            self._finish(hdr.handle, XferState(XferStatus.FAILED,
                                               f"peer {peer.name} refused: {hdr.reason}"))
        self._skip_rest(sock)

    # -- server side: peers' transfers against our memory
    def _serve_one(self, sock: zmq.Socket[bytes]) -> None:
        ident = sock.recv()
        if not sock.getsockopt(zmq.RCVMORE):
            return
        try:
            hdr = _decode_hdr(sock.recv())
        except WireError as exc:
            log.warning("tcp: rejected a frame: %s", exc)
            self._skip_rest(sock)
            return
        if hdr.op == "R":
            self._serve_read(ident, hdr)
        elif hdr.op == "W":
            self._begin_write(ident, hdr)
        elif hdr.op == "D":
            self._apply_write_frame(ident, hdr, sock)
        elif hdr.op == "N" and hdr.notify is not None:
            self._notifs.append((hdr.agent, hdr.notify))
        self._skip_rest(sock)

    def _checked(self, hdr: _Hdr) -> Extents:
        ext = extents_from_bytes(hdr.extents)
        self._table.locate(ext, "requested extent")
        return ext

    def _serve_read(self, ident: bytes, hdr: _Hdr) -> None:
        try:
            ext = self._checked(hdr)
        except (WireError, ExtentOutOfBounds) as exc:
            log.warning("tcp: refused READ from %s: %s", hdr.agent, exc)
            self._send(self._server, [ident, _Hdr(_VERSION, "E", hdr.handle, reason=str(exc))])
            return
        bounds = hostmem.frame_bounds(ext["len"], self.frame_bytes, _ZERO_COPY_MIN)
        for k, part in enumerate(self._frames_of(ext, bounds)):
            self._send(self._server, [ident, _Hdr(_VERSION, "D", hdr.handle, k), part])

    def _begin_write(self, ident: bytes, hdr: _Hdr) -> None:
        try:
            ext = self._checked(hdr)
        except (WireError, ExtentOutOfBounds) as exc:
            log.warning("tcp: refused WRITE from %s: %s", hdr.agent, exc)
            self._rejected.append((ident, hdr.handle))
            self._send(self._server, [ident, _Hdr(_VERSION, "E", hdr.handle, reason=str(exc))])
            return
        bounds = hostmem.frame_bounds(ext["len"], self.frame_bytes, _ZERO_COPY_MIN)
        w = _Inbound(ext.copy(), bounds, hdr.notify, hdr.agent)
        if len(bounds) == 1:
            self._end_write(ident, hdr.handle, w)
        else:
            self._inbound[(ident, hdr.handle)] = w

    def _apply_write_frame(self, ident: bytes, hdr: _Hdr, sock: zmq.Socket[bytes]) -> None:
        w = self._inbound.get((ident, hdr.handle))
        if w is None or hdr.seq != w.next_frame:
            if w is not None:
                self._inbound.pop((ident, hdr.handle))
                self._send(self._server, [ident, _Hdr(_VERSION, "E", hdr.handle,
                                                      reason="frame out of order")])
            return
        self._recv_frame(sock, w.extents, w.bounds, hdr.seq)
        w.next_frame += 1
        if w.next_frame == len(w.bounds) - 1:
            self._end_write(ident, hdr.handle, self._inbound.pop((ident, hdr.handle)))

    def _end_write(self, ident: bytes, handle: int, w: _Inbound) -> None:
        if w.notify is not None:
            self._notifs.append((w.agent, w.notify))
        self._send(self._server, [ident, _Hdr(_VERSION, "A", handle)])

    # -- framing helpers
    def _frames_of(self, ext: Extents, bounds: np.ndarray) -> list[Any]:
        """Outgoing data frames: zero-copy views for big single extents, gathered otherwise."""
        out: list[Any] = []
        starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
        for a, b in zip(starts, ends):
            if b - a == 1 and int(ext["len"][a]) >= _ZERO_COPY_MIN:
                out.append(zmq.Frame(hostmem.view(int(ext["addr"][a]), int(ext["len"][a])),
                                     copy=False))
            else:
                part = ext[a:b]
                buf = bytearray(int(part["len"].sum()))
                hostmem.gather(part, hostmem.address_of(buf))
                out.append(buf)
        return out

    def _recv_frame(self, sock: zmq.Socket[bytes], ext: Extents, bounds: np.ndarray,
                    k: int) -> None:
        a, b = int(bounds[k]), int(bounds[k + 1])
        part = ext[a:b]
        size = int(part["len"].sum())
        if b - a == 1:
            got = sock.recv_into(hostmem.view(int(part["addr"][0]), size))
        else:
            if len(self._staging) < size:
                self._staging = bytearray(size)
            got = sock.recv_into(self._staging, nbytes=size)
            hostmem.scatter(hostmem.address_of(self._staging), part)
        if got != size:
            raise WireError(f"data frame {k} carried {got} B, expected {size} B")

    @staticmethod
    def _skip_rest(sock: zmq.Socket[bytes]) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
