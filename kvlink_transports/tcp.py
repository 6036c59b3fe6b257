"""``tcp``: one-sided READ/WRITE emulated over plain TCP; works anywhere with only the core deps.

Each process runs a listener; for every accepted connection a server thread serves the peer's
READs straight out of registered memory (``sendmsg`` over memoryviews: the kernel gathers, no
user-space copy) and applies its WRITEs straight into registered memory (``recvmsg_into``: the
kernel scatters). On the client side each peer gets one connection and one thread that runs that
peer's transfers in order; many transfers may be posted at once.

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

Bounds, because anyone on the network can open the port before the key is checked:

- Not-yet-authenticated connections take no thread: the accept thread reads their hello
  (the first header) non-blocking, at most ``_MAX_HELLO`` bytes — the length prefix is checked
  before anything is allocated — within ``hello_timeout_s`` (5 s) of the accept. Beyond
  ``max_unauthenticated`` (64) pending hellos the oldest is dropped, so a flood of idle
  connections cannot lock a legitimate peer out; beyond ``max_connections`` (1024) in all a new
  connection is closed at once. Only a hello with the right key gets a serving thread.
- After authentication an idle connection may stay open (a kept-open peer), but a header once
  started must arrive whole within ``timeout_s``; it may announce at most ``_MAX_HEADER`` bytes
  (checked before allocating; a header over ``_GROW`` is buffered as its bytes arrive, not at
  its announced size) and ``_MAX_EXTENTS`` extents (a longer transfer is sent as several
  requests). A request's memoryviews are made ``_IOV`` at a time as its bytes move, so its
  Python objects are O(batch), not O(extents) (one per extent cost ~1.1 GB for 4M extents).

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

import collections
import dataclasses
import errno
import hmac
import itertools
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from kvlink import hostmem, staging
from kvlink.errors import (
    ExtentOutOfBounds,
    KVLinkError,
    TransferError,
    TransportUnavailable,
    WireError,
)
from kvlink.grants import Grants
from kvlink.options import check_options
from kvlink.sockets import shutdown
from kvlink.transport import (
    DONE,
    EXTENT_DTYPE,
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
from kvlink.wire import decode_versioned, extents_from_bytes, extents_to_bytes

log = logging.getLogger("kvlink.tcp")

_VERSION = 2  # 2: R/W headers carry the grant's ticket
_LEN = struct.Struct("<I")
_MAX_HELLO = 4 << 10  # the first header of a connection, read before its memory key is checked
_MAX_EXTENTS = 1 << 20  # extents per R/W request; a longer transfer goes as several requests
_MAX_HEADER = _MAX_EXTENTS * EXTENT_DTYPE.itemsize + (1 << 20)  # one header, once authenticated
_MAX_REPLY = 64 << 10  # an A/E answer, on the initiator's side
_MAX_REASON = 1024  # characters of a refusal's reason sent back
_GROW = 1 << 20  # a longer header is buffered as its bytes arrive, not at its announced size
_IOV = 512  # buffers per sendmsg/recvmsg call (IOV_MAX is 1024 on Linux)
_CHECK = 1 << 16  # extents per numpy pass of a check: its temporaries are O(this), not O(request)
_CLOSE_WAIT = 2.0  # seconds close() waits, in all, for the transport's threads to end
_ACCEPT_PAUSE = 0.1  # seconds the accept thread stops accepting when out of descriptors
# seconds revoke() lets a request under the ticket stop on its own before its connection is
# shut down. Not shorter: a thread whose last sendall just handed the bytes to the kernel may
# be descheduled that long on a loaded machine (50 ms cut live connections on 2 busy cores,
# failing the *next* READ on them); what the grace bounds is a hung peer's socket, not
# correctness (a READ the hold ended under is refused at its verdict anyway)
_CUT_GRACE = 1.0


class _Hdr(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    v: int
    op: str  # R read, W write, N notification; replies: A ok, E error
    agent: str = ""
    # decoded as a view into the received header: up to 16 MiB of extents are not copied
    extents: memoryview = memoryview(b"")
    notify: bytes | None = None
    reason: str = ""
    token: bytes = b""
    ticket: bytes = b""  # R/W: the grant the transfer runs under (contract rule 8)


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    host: str
    port: int
    regions: list[tuple[int, int, str]]
    token: bytes  # memory key: only peers that passed the handshake learn it


_enc = msgspec.msgpack.Encoder()
_hdr_dec = msgspec.msgpack.Decoder(_Hdr)


class _PeerGone(Exception):
    """The connection broke or answered garbage: everything queued for the peer fails."""


# ---------------------------------------------------------------------------- framing


def _send_hdr(sock: socket.socket, hdr: _Hdr) -> None:
    body = _enc.encode(hdr)
    sock.sendall(_LEN.pack(len(body)) + body)


def _until(sock: socket.socket, deadline: float | None) -> None:
    """Make the next socket call wait at most until ``deadline`` (None: the socket's own)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("header not complete in time")
        sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes. Over ``_GROW`` they are buffered as they arrive: a peer announcing more
    than it sends costs what it sent, not what it announced."""
    if n > _GROW:
        buf, scratch = bytearray(), memoryview(bytearray(_GROW))
        while len(buf) < n:
            _until(sock, deadline)
            k = sock.recv_into(scratch, min(n - len(buf), _GROW))
            if k == 0:
                raise _PeerGone("connection closed by peer")
            buf += scratch[:k]
        return buf
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _until(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise _PeerGone("connection closed by peer")
        got += k
    return buf


def _decode_hdr(body: bytes | bytearray) -> _Hdr:
    try:
        hdr = _hdr_dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad tcp header: {exc}") from exc
    if hdr.v != _VERSION:
        raise WireError(f"tcp header version {hdr.v} unsupported (speaks {_VERSION})")
    return hdr


def _recv_hdr(sock: socket.socket, limit: int = _MAX_REPLY) -> _Hdr:
    """One header (the initiator's side: an owner's answer)."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > limit:
        raise WireError(f"tcp header of {n} B exceeds {limit} B")
    return _decode_hdr(_recv_exact(sock, n))


class _Memory:
    """Registered regions as memoryviews, so an extent becomes a slice (no per-extent ctypes)."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.table = RegionTable(regions)
        self.views = [hostmem.view(r.addr, r.nbytes) for r in self.table.regions]

    def batches(self, ext: Extents, what: str) -> Iterator[list[memoryview]]:
        """Bounds-check all of ``ext`` now (raising before any byte moves), then give its
        slices ``_IOV`` at a time as they are consumed: O(batch) Python objects and O(_CHECK)
        numpy temporaries, not one memoryview per extent for the whole request."""
        for k in range(0, ext.shape[0], _CHECK):
            self.table.locate(ext[k : k + _CHECK], what if not k else f"{what} {k}+")
        return self._batches(ext)

    def _batches(self, ext: Extents) -> Iterator[list[memoryview]]:
        starts, views = self.table.starts, self.views
        for k in range(0, ext.shape[0], _CHECK):
            chunk = ext[k : k + _CHECK]
            idx = self.table.locate(chunk)
            for j in range(0, chunk.shape[0], _IOV):
                part, at = chunk[j : j + _IOV], idx[j : j + _IOV]
                off = (part["addr"] - starts[at]).tolist()
                yield [views[i][o : o + n]
                       for i, o, n in zip(at.tolist(), off, part["len"].tolist())]


def _send_views(
    sock: socket.socket, batches: Iterable[list[memoryview]],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Send ``batches``; ``stop`` (checked before every socket call) ends it early."""
    for batch in batches:
        while batch:
            if stop is not None and stop():
                raise _PeerGone("access revoked mid-transfer")
            sent = sock.sendmsg(batch)
            while batch and sent >= len(batch[0]):
                sent -= len(batch[0])
                batch.pop(0)
            if batch and sent:
                batch[0] = batch[0][sent:]


def _recv_views(
    sock: socket.socket, batches: Iterable[list[memoryview]],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Receive straight into ``batches``; ``stop`` (checked before every socket call) ends it
    early, so a revoked connection writes no more of our memory than one call's worth."""
    for batch in batches:
        while batch:
            if stop is not None and stop():
                raise _PeerGone("access revoked mid-transfer")
            got = sock.recvmsg_into(batch)[0] if len(batch) > 1 else sock.recv_into(batch[0])
            if got == 0:
                raise _PeerGone("connection closed by peer mid-transfer")
            while batch and got >= len(batch[0]):
                got -= len(batch[0])
                batch.pop(0)
            if batch and got:
                batch[0] = batch[0][got:]


class _Throttle:
    """At most one log line per ``every`` seconds per kind; those in between are counted and
    reported with the next one (a flood of hostile connections must not flood the log)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def __call__(self, level: int, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            if len(self._next) > 4096:  # kinds name agents: bounded too
                self._next.clear()
                self._skipped.clear()
            self._next[kind] = now + self.every
            skipped = self._skipped.pop(kind, 0)
        if skipped:
            msg += f" (and {skipped} more like it in the last {self.every:.0f}s)"
        log.log(level, msg, *args)


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:.1f}s"
    if isinstance(exc, OSError):
        return f"connection lost ({exc.strerror or exc})"
    return str(exc)




def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)


# ---------------------------------------------------------------------------- client side


@dataclasses.dataclass
class _Xfer:
    op: Op
    local: Extents
    remote: Extents
    notify: bytes | None
    nbytes: int
    t_post: float
    state: XferState = PENDING
    # staged device memory: the caller's current stream at post (staging.Copier.mark), waited
    # on by the staging stream before this transfer's first gather or scatter
    mark: Any = None
    ticket: bytes = b""  # the grant its owner checks (contract rule 8)


class _Peer:
    """One connection to a peer and the thread that runs its transfers in order."""

    def __init__(self, owner: TcpTransport, name: str, desc: _Descriptor) -> None:
        self.owner, self.name, self.desc = owner, name, desc
        self.remote_table = RegionTable([Region(a, n, d) for a, n, d in desc.regions])
        self.queue: collections.deque[tuple[int, _Xfer] | tuple[None, bytes]] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvlink-tcp-{name}", daemon=True)
        self.thread.start()

    def submit(self, item: tuple[int, _Xfer] | tuple[None, bytes]) -> None:
        with self.cv:
            if self.closed:
                raise TransportUnavailable(f"peer {self.name} is disconnected")
            self.queue.append(item)
            self.cv.notify()

    def close(self, reason: str) -> None:
        """Fail what is queued and break the connection; the transfer in progress (if any)
        turns FAILED on this peer's thread once its socket call has returned (quiescent)."""
        with self.cv:
            self.closed = True
            sock = self.sock
            self.cv.notify()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._fail_queued(reason)

    def _fail_queued(self, reason: str) -> None:
        with self.cv:
            items, self.queue = list(self.queue), collections.deque()
        for handle, xfer in items:
            if handle is not None and isinstance(xfer, _Xfer):
                self.owner._finish(xfer, XferState(XferStatus.FAILED, reason))

    def _connect(self) -> socket.socket:
        if self.sock is None:
            try:
                sock = socket.create_connection(
                    (self.desc.host, self.desc.port), timeout=self.owner.timeout
                )
            except OSError as exc:
                raise _PeerGone(
                    f"cannot connect to {self.desc.host}:{self.desc.port}: {exc}"
                ) from exc
            with self.cv:  # close() shuts down what it sees here: never open behind its back
                if self.closed:
                    sock.close()
                    raise _PeerGone("disconnected")
                self.sock = sock
            _tune(sock)
            _send_hdr(
                sock, _Hdr(_VERSION, "H", agent=self.owner.ctx.agent_name, token=self.desc.token)
            )
        return self.sock

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.cv.wait()
                if self.closed:
                    break
                handle, item = self.queue.popleft()
            try:
                sock = self._connect()
                if handle is None:
                    assert isinstance(item, bytes)
                    _send_hdr(
                        sock, _Hdr(_VERSION, "N", agent=self.owner.ctx.agent_name, notify=item)
                    )
                else:
                    assert isinstance(item, _Xfer)
                    self._transfer(sock, item)
            except (OSError, _PeerGone, KVLinkError) as exc:
                where = f"{self.desc.host}:{self.desc.port}"
                reason = f"peer {self.name} ({where}): {_why(exc, self.owner.timeout)}"
                if isinstance(item, _Xfer):
                    self.owner._finish(item, XferState(XferStatus.FAILED, reason))
                log.warning("tcp: %s; failing %d queued transfer(s)", reason, len(self.queue))
                self._fail_queued(reason)
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
        if self.sock is not None:
            self.sock.close()
        self._fail_queued(f"peer {self.name} disconnected")

    def _transfer(self, sock: socket.socket, xfer: _Xfer) -> None:
        """Run ``xfer`` as one R/W request per ``_MAX_EXTENTS`` extents (the owner's bound);
        its notification goes with the last."""
        owner = self.owner
        owner._order_after_post(xfer)  # before this transfer's first gather or scatter
        count = xfer.remote.shape[0]
        for k in range(0, max(count, 1), _MAX_EXTENTS):
            last = k + _MAX_EXTENTS >= count
            if not self._request(sock, xfer, slice(k, k + _MAX_EXTENTS), last):
                return
        owner._finish(xfer, DONE)

    def _request(self, sock: socket.socket, xfer: _Xfer, part: slice, last: bool) -> bool:
        """One request of ``xfer``; False when the owner refused it (``xfer`` FAILED)."""
        owner = self.owner
        local, remote = xfer.local[part], xfer.remote[part]
        hdr = _Hdr(
            _VERSION,
            "R" if xfer.op is Op.READ else "W",
            agent=owner.ctx.agent_name,
            extents=memoryview(extents_to_bytes(remote)),
            notify=xfer.notify if xfer.op is Op.WRITE and last else None,
            ticket=xfer.ticket,
        )
        _send_hdr(sock, hdr)
        if xfer.op is Op.WRITE:
            try:
                owner._send_ext(sock, local)
            except OSError:
                # an owner that refuses a WRITE answers E and closes: say why, if it did
                reply = self._answer_after_break(sock)
                if reply is None or reply.op != "E":
                    raise
                self._refused(xfer, reply, reconnect=True)
                return False
        reply = _recv_hdr(sock)
        if reply.op == "E":
            self._refused(xfer, reply, reconnect=xfer.op is Op.WRITE)
            return False
        if reply.op != "A":
            raise WireError(f"unexpected reply {reply.op!r}")
        if xfer.op is Op.READ:
            owner._recv_ext(sock, local)
            if xfer.notify is not None and last:
                _send_hdr(sock, _Hdr(_VERSION, "N", agent=owner.ctx.agent_name, notify=xfer.notify))
        return True

    def _refused(self, xfer: _Xfer, reply: _Hdr, reconnect: bool) -> None:
        self.owner._finish(
            xfer, XferState(XferStatus.FAILED, f"peer {self.name} refused: {reply.reason}",
                            refused=True)
        )
        if reconnect:  # the owner closed this connection (a WRITE's payload cannot be skipped)
            self._drop_sock()

    @staticmethod
    def _answer_after_break(sock: socket.socket) -> _Hdr | None:
        try:
            sock.settimeout(1.0)
            return _recv_hdr(sock)
        except (OSError, _PeerGone, KVLinkError):
            return None

    def _drop_sock(self) -> None:
        with self.cv:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


# ---------------------------------------------------------------------------- server side


@dataclasses.dataclass(eq=False)
class _Inbound:
    """One accepted connection and the thread serving it."""

    conn: socket.socket
    thread: threading.Thread
    agent: str | None = None  # set once its handshake header checked out
    revoked: bool = False  # fence(): stop before the next socket call
    serving: bytes | None = None  # the ticket of the request being served (under _lock)
    cut: bool = False  # revoke() of ``serving``: stop before the next socket call


@dataclasses.dataclass(eq=False)
class _Hello:
    """A connection whose hello (first header) the accept thread is still reading."""

    conn: socket.socket
    addr: Any
    deadline: float
    buf: bytearray = dataclasses.field(default_factory=bytearray)
    need: int = _LEN.size  # bytes of the part being read (the length prefix, then the body)
    body: bool = False  # the prefix was read; ``need`` is the body's length


# ---------------------------------------------------------------------------- the transport


class TcpTransport(Transport):
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
        self.timeout = float(check_options("tcp", self.options).get("timeout_s", 30.0))
        # before authentication (module docstring, "Bounds")
        self.hello_timeout = float(self.options.get("hello_timeout_s", 5.0))
        self.max_unauthenticated = int(self.options.get("max_unauthenticated", 64))
        self.max_connections = int(self.options.get("max_connections", 1024))
        # staged device memory moves after the caller's current stream at post (staging.py,
        # "Stream order"); False: no wait, for a caller that orders its streams itself
        self.stream_order = bool(self.options.get("stream_order", True))
        port = int(self.options.get("port", 0))
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
        self._grants = Grants()
        self._throttle = _Throttle()
        self._memory = _Memory(())
        self._regions: tuple[Region, ...] = ()
        self._copier: staging.Copier | None = None
        self._pool: staging.PinnedPool | None = None
        self._chunk = 0
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # an inbound request ended (revoke)
        self._xfers: dict[int, _Xfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbound: dict[socket.socket, _Inbound] = {}  # authenticated connections
        self._pending = 0  # connections whose hello is being read (the accept thread's)
        self._cuts: list[tuple[float, bytes, list[_Inbound]]] = []  # revoke(): due, ticket, busy
        self._revoked: set[str] = set()  # agents fenced off until connect() names them again
        self._notifs: collections.deque[tuple[str, bytes]] = collections.deque()
        self._handles = itertools.count(1)
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept, name="kvlink-tcp-accept", daemon=True
        )
        self._acceptor.start()

    # -- contract
    def register(self, regions: Sequence[Region]) -> None:
        devices = {r.device for r in regions if r.memory_kind != "cpu"}
        if len(devices) > 1 or any(not d.startswith("cuda") for d in devices):
            raise TransportUnavailable(f"tcp stages one CUDA device at most; got {sorted(devices)}")
        if devices:
            self._enable_staging(int(devices.pop().split(":")[1]))
        elif self.options.get("stage_host_memory"):
            # host memory through the staging pipeline: how CI exercises it without a GPU
            self._enable_staging(None)
        self._regions = self._regions + tuple(regions)
        self._memory = _Memory(self._regions)

    def _enable_staging(self, device: int | None) -> None:
        """VRAM (or, for tests, host memory) moves through a bounded pool of host buffers."""
        if self._copier is not None:
            return
        chunk = int(self.options.get("staging_chunk", 4 << 20))
        count = int(self.options.get("staging_buffers", 8))
        if device is None:
            self._copier = staging.HostCopier()
        else:
            try:
                import torch

                if not torch.cuda.is_available():
                    raise TransportUnavailable("tcp cannot stage CUDA memory: no CUDA device")
            except ImportError as exc:
                raise TransportUnavailable(f"tcp staging needs torch: {exc}") from exc
            self._copier = staging.CudaCopier(device, chunk)
        self._pool = staging.PinnedPool(count, chunk, pin=device is not None)
        self._chunk = chunk

    def _is_staged(self, ext: Extents, what: str = "extent") -> bool:
        """Bounds-check ``ext`` against registered memory; True if it moves through staging."""
        table, kinds = self._memory.table, set[str]()
        for k in range(0, ext.shape[0], _CHECK):
            idx = table.locate(ext[k : k + _CHECK], what if not k else f"{what} {k}+")
            kinds.update(table.regions[int(i)].memory_kind for i in np.unique(idx))
        if not kinds:
            return False
        if len(kinds) > 1:
            raise ExtentOutOfBounds(f"one transfer mixes memory kinds {sorted(kinds)}")
        device = kinds.pop() != "cpu"
        return self._copier is not None and (device or bool(self.options.get("stage_host_memory")))

    def _send_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None
    ) -> None:
        if self._is_staged(ext):
            assert self._copier is not None and self._pool is not None

            def send(mv: memoryview) -> None:
                if stop is not None and stop():
                    raise _PeerGone("access revoked mid-transfer")
                sock.sendall(mv)

            staging.send_staged(send, ext, self._copier, self._pool, self._chunk, self.timeout)
        else:
            _send_views(sock, self._memory.batches(ext, "extent"), stop)

    def _recv_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None
    ) -> None:
        if self._is_staged(ext):
            assert self._copier is not None and self._pool is not None
            staging.recv_staged(lambda mv: _recv_views(sock, [[mv]], stop), ext, self._copier,
                                self._pool, self._chunk, self.timeout)
        else:
            _recv_views(sock, self._memory.batches(ext, "extent"), stop)

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

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",
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
        )
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
        staged = bool(self.options.get("stage_host_memory")) or any(
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
            c.revoked = True
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
            c.revoked = True
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
        self._grants.revoke(ticket)
        ticket = bytes(ticket)
        with self._lock:
            busy = [c for c in self._inbound.values() if c.serving == ticket]
            for c in busy:
                c.cut = True
        if not busy:
            return True
        with self._lock:  # the accept thread shuts down what is still stuck at the grace's end
            self._cuts.append((time.monotonic() + _CUT_GRACE, ticket, busy))
        self._wake()
        with self._quiet:
            ok = self._quiet.wait_for(
                lambda: not any(c.serving == ticket for c in busy), max(timeout, 0.0))
        log.info("tcp: revoked a grant in use by %s%s", sorted({str(c.agent) for c in busy}),
                 "" if ok else f"; still moving bytes after {timeout:.1f}s")
        return ok

    def _run_cuts(self, now: float) -> float | None:
        """Shut down the connections still serving a revoked ticket at their grace's end (the
        accept thread's); returns when the next cut is due."""
        with self._lock:
            due = [c for c in self._cuts if c[0] <= now]
            self._cuts = [c for c in self._cuts if c[0] > now]
            stuck = [c for _, ticket, busy in due for c in busy if c.serving == ticket]
            nxt = min((c[0] for c in self._cuts), default=None)
        for c in stuck:
            log.info("tcp: shutting down agent %s's connection: still inside a socket call "
                     "under a revoked grant %.2fs after", c.agent, _CUT_GRACE)
            shutdown(c.conn)
        return nxt

    def inflight(self) -> int:
        return sum(1 for x in list(self._xfers.values()) if x.state.status is XferStatus.PENDING)

    def _finish(self, xfer: _Xfer, state: XferState) -> None:
        mark, xfer.mark = xfer.mark, None  # ended before its first copy: hand the mark back
        if mark is not None and self._copier is not None:
            self._copier.drop(mark)
        if xfer.state.status is not XferStatus.PENDING:
            return
        if state.status is XferStatus.DONE:
            self._account(
                transfers=1, bytes=xfer.nbytes, xfer_seconds=time.perf_counter() - xfer.t_post
            )
        else:
            self._account(failed=1)
        xfer.state = state

    # -- server side: peers' transfers against our memory
    def _accept(self) -> None:
        """Accept connections and read their hellos, all on this one thread (a connection gets
        a serving thread of its own only once its memory key checked out)."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _Hello] = {}  # in accept order, so in deadline order
        paused_until: float | None = None  # out of descriptors: accepting again at
        try:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                now = time.monotonic()
                due = [h.deadline for h in itertools.islice(pending.values(), 1)]
                if paused_until is not None:
                    due.append(paused_until)
                cut = self._run_cuts(now)
                if cut is not None:
                    due.append(cut)
                for key, _ in sel.select(max(min(due) - now, 0.0) if due else None):
                    if key.fileobj is self._listener:
                        if not self._accept_ready(sel, pending):
                            sel.unregister(self._listener)
                            paused_until = time.monotonic() + _ACCEPT_PAUSE
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.fileobj in pending:
                        try:
                            self._hello_step(sel, pending, key.data)
                        except Exception:  # a bug: drop this connection, keep accepting
                            log.exception("tcp: reading a hello from %s failed", key.data.addr)
                            self._drop_hello(sel, pending, key.data, "hello-bug", "see above")
                now = time.monotonic()
                while pending:
                    first = next(iter(pending.values()))
                    if first.deadline > now:
                        break
                    self._drop_hello(sel, pending, first, "slow-hello",
                                     f"no complete hello within {self.hello_timeout:.1f}s")
                if paused_until is not None and now >= paused_until and not self._closed:
                    sel.register(self._listener, selectors.EVENT_READ)
                    paused_until = None
        except Exception:  # a bug must not end accepting silently
            if not self._closed:
                log.exception("tcp: the accept thread failed; the port no longer accepts")
        finally:
            for h in pending.values():
                h.conn.close()
            with self._lock:
                self._pending = 0
            sel.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _accept_ready(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Hello]
                      ) -> bool:
        """Accept every connection the listener has; False when out of descriptors."""
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if self._closed:
                    return True
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._throttle(logging.WARNING, "accept", "tcp: cannot accept (%s); "
                                   "pausing %.1fs", exc, _ACCEPT_PAUSE)
                    return False
                raise
            with self._lock:
                total = len(self._inbound) + len(pending)
            if total >= self.max_connections:
                conn.close()
                self._throttle(logging.WARNING, "max-connections", "tcp: refused a connection "
                               "from %s: %d open (max_connections)", addr, total)
                continue
            if len(pending) >= self.max_unauthenticated:  # the oldest goes, not the newcomer
                self._drop_hello(sel, pending, next(iter(pending.values())), "evicted",
                                 f"{len(pending)} connections without a hello yet "
                                 f"(max_unauthenticated); dropped the oldest")
            try:
                conn.setblocking(False)
                h = _Hello(conn, addr, time.monotonic() + self.hello_timeout)
                sel.register(conn, selectors.EVENT_READ, h)
            except (OSError, ValueError):
                conn.close()
                continue
            pending[conn] = h
            with self._lock:
                self._pending = len(pending)
        return True

    def _drop_hello(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Hello],
                    h: _Hello, kind: str, why: str, level: int = logging.WARNING) -> None:
        pending.pop(h.conn, None)
        with self._lock:
            self._pending = len(pending)
        try:
            sel.unregister(h.conn)
        except (KeyError, ValueError):
            pass
        h.conn.close()
        self._throttle(level, kind, "tcp: closed connection from %s before authentication: %s",
                       h.addr, why)

    def _hello_step(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Hello],
                    h: _Hello) -> None:
        """Read what has arrived of ``h``'s hello, never past it (its first request follows),
        and never more than ``_MAX_HELLO``: the announced length is checked first."""
        while True:
            try:
                chunk = h.conn.recv(h.need - len(h.buf))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop_hello(sel, pending, h, "hello-lost", f"connection lost ({exc})",
                                 logging.INFO)
                return
            if not chunk:
                self._drop_hello(sel, pending, h, "hello-eof", "closed by peer", logging.INFO)
                return
            h.buf += chunk
            if len(h.buf) < h.need:
                continue
            if h.body:
                self._admit(sel, pending, h)
                return
            (n,) = _LEN.unpack(h.buf)
            if not 0 < n <= _MAX_HELLO:
                self._drop_hello(sel, pending, h, "hello-size", f"a hello of {n} B announced "
                                 f"(at most {_MAX_HELLO} B before authentication)")
                return
            h.need, h.buf, h.body = n, bytearray(), True

    def _admit(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Hello],
               h: _Hello) -> None:
        """A whole hello arrived: its memory key lets the connection have a serving thread."""
        pending.pop(h.conn, None)
        with self._lock:
            self._pending = len(pending)
        sel.unregister(h.conn)
        conn, addr = h.conn, h.addr
        try:
            hello: _Hdr | None = _decode_hdr(h.buf)
        except WireError:
            hello = None
        if hello is None or hello.op != "H" or not hmac.compare_digest(hello.token, self._token):
            conn.close()
            self._throttle(logging.WARNING, "bad-key", "tcp: connection from %s presented no "
                           "valid memory key; closed", addr)
            return
        with self._lock:  # fence() reads agent and revoked set under the same lock
            if self._closed or hello.agent in self._revoked:
                conn.close()
                self._throttle(logging.WARNING, f"fenced {hello.agent[:64]}", "tcp: refused "
                               "agent %r from %s: access revoked (fenced)", hello.agent, addr)
                return
            try:
                conn.setblocking(True)
                _tune(conn)
            except OSError:
                conn.close()
                return
            inb = _Inbound(conn, threading.Thread(
                target=self._serve, args=(conn, addr), name="kvlink-tcp-serve", daemon=True
            ), agent=hello.agent)
            self._inbound[conn] = inb  # before the thread starts: _serve finds it here
            inb.thread.start()

    def _recv_request(self, conn: socket.socket) -> _Hdr:
        """The next request header. Its first byte may take any time (an idle peer keeps its
        connection open); from there the whole header must arrive within ``timeout_s``, and
        announce at most ``_MAX_HEADER`` bytes. Its payload then moves under ``timeout_s`` per
        socket call."""
        conn.settimeout(None)
        head = bytearray(_LEN.size)
        if conn.recv_into(head, 1) == 0:
            raise _PeerGone("connection closed by peer")
        deadline = time.monotonic() + self.timeout
        head[1:] = _recv_exact(conn, _LEN.size - 1, deadline)
        (n,) = _LEN.unpack(head)
        if n > _MAX_HEADER:
            conn.settimeout(self.timeout)
            _send_hdr(conn, _Hdr(_VERSION, "E", reason=f"header of {n} B exceeds {_MAX_HEADER} "
                                 f"B (at most {_MAX_EXTENTS} extents a request)"))
            raise WireError(f"tcp header of {n} B exceeds {_MAX_HEADER} B")
        body = _recv_exact(conn, n, deadline)
        conn.settimeout(self.timeout)
        return _decode_hdr(body)

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        inb = self._inbound[conn]
        try:
            while True:
                hdr = self._recv_request(conn)
                if inb.revoked:
                    raise _PeerGone(f"agent {inb.agent} was fenced")
                if hdr.op == "N":
                    if hdr.notify is not None:
                        self._notifs.append((hdr.agent, hdr.notify))
                    continue
                if hdr.op not in ("R", "W"):
                    raise WireError(f"unknown op {hdr.op!r}")
                self._serve_request(inb, addr, hdr)
        except (OSError, _PeerGone, KVLinkError) as exc:
            if not isinstance(exc, _PeerGone) or "closed by peer" not in str(exc):
                log.info("tcp: connection from %s (agent %s) ended: %s", addr, inb.agent, exc)
        except Exception:  # a bug: end this connection, keep serving the others
            log.exception("tcp: serving agent %s (%s) failed", inb.agent, addr)
        finally:
            with self._quiet:
                self._inbound.pop(conn, None)
                inb.serving = None
                self._quiet.notify_all()
            conn.close()

    def _serve_request(self, inb: _Inbound, addr: Any, hdr: _Hdr) -> None:
        """One R or W: refused unless in bounds and (``require_grants``) granted."""
        conn, op = inb.conn, Op.READ if hdr.op == "R" else Op.WRITE
        ext = extents_from_bytes(hdr.extents, _MAX_EXTENTS)
        with self._lock:  # before the grant check, so revoke() sees it or the check fails
            inb.serving, inb.cut = hdr.ticket, False
        try:
            why = self._refusal(op, hdr.ticket, ext)
            if why is None:

                def stop() -> bool:
                    return inb.revoked or inb.cut

                if op is Op.READ:
                    _send_hdr(conn, _Hdr(_VERSION, "A"))
                    self._send_ext(conn, ext, stop)
                else:
                    self._recv_ext(conn, ext, stop)
        finally:
            # done with our memory before any answer goes out: a peer (or the owner, seeing
            # the notification) that revokes once it has the answer finds nothing to wait for
            with self._quiet:
                inb.serving = None
                self._quiet.notify_all()
        if why is not None:
            self._account(refused=1)
            self._throttle(logging.WARNING, f"refused {str(inb.agent)[:64]}",
                           "tcp: refused %s of %d extent(s) from agent %s (%s): %s",
                           op.value.upper(), ext.shape[0], inb.agent, addr, why)
            _send_hdr(conn, _Hdr(_VERSION, "E", reason=why[:_MAX_REASON]))
            if op is Op.WRITE:  # its payload follows; the stream cannot be resynced
                raise _PeerGone("refused WRITE payload")
        elif op is Op.WRITE:
            # the answer first: a note seen before it lets the owner finish and close while
            # the writer still waits for it, so a WRITE whose bytes landed would turn FAILED
            # there (and its "written" go out as failed); sent, the answer survives a close
            _send_hdr(conn, _Hdr(_VERSION, "A"))
            if hdr.notify is not None:
                self._notifs.append((hdr.agent, hdr.notify))

    def _refusal(self, op: Op, ticket: bytes, ext: Extents) -> str | None:
        """Why a peer's ``op`` on ``ext`` under ``ticket`` is not served (None: it is)."""
        if self.ctx.require_grants:
            for k in range(0, max(ext.shape[0], 1), _CHECK):
                why = self._grants.check(ticket, op, ext[k : k + _CHECK])
                if why is not None:
                    return why
        try:
            self._is_staged(ext, "requested extent")  # bounds and memory-kind check
        except ExtentOutOfBounds as exc:
            return str(exc)
        return None
