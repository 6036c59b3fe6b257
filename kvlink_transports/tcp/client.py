"""The initiator's side of tcp: one connection and one thread per peer, running its transfers.

Each peer gets one connection (opened on first use, with the hello that carries the peer's
memory key) and one thread that runs that peer's queued transfers in order: a READ or WRITE
goes as one request per ``_MAX_EXTENTS`` extents, its notification with the last. A
transfer is marked FAILED only after its socket call has returned, so FAILED is quiescent on
this side; a broken connection fails everything queued for the peer.

With option ``reader_in_c`` (default true, kvlink.options) and kvlink's C helpers built,
the thread waits for work in C, not in Python: parked in
``run_inbox`` (``_reader.c``) on an inbox. A plain transfer (one request of host memory:
``_Xfer.landed``) posted while it is parked goes into the inbox: a READ's header is sent by
the caller as it queues it (what the connection takes at once: C sends any rest, so the
caller never waits for the owner), and C takes its answer and bytes; a WRITE's header and bytes
(and its notification, in the header) are sent by C, which takes its answer. Either is then
marked landed for ``poll()``: that thread runs no Python for it, so it never waits for the
GIL, which a caller busy in Python between polls (a decode's step loop, a prefill's) holds
for up to a switch interval. Anything else is queued for the thread's Python, which the
inbox gives back once the jobs it holds are done.
Separate from the transport because it is the peer's thread, not the caller's: it reaches the
transport only through :class:`_Owner`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import select
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvlink import native
from kvlink.errors import KVLinkError, TransportUnavailable, WireError
from kvlink.sockets import keepalive
from kvlink.transport import (
    DONE,
    PENDING,
    Extents,
    Op,
    Region,
    RegionTable,
    TransportContext,
    XferState,
    XferStatus,
)
from kvlink.wire import extents_to_bytes
from kvlink_transports.tcp.wire import (
    _A_FRAME,
    _LEN,
    _MAX_EXTENTS,
    _MAX_REPLY,
    _VERSION,
    _decode_hdr,
    _Descriptor,
    _frame,
    _Hdr,
    _PeerGone,
    _recv_exact,
    _recv_hdr,
    _send_hdr,
    _tune,
    _why,
)

log = logging.getLogger("kvlink.tcp")

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
    signal: Any = None  # kvlink.landing.Signal: applied once the owner acknowledged the bytes
    #: a plain transfer (one request of host memory; a READ without a notification or a
    #: landing signal): a word kvlink's C helper sets to 1 once its bytes moved and its owner
    #: said "ok" (a WRITE's signal applied), which poll() reads — DONE without this thread's
    #: Python running again (it waits for the GIL up to a switch interval where the caller's
    #: own Python is busy)
    landed: npt.NDArray[np.uint32] | None = None
    finished: bool = False  # _finish ran (under the transport's _finishing lock)

    @property
    def has_landed(self) -> bool:
        """Every byte of this transfer moved and was answered (kvlink's C helper set
        ``landed``)."""
        return self.landed is not None and bool(self.landed[0])


def _reply_after(sock: socket.socket, came: bytes) -> _Hdr:
    """The answer whose first bytes ``came`` (where an "ok" was expected): the rest read."""
    (n,) = _LEN.unpack(came[:_LEN.size])
    body = came[_LEN.size:]
    if not len(body) <= n <= _MAX_REPLY:  # (shorter: what followed it was read too)
        raise WireError(f"tcp answer of {n} B (expected {len(_A_FRAME) - _LEN.size} B or "
                        f"more, at most {_MAX_REPLY} B)")
    return _decode_hdr(body + _recv_exact(sock, n - len(body)))


class _Owner(Protocol):
    """What a peer's thread needs of its transport."""

    @property
    def ctx(self) -> TransportContext: ...

    @property
    def timeout(self) -> float: ...

    @property
    def reader_in_c(self) -> bool: ...

    @property
    def socket_buffer(self) -> int | None: ...

    @property
    def keepalive(self) -> float: ...

    def _finish(self, xfer: _Xfer, state: XferState) -> None: ...

    def _order_after_post(self, xfer: _Xfer) -> None: ...

    def _send_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None
    ) -> None: ...

    def _recv_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None,
        staged: bool | None = None, expect: bytes = b"",
        done: npt.NDArray[np.uint32] | None = None,
    ) -> bytes | None: ...


