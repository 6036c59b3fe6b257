"""The owner's side of tcp: accepting connections, their hellos, and serving peers' requests.

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

Every request is checked by the side that owns the memory before a byte is read or written:
in bounds, and under ``require_grants`` inside a window :meth:`TcpTransport.grant` made for its
ticket (:meth:`kvlink.grants.Grants.enter`); a refusal is answered ``E``. READs of host
memory are served by kvlink's C helper without the GIL where it is built
(:meth:`_Server._recv_request`). Separate from the transport
because it runs on threads of its own (one accept thread, one serving thread per
authenticated connection) against the transport's state, whose methods call none of this.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hmac
import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from kvlink.errors import ExtentOutOfBounds, KVLinkError, WireError
from kvlink.grants import FENCED, Grants
from kvlink.sockets import keepalive, shutdown
from kvlink.transport import Extents, Op
from kvlink.wire import extents_from_bytes
from kvlink_transports.tcp.memory import _LocalMemory
from kvlink_transports.tcp.wire import (
    _A_FRAME,
    _LEN,
    _MAX_EXTENTS,
    _MAX_HEADER,
    _MAX_HELLO,
    _MAX_REASON,
    _VERSION,
    _decode_hdr,
    _Hdr,
    _PeerGone,
    _recv_exact,
    _send_hdr,
    _tune,
)

log = logging.getLogger("kvlink.tcp")

_ACCEPT_PAUSE = 0.1  # seconds the accept thread stops accepting when out of descriptors
# seconds revoke() lets a request under the ticket stop on its own before its connection is
# shut down. Not shorter: a thread whose last sendall just handed the bytes to the kernel may
# be descheduled that long on a loaded machine (50 ms cut live connections on 2 busy cores,
# failing the *next* READ on them); what the grace bounds is a hung peer's socket, not
# correctness (a READ the hold ended under is refused at its verdict anyway)
_CUT_GRACE = 1.0
#: a connection refused at max_connections is told why (an E), then drained until the peer
#: closes, at most this many seconds and _REFUSED_KEPT connections at once (beyond: closed
#: at once, untold). Why drained: a close with the peer's hello unread sends a reset, which
#: can destroy the E before the peer reads it ("connection reset by peer" is all it saw)
_REFUSED_LINGER = 1.0
_REFUSED_KEPT = 64


class _Notes:
    """What peers notified (agent, notification), oldest first, until the owner's caller takes
    it (``notifications()``). In kvlink's C queue where its helpers are built: the serving loop
    (``serve_frames``) queues a WRITE's notification there without the GIL, which a busy
    caller's Python holds — the caller waiting for that very notification (a push's end).
    Python's serving path queues there too, so one connection's notifications keep their
    order whichever side took them. Bounded as the C queue is (``_notes.c``: 65,536 notes,
    64 MiB): past that a new one is dropped and counted (:attr:`dropped`) — an owner whose
    caller never takes them (a prefill) must not grow for a peer that sends them anyway."""

    MAX, MAX_BYTES = 65536, 64 << 20

    def __init__(self, helpers: Any) -> None:
        self._c = helpers
        #: the C queue serve_frames fills (None: no C helpers, a deque)
        self.queue: object | None = helpers.notes_new() if helpers is not None else None
        self._py: collections.deque[tuple[str, bytes]] = collections.deque()
        self._py_bytes = self._py_dropped = 0  # (under _py_lock: serving threads append)
        self._py_lock = threading.Lock()

    def append(self, note: tuple[str, bytes]) -> None:
        if self.queue is not None:
            self._c.notes_push(self.queue, *note)
            return
        size = len(note[0]) + len(note[1])
        with self._py_lock:
            if len(self._py) >= self.MAX or self._py_bytes + size > self.MAX_BYTES:
                self._py_dropped += 1
                return
            self._py.append(note)
            self._py_bytes += size

    def take(self) -> list[tuple[str, bytes]]:
        if self.queue is not None:
            out: list[tuple[str, bytes]] = self._c.notes_take(self.queue)
            return out
        with self._py_lock:
            out, self._py, self._py_bytes = list(self._py), collections.deque(), 0
        return out

    @property
    def dropped(self) -> int:
        """Notifications refused so far, the queue full."""
        if self.queue is not None:
            return int(self._c.notes_dropped(self.queue))
        return self._py_dropped


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


@dataclasses.dataclass(eq=False)
class _Inbound:
    """One accepted connection and the thread serving it."""

    conn: socket.socket
    thread: threading.Thread
    agent: str | None = None  # set once its handshake header checked out
    #: whether it is serving, under which ticket, fenced, and its halt word (its first: what
    #: the byte mover reads between socket calls) — kept by the transport's Grants
    state: npt.NDArray[np.uint32] = dataclasses.field(default_factory=Grants.new_state)

    def stopped(self) -> bool:
        """Fenced, or the ticket it serves under revoked: stop before the next socket call."""
        return Grants.halted(self.state)


@dataclasses.dataclass(eq=False)
class _Hello:
    """A connection whose hello (first header) the accept thread is still reading."""

    conn: socket.socket
    addr: Any
    deadline: float
    buf: bytearray = dataclasses.field(default_factory=bytearray)
    need: int = _LEN.size  # bytes of the part being read (the length prefix, then the body)
    body: bool = False  # the prefix was read; ``need`` is the body's length


class _Server(_LocalMemory):
    """The accept thread and the serving threads, as methods of the transport."""

    hello_timeout: float  # hello_timeout_s
    max_unauthenticated: int
    max_connections: int
    socket_buffer: int | None  # socket_buffer_bytes (wire._tune)
    keepalive: float  # keepalive_s (kvlink.sockets.keepalive)
    _closed: bool
    _listener: socket.socket
    _wake_r: socket.socket  # close() and revoke() wake the accept thread through it
    _token: bytes  # the memory key
    _grants: Grants
    _throttle: _Throttle
    _lock: threading.Lock
    _inbound: dict[socket.socket, _Inbound]  # authenticated connections
    _pending: int  # connections whose hello is being read (the accept thread's)
    _cuts: list[tuple[float, bytes, list[_Inbound]]]  # revoke(): due, ticket, busy
    _revoked: set[str]  # agents fenced off until connect() names them again
    _notifs: _Notes

    def _run_cuts(self, now: float) -> float | None:
        """Shut down the connections still serving a revoked ticket at their grace's end (the
        accept thread's); returns when the next cut is due."""
        with self._lock:
            due = [c for c in self._cuts if c[0] <= now]
            self._cuts = [c for c in self._cuts if c[0] > now]
            stuck = [c for _, ticket, busy in due for c in busy
                     if self._grants.serving(c.state) == ticket]
            nxt = min((c[0] for c in self._cuts), default=None)
        for c in stuck:
            log.info("tcp: shutting down agent %s's connection: still inside a socket call "
                     "under a revoked grant %.2fs after", c.agent, _CUT_GRACE)
            shutdown(c.conn)
        return nxt

    def _accept(self) -> None:
        """Accept connections and read their hellos, all on this one thread (a connection gets
        a serving thread of its own only once its memory key checked out)."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _Hello] = {}  # in accept order, so in deadline order
        #: refused at max_connections, told why, drained until closed (in deadline order)
        refused: dict[socket.socket, float] = {}
        paused_until: float | None = None  # out of descriptors: accepting again at
        try:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                now = time.monotonic()
                due = [h.deadline for h in itertools.islice(pending.values(), 1)]
                due += itertools.islice(refused.values(), 1)
                if paused_until is not None:
                    due.append(paused_until)
                cut = self._run_cuts(now)
                if cut is not None:
                    due.append(cut)
                for key, _ in sel.select(max(min(due) - now, 0.0) if due else None):
                    if key.fileobj is self._listener:
                        if not self._accept_ready(sel, pending, refused):
                            sel.unregister(self._listener)
                            paused_until = time.monotonic() + _ACCEPT_PAUSE
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.fileobj in refused:
                        self._drain_refused(sel, refused, key.fileobj)
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
                while refused and next(iter(refused.values())) <= now:
                    self._drop_refused(sel, refused, next(iter(refused)))
                if paused_until is not None and now >= paused_until and not self._closed:
                    sel.register(self._listener, selectors.EVENT_READ)
                    paused_until = None
        except Exception:  # a bug must not end accepting silently
            if not self._closed:
                log.exception("tcp: the accept thread failed; the port no longer accepts")
        finally:
            for conn in (*pending, *refused):
                conn.close()
            with self._lock:
                self._pending = 0
            sel.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _accept_ready(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Hello],
                      refused: dict[socket.socket, float]) -> bool:
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
                self._refuse(sel, refused, conn, f"the owner has {total} connections open "
                             f"(max_connections={self.max_connections}); this one is closed")
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

    @staticmethod
    def _refuse(sel: selectors.BaseSelector, refused: dict[socket.socket, float],
                conn: socket.socket, why: str) -> None:
        """Tell a connection we do not serve why (an E: the answer its first request reads),
        stop writing, and drain it until its peer closes (:meth:`_drain_refused`), so its
        unread hello does not make our close a reset that loses the E."""
        try:
            if len(refused) >= _REFUSED_KEPT:
                raise OSError("too many refused connections draining")
            conn.setblocking(False)  # (the E is a few dozen bytes: an empty send buffer)
            frame = _Hdr(_VERSION, "E", reason=why[:_MAX_REASON])
            _send_hdr(conn, frame)
            conn.shutdown(socket.SHUT_WR)
            sel.register(conn, selectors.EVENT_READ)
        except (OSError, ValueError):
            conn.close()
            return
        refused[conn] = time.monotonic() + _REFUSED_LINGER

    @staticmethod
    def _drain_refused(sel: selectors.BaseSelector, refused: dict[socket.socket, float],
                       conn: socket.socket) -> None:
        """Read and drop what a refused connection sent (1 MiB a turn: the accept thread serves
        others meanwhile); closed once its peer has closed."""
        try:
            for _ in range(16):
                if not conn.recv(65536):
                    break
            else:
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        _Server._drop_refused(sel, refused, conn)

    @staticmethod
    def _drop_refused(sel: selectors.BaseSelector, refused: dict[socket.socket, float],
                      conn: socket.socket) -> None:
        refused.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

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
                _tune(conn, self.socket_buffer)
                keepalive(conn, self.keepalive)
            except OSError:
                conn.close()
                return
            inb = _Inbound(conn, threading.Thread(
                target=self._serve, args=(conn, addr), name="kvlink-tcp-serve", daemon=True
            ), agent=hello.agent)
            self._inbound[conn] = inb  # before the thread starts: _serve finds it here
            try:
                inb.thread.start()
            except RuntimeError as exc:  # (no thread to be had: the OS's limit)
                del self._inbound[conn]  # never counted, fenced or joined: it never ran
                conn.close()
                self._throttle(logging.WARNING, "thread", "tcp: refused %s from %s: no "
                               "thread to serve it (%s)", hello.agent[:64], addr, exc)

    def _recv_request(self, inb: _Inbound) -> _Hdr:
        """The next request header Python serves. Its first byte may take any time (an idle
        peer keeps its connection open); from there the whole header must arrive within
        ``timeout_s``, and announce at most ``_MAX_HEADER`` bytes. Its payload then moves
        under ``timeout_s`` per socket call.

        Through kvlink's C helpers where they are built: READs and WRITEs of host memory are
        served there, checked against the grant gate, and notifications queued (:class:`_Notes`)
        without the GIL (``serve_frames``), until a header it leaves to Python (one to refuse,
        one in another shape), which comes back in the same call. A thread coming back from C
        waits for the GIL, up to a switch interval where this process's own Python is busy (a
        prefill's forward, a decode's step loop), and for seconds where that Python gives the
        GIL up and takes it back in a loop: a request served in C waits for neither. Without
        the gate, one C call reads the header."""
        conn, helpers = inb.conn, self._memory.native
        if helpers is not None:
            ms = max(1, int(self.timeout * 1000))
            direct, gate = self._memory.direct, self._grants.gate
            if direct is not None and gate is not None:
                got = helpers.serve_frames(conn.fileno(), gate, inb.state, *direct,
                                           self.ctx.require_grants, _MAX_HEADER, _MAX_EXTENTS,
                                           _VERSION, ms, ms, _A_FRAME, self._notifs.queue)
            else:
                got = helpers.recv_frame(conn.fileno(), _MAX_HEADER, -1, ms)
            if got is None:
                raise _PeerGone("connection closed by peer")
            if isinstance(got, str):
                raise _PeerGone(got if got != FENCED else f"agent {inb.agent} was fenced")
            if isinstance(got, int):
                self._too_long(conn, got)
            return _decode_hdr(got)
        conn.settimeout(None)
        head = bytearray(_LEN.size)
        if conn.recv_into(head, 1) == 0:
            raise _PeerGone("connection closed by peer")
        deadline = time.monotonic() + self.timeout
        head[1:] = _recv_exact(conn, _LEN.size - 1, deadline)
        (n,) = _LEN.unpack(head)
        if n > _MAX_HEADER:
            conn.settimeout(self.timeout)
            self._too_long(conn, n)
        body = _recv_exact(conn, n, deadline)
        conn.settimeout(self.timeout)
        return _decode_hdr(body)

    @staticmethod
    def _too_long(conn: socket.socket, n: int) -> NoReturn:
        """A header announced past ``_MAX_HEADER``: said to the peer, and the connection
        ends (the stream cannot be resynced)."""
        _send_hdr(conn, _Hdr(_VERSION, "E", reason=f"header of {n} B exceeds {_MAX_HEADER} "
                             f"B (at most {_MAX_EXTENTS} extents a request)"))
        raise WireError(f"tcp header of {n} B exceeds {_MAX_HEADER} B")

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        inb = self._inbound[conn]
        try:
            conn.settimeout(self.timeout)  # (each socket call waits at most this long)
            while True:
                hdr = self._recv_request(inb)
                if Grants.fenced(inb.state):
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
            with self._lock:
                self._inbound.pop(conn, None)
            self._grants.leave(inb.state)
            conn.close()

    def _serve_request(self, inb: _Inbound, addr: Any, hdr: _Hdr) -> None:
        """One R or W: refused unless in bounds and (``require_grants``) granted."""
        conn, op = inb.conn, Op.READ if hdr.op == "R" else Op.WRITE
        ext = extents_from_bytes(hdr.extents, _MAX_EXTENTS)
        # checked and marked serving in one step, so revoke() sees it or the check fails
        why = self._grants.enter(inb.state, hdr.ticket, op, ext, self.ctx.require_grants)
        if why == FENCED:
            raise _PeerGone(f"agent {inb.agent} was fenced")
        if why is None:
            try:
                why = self._move_requested(inb, op, ext)
            finally:
                # done with our memory before any answer goes out: a peer (or the owner,
                # seeing the notification) that revokes once it has the answer finds nothing
                # to wait for
                self._grants.leave(inb.state)
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

    def _move_requested(self, inb: _Inbound, op: Op, ext: Extents) -> str | None:
        """A granted request's bytes: sent after the "ok" (READ, in one call where it can) or
        received (WRITE); why not where an extent lies outside our memory."""
        try:
            staged = self._is_staged(ext, "requested extent")
        except ExtentOutOfBounds as exc:
            return str(exc)
        if op is Op.READ:
            # its last socket call leaves the gate as it ends, not once this thread has the GIL
            # back (up to seconds in a busy process): a revoke then finds nothing to cut
            self._send_ext(inb.conn, ext, inb.stopped, staged=staged, prefix=_A_FRAME,
                           halt=inb.state, gate=self._grants.gate)
        else:
            self._recv_ext(inb.conn, ext, inb.stopped, staged=staged)
        return None