class _Peer:
    """One connection to a peer and the thread that runs its transfers in order."""

    def __init__(self, owner: _Owner, name: str, desc: _Descriptor) -> None:
        self.owner, self.name, self.desc = owner, name, desc
        self.remote_table = RegionTable([Region(a, n, d) for a, n, d in desc.regions])
        self.queue: collections.deque[tuple[int, _Xfer] | tuple[None, bytes]] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False
        self.sock: socket.socket | None = None
        self.idle = False  # the thread waits for work in Python, on an open connection (cv)
        self._helpers = native.load() if owner.reader_in_c else None
        #: the jobs C runs while the thread is parked (None: not built, or not asked for)
        self.inbox: object | None = self._helpers.inbox_new() if self._helpers else None
        self.parked = False  # the inbox takes jobs: the thread is in run_inbox (under cv)
        #: transfers in the inbox, oldest first, until it retired them (under cv)
        self.in_c: collections.deque[tuple[int, _Xfer]] = collections.deque()
        self._retired = 0  # the inbox's count of retired jobs, as taken off ``in_c``
        self.thread = threading.Thread(target=self._run, name=f"kvlink-tcp-{name}", daemon=True)
        self.thread.start()

    def submit(self, item: tuple[int, _Xfer] | tuple[None, bytes]) -> None:
        """Queue ``item`` for this peer's thread. Where the thread is parked in C, a plain
        transfer goes into its inbox: a READ's header is sent there, on the caller's thread,
        unless a header ahead of it is still to be sent (then C sends it, in turn), and C
        takes the answer and the bytes (READs posted one after another are all on the wire
        at once); a WRITE's header and bytes are sent by C (the caller is not held for a
        payload). Anything else is queued for the thread's Python, woken.

        The caller's send never waits for the owner: it sends what the connection takes at
        once and C sends the rest (``_reader.c``, inbox_push). It used to be a blocking
        send, and an owner that had stopped reading (a hung host; its buffers full of
        earlier requests) held the caller — a decode's step loop — until tcp's deadline.
        The job is queued before that send, so the thread already waits for its answer: on
        two cores the owner's thread, woken by the header, may take this CPU from the
        caller (for ~2 ms in a third of the 16-block READs:
        bench/results/e2e_request_cpu_tcp_85e8581/probe/)."""
        _, xfer = item
        frame = None  # a plain transfer's request, framed before the lock is taken
        if isinstance(xfer, _Xfer) and xfer.landed is not None and self._helpers is not None:
            frame = _frame(self._header(xfer, slice(0, _MAX_EXTENTS), True))
        with self.cv:
            if self.closed:
                raise TransportUnavailable(f"peer {self.name} is disconnected")
            if frame is not None and self.parked and not self.queue and self.sock is not None:
                assert isinstance(xfer, _Xfer) and self._helpers is not None
                sig = xfer.signal
                if self._helpers.inbox_push(
                        self.inbox, xfer.local, xfer.landed, frame, xfer.op is Op.WRITE,
                        None if sig is None else (sig.region[0] + sig.offset, sig.expect,
                                                  sig.value),
                        self.sock.fileno()):
                    assert item[0] is not None
                    self.in_c.append((item[0], xfer))
                    self._retire()
                    return
            if self.parked and self._helpers is not None:  # its Python is wanted
                self._helpers.inbox_python(self.inbox)
            self.queue.append(item)
            self.cv.notify()

    def close(self, reason: str) -> None:
        """Fail what is queued and break the connection; the transfer in progress (if any)
        turns FAILED on this peer's thread once its socket call has returned (quiescent)."""
        with self.cv:
            self.closed = True
            sock = self.sock
            self.cv.notify()
            if self.parked and self._helpers is not None:
                self._helpers.inbox_python(self.inbox)
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
            _tune(sock, self.owner.socket_buffer)
            keepalive(sock, self.owner.keepalive)
            _send_hdr(
                sock, _Hdr(_VERSION, "H", agent=self.owner.ctx.agent_name, token=self.desc.token)
            )
        return self.sock

    def _retire(self) -> None:
        """(under cv) Take the jobs the inbox retired off ``in_c``: each landed (C set its
        word, which ``poll()`` reads) or was failed by this thread."""
        assert self._helpers is not None
        _, retired = self._helpers.inbox_state(self.inbox)
        for _ in range(retired - self._retired):
            self.in_c.popleft()
        self._retired = retired

    def _run(self) -> None:
        while True:
            with self.cv:
                # jobs left in the inbox (behind a refusal) were queued before anything
                # queued for Python: their answers are next on the wire, so C takes them first
                while (self.in_c or not self.queue) and not self.closed:
                    if self._helpers is not None and self.sock is not None:
                        self.parked = True  # (the inbox takes jobs from here on)
                        self._helpers.inbox_open(self.inbox)
                        if self.queue:  # (then back to Python for it)
                            self._helpers.inbox_python(self.inbox)
                        self.cv.notify_all()  # (for whoever waits to see it parked: a test)
                        break
                    self.idle = self.sock is not None
                    self.cv.notify_all()  # for whoever waits to see it idle (a test)
                    self.cv.wait()
                self.idle = False
                if self.closed:
                    break
                parked = self.parked
                if not parked:
                    handle, item = self.queue.popleft()
            if parked:
                self._park()
                continue
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
                self._broken(exc, item if isinstance(item, _Xfer) else None)
            except Exception as exc:  # a bug here, not the peer: said, and the transfers
                # fail naming it — an escape ended this thread, and every transfer to the
                # peer stayed PENDING past its deadline
                log.exception("tcp: peer %s: unexpected error under a transfer", self.name)
                self._broken(exc, item if isinstance(item, _Xfer) else None)
        if self.sock is not None:
            self.sock.close()
        self._fail_queued(f"peer {self.name} disconnected")
        self._fail_inbox(f"peer {self.name} disconnected")

    def _broken(self, exc: BaseException, first: _Xfer | None) -> None:
        """The connection failed under ``first`` (the transfer it was running, if any): it is
        dropped, and everything pending on it fails — the jobs in the inbox, the queue, then
        ``first`` — so a transfer the caller submits once it hears of the failure opens a new
        connection and is never failed with this one's reason (it was, when this ran the
        other way round)."""
        reason = f"peer {self.name} ({self.desc.host}:{self.desc.port}): " \
                 f"{_why(exc, self.owner.timeout)}"
        with self.cv:
            broken, self.sock = self.sock, None
        if broken is not None:
            broken.close()
        log.warning("tcp: %s; failing %d queued transfer(s)", reason,
                    len(self.queue) + len(self.in_c))
        self._fail_inbox(reason)
        self._fail_queued(reason)
        if first is not None:
            self.owner._finish(first, XferState(XferStatus.FAILED, reason))

    def _fail_inbox(self, reason: str) -> None:
        """(this thread, out of run_inbox: quiescent) Fail the jobs still in the inbox."""
        if self._helpers is None:
            return
        with self.cv:
            stuck = [x for _, x in self.in_c]
            self._helpers.inbox_drop(self.inbox, True)
            self._retire()
        for xfer in stuck:
            self.owner._finish(xfer, XferState(XferStatus.FAILED, reason))

    def _park(self) -> None:
        """Wait in C, running the inbox's jobs as they come, until Python is wanted (something
        queued, or close) or a job's answer is not the "ok" (read on here) or the connection
        fails (a WRITE's owner that refused it closes the connection: its answer is read
        here where it came)."""
        helpers, sock = self._helpers, self.sock
        assert helpers is not None and sock is not None
        try:
            got: object = helpers.run_inbox(sock.fileno(), self.inbox, _A_FRAME,
                                            max(1, int(self.owner.timeout * 1000)))
        except OSError as exc:
            got = exc
        with self.cv:
            self.parked = False
            self._retire()
            first = self.in_c[0][1] if self.in_c else None
        if got is None:
            return
        if first is not None:
            try:
                if isinstance(got, bytes):  # not our "ok": the rest says what
                    reply: _Hdr | None = _reply_after(sock, got)
                else:  # an owner that refused a WRITE answered E and closed, if it did
                    reply = (self._answer_after_break(sock, got) if first.op is Op.WRITE
                             else None)
                    reply = reply if reply is not None and reply.op == "E" else None
                if reply is not None:
                    self._answered(first, reply)  # (E: FAILED, refused)
                    if reply.op == "A":  # an "ok" framed otherwise: a READ's bytes follow
                        if first.op is Op.READ:
                            self.owner._recv_ext(sock, first.local, done=first.landed)
                        else:
                            self.owner._finish(first, DONE)
                    with self.cv:
                        helpers.inbox_drop(self.inbox, False)
                        self._retire()
                    if self.sock is None:  # a refused WRITE: its owner closed the connection
                        self._queue_inbox_again()
                    return
            except (OSError, _PeerGone, KVLinkError) as exc:
                got = exc
        self._broken(got if isinstance(got, BaseException)
                     else _PeerGone("connection closed by peer"), None)

    def _queue_inbox_again(self) -> None:
        """(this thread, out of run_inbox) The owner closed the connection after refusing a
        WRITE, and read nothing after it: the jobs behind it were not run there, so they go
        back to the front of the queue, in order, to run on a new connection (a READ's
        header the caller sent on the old one went nowhere; a READ is safe to ask again)."""
        assert self._helpers is not None
        with self.cv:
            behind = list(self.in_c)
            self._helpers.inbox_drop(self.inbox, True)
            self._retire()
            for handle, xfer in reversed(behind):
                self.queue.appendleft((handle, xfer))

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
        local = xfer.local[part]
        _send_hdr(sock, self._header(xfer, part, last))
        if xfer.op is Op.WRITE:
            try:
                owner._send_ext(sock, local)
            except OSError as exc:
                # an owner that refuses a WRITE answers E and closes: say why, if it did
                reply = self._answer_after_break(sock, exc)
                if reply is None or reply.op != "E":
                    raise
                self._refused(xfer, reply, reconnect=True)
                return False
        if xfer.op is Op.READ:
            # the answer and the bytes in one call (the GIL taken back once, not per socket
            # call: where this process's Python is busy each costs up to a switch interval)
            came = owner._recv_ext(sock, local, expect=_A_FRAME, done=xfer.landed)
            if came is not None:  # not our "ok" bytes: the rest of its answer says what
                reply = _reply_after(sock, came)
                self._answered(xfer, reply)
                if reply.op != "A":
                    return False
                owner._recv_ext(sock, local, done=xfer.landed)  # an "ok" framed otherwise
            if xfer.notify is not None and last:
                _send_hdr(sock, _Hdr(_VERSION, "N", agent=owner.ctx.agent_name, notify=xfer.notify))
            return True
        reply = _recv_hdr(sock)
        self._answered(xfer, reply)
        return reply.op == "A"

    def _answered(self, xfer: _Xfer, reply: _Hdr) -> None:
        """An owner's answer other than the bytes: E fails ``xfer`` (refused), A is ok."""
        if reply.op == "E":
            self._refused(xfer, reply, reconnect=xfer.op is Op.WRITE)
        elif reply.op != "A":
            raise WireError(f"unexpected reply {reply.op!r}")

    def _header(self, xfer: _Xfer, part: slice, last: bool) -> _Hdr:
        return _Hdr(
            _VERSION,
            "R" if xfer.op is Op.READ else "W",
            agent=self.owner.ctx.agent_name,
            extents=memoryview(extents_to_bytes(xfer.remote[part])),
            notify=xfer.notify if xfer.op is Op.WRITE and last else None,
            ticket=xfer.ticket,
        )

    def _refused(self, xfer: _Xfer, reply: _Hdr, reconnect: bool) -> None:
        self.owner._finish(
            xfer, XferState(XferStatus.FAILED, f"peer {self.name} refused: {reply.reason}",
                            refused=True)
        )
        if reconnect or self._closed_by_owner():  # (a WRITE's payload cannot be skipped;
            self._drop_sock()  # an owner at max_connections refuses the whole connection)

    def _closed_by_owner(self) -> bool:
        """Whether the owner has closed our connection (its E was its last word): the next
        transfer then connects anew instead of failing on this one. One peek, on a refusal
        only."""
        sock = self.sock
        if sock is None:
            return False
        try:  # (a socket with a timeout waits for data whatever MSG_DONTWAIT says: select)
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (ValueError, OSError):  # (closed meanwhile, or reset: gone either way)
            return True

    @staticmethod
    def _answer_after_break(sock: socket.socket, exc: object) -> _Hdr | None:
        """The E an owner that refused a WRITE sent before it closed, where a send broke on
        that close (``exc``); None else — a stalled send (a timeout) is no refusal, and is
        not waited on again."""
        if isinstance(exc, TimeoutError) or not isinstance(exc, OSError | str):
            return None
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
