"""Our registered memory, and moving bytes between it and a socket, direct or staged.

Host memory moves straight between registered memory and the socket, the kernel gathering
and scattering (no user-space copy): through kvlink's C helper ``move_extents``
(:mod:`kvlink.native`: ``sendmsg``/``readv`` over the extent array itself, the GIL released
for up to ``_STOP_EVERY`` bytes at a time), or where it is not built through CPython's
``sendmsg``/``recvmsg_into`` over memoryviews, ``_IOV`` made at a time and ``_WINDOW`` handed
to a call. Device memory (or, for tests, host memory with option
``stage_host_memory``) moves through a bounded pool of pinned host buffers
(:mod:`kvlink.staging`). Every extent is bounds-checked against the registered regions before
a byte moves, ``_CHECK`` extents a numpy pass. Separate because both sides use it, the
initiator for its local extents and the owner for the extents a peer asks for, and because it
is the one place that touches our memory.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType

import numpy as np
import numpy.typing as npt

from kvlink import hostmem, native, staging
from kvlink.errors import ExtentOutOfBounds, TransportUnavailable
from kvlink.transport import (
    EXTENT_DTYPE,
    Extents,
    Region,
    RegionTable,
    Transport,
    make_extents,
)
from kvlink_transports.tcp.wire import _PeerGone, _recv_exact

_IOV = 512  # memoryviews made at a time (IOV_MAX is 1024 on Linux)
#: buffers handed to one socket call: a call moves at most a socket buffer's worth, yet takes
#: (and gives back) every buffer it is handed — 512 each time cost more than the bytes
_WINDOW = 64
_CHECK = 1 << 16  # extents per numpy pass of a check: its temporaries are O(this), not O(request)
#: bytes one call of the C helper moves before ``stop`` is asked again: how much of our memory
#: a revoked connection may still write (a revoke that waits past tcp's grace shuts the socket,
#: which ends the call); each call takes the GIL back once, which a busy caller's thread holds
#: for up to a switch interval
_STOP_EVERY = 4 << 20


class _Memory:
    """Registered regions: as memoryviews, so an extent becomes a slice (no per-extent
    ctypes), or (the C helper) as the addresses the bounds check vouched for."""

    def __init__(self, regions: Sequence[Region], staged_host: bool = False) -> None:
        self.table = RegionTable(regions)
        self.views = [hostmem.view(r.addr, r.nbytes) for r in self.table.regions]
        #: every region of one memory kind: an extent's kind is known once it is located
        self.one_kind = len({r.memory_kind for r in self.table.regions}) == 1
        self.native: ModuleType | None = native.load()
        #: the regions' ranges where every byte moves straight between them and a socket (host
        #: memory, not staged): what the owner's C serving loop serves READs from
        self.direct = (None if staged_host or any(r.memory_kind != "cpu" for r in regions)
                       else (self.table.starts, self.table.ends))

    def move(self, sock: socket.socket, ext: Extents, send: bool,
             stop: Callable[[], bool] | None, prefix: bytes = b"",
             halt: npt.NDArray[np.uint32] | None = None,
             done: npt.NDArray[np.uint32] | None = None) -> bytes | None:
        """Send the bytes of ``ext`` (``send``), or receive straight into them; every extent
        checked in registered memory first (:meth:`_LocalMemory._is_staged`). ``prefix``:
        sent before them, or (receiving) the bytes expected before them — returned as they
        came where they differ, nothing more read. ``halt``: a word ``stop`` sets too, read
        by the C helper between its socket calls (then one call moves the whole request).
        ``done``: a word the C helper sets to 1 once every byte moved (none set without it)."""
        if self.native is not None and ext.dtype == EXTENT_DTYPE:
            return _move_native(self.native, sock, ext, send, stop, prefix, halt, done)
        if send:
            if prefix:
                sock.sendall(prefix)
            _send_views(sock, self._batches(ext), stop)
            return None
        came = _expected(sock, prefix)
        if came is None:
            _recv_views(sock, self._batches(ext), stop)
        return came

    def _batches(self, ext: Extents) -> Iterator[list[memoryview]]:
        """The slices of ``ext`` (checked), ``_IOV`` at a time as they are consumed: O(batch)
        Python objects and O(_CHECK) numpy temporaries, not one memoryview per extent for the
        whole request. Empty extents are left out: a socket call handed only empty buffers
        moves 0 bytes, which a send would retry for ever and a receive read as the peer's
        close (the C helper skips them too)."""
        starts, views = self.table.starts, self.views
        for k in range(0, ext.shape[0], _CHECK):
            chunk = ext[k : k + _CHECK]
            idx = self.table.locate(chunk)
            moving = chunk["len"] > 0
            if not moving.all():
                chunk, idx = chunk[moving], idx[moving]
            for j in range(0, chunk.shape[0], _IOV):
                part, at = chunk[j : j + _IOV], idx[j : j + _IOV]
                off = (part["addr"] - starts[at]).tolist()
                yield [views[i][o : o + n]
                       for i, o, n in zip(at.tolist(), off, part["len"].tolist())]


def _move_native(
    helpers: ModuleType, sock: socket.socket, ext: Extents, send: bool,
    stop: Callable[[], bool] | None, prefix: bytes = b"",
    halt: npt.NDArray[np.uint32] | None = None, done: npt.NDArray[np.uint32] | None = None,
) -> bytes | None:
    """Move ``ext``'s bytes (checked) through the C helper, with the socket's timeout for
    each wait: in one call where nothing can stop it or ``halt`` lets the helper see a stop
    itself, else ``_STOP_EVERY`` bytes a call. Each call takes the GIL back once when it
    returns, which waits up to a switch interval where this process's own Python is busy (a
    prefill's forward): 40 of them for a 160 MiB READ served under a stop, before ``halt``.
    ``prefix`` as :meth:`_Memory.move`."""
    ext = np.ascontiguousarray(ext)  # (a view of a request's header already is)
    timeout = sock.gettimeout()
    ms = -1 if timeout is None else max(1, int(timeout * 1000))
    budget = _STOP_EVERY if stop is not None and halt is None else 1 << 62
    fd, n = sock.fileno(), ext.shape[0]
    at: tuple[int, int] | bytes | None = (0, 0)
    first = prefix or None
    while isinstance(at, tuple) and (at[0] < n or first):
        if stop is not None and stop():
            raise _PeerGone("access revoked mid-transfer")
        at = helpers.move_extents(fd, send, ext, at[0], at[1], budget, ms, first, halt, done)
        first = None
    if at is None:
        raise _PeerGone("connection closed by peer mid-transfer")
    return at if isinstance(at, bytes) else None


def _expected(sock: socket.socket, expect: bytes) -> bytes | None:
    """Read ``len(expect)`` bytes (Python's side of the C helper's prefix): None where they
    are ``expect``, else what came instead."""
    if not expect:
        return None
    came = bytes(_recv_exact(sock, len(expect)))
    return None if came == expect else came


def _send_views(
    sock: socket.socket, batches: Iterable[list[memoryview]],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Send ``batches``; ``stop`` (checked before every socket call) ends it early."""
    for batch in batches:
        i, n = 0, len(batch)
        while i < n:
            if stop is not None and stop():
                raise _PeerGone("access revoked mid-transfer")
            i = _advance(batch, i, sock.sendmsg(batch[i:i + _WINDOW]))


def _recv_views(
    sock: socket.socket, batches: Iterable[list[memoryview]],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Receive straight into ``batches``; ``stop`` (checked before every socket call) ends it
    early, so a revoked connection writes no more of our memory than one call's worth."""
    for batch in batches:
        i, n = 0, len(batch)
        while i < n:
            if stop is not None and stop():
                raise _PeerGone("access revoked mid-transfer")
            got = (sock.recvmsg_into(batch[i:i + _WINDOW])[0] if n - i > 1
                   else sock.recv_into(batch[i]))
            if got == 0:
                raise _PeerGone("connection closed by peer mid-transfer")
            i = _advance(batch, i, got)


def _advance(batch: list[memoryview], i: int, moved: int) -> int:
    """The first buffer of ``batch`` (from ``i``) that ``moved`` bytes did not fill; a
    partly moved one is replaced by its rest."""
    while moved and moved >= len(batch[i]):
        moved -= len(batch[i])
        i += 1
    if moved:
        batch[i] = batch[i][moved:]
    return i


class _LocalMemory(Transport):
    """Registration and the byte movers, as methods of the transport."""

    timeout: float  # timeout_s: a staged copy waits at most this long
    _memory: _Memory
    _regions: tuple[Region, ...]
    _copier: staging.Copier | None  # set once staging is on
    _pool: staging.PinnedPool | None
    _chunk: int  # bytes of one staging buffer

    def register(self, regions: Sequence[Region]) -> None:
        devices = {r.device for r in regions if r.memory_kind != "cpu"}
        if len(devices) > 1 or any(not d.startswith("cuda") for d in devices):
            raise TransportUnavailable(f"tcp stages one CUDA device at most; got {sorted(devices)}")
        if devices:
            self._enable_staging(int(devices.pop().split(":")[1]))
        elif self.options["stage_host_memory"]:
            # host memory through the staging pipeline: how CI exercises it without a GPU
            self._enable_staging(None)
        self._regions = self._regions + tuple(regions)
        self._memory = _Memory(self._regions, bool(self.options["stage_host_memory"]))

    def _enable_staging(self, device: int | None) -> None:
        """VRAM (or, for tests, host memory) moves through a bounded pool of host buffers."""
        if self._copier is not None:
            return
        chunk = int(self.options["staging_chunk"])
        count = int(self.options["staging_buffers"])
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
        """Bounds-check ``ext`` against registered memory; True if it moves through staging.
        The check every byte mover relies on (each side runs it once a request)."""
        table, kinds, one = self._memory.table, set[str](), self._memory.one_kind
        for k in range(0, ext.shape[0], _CHECK):
            idx = table.locate(ext[k : k + _CHECK], what if not k else f"{what} {k}+")
            kinds.update(table.regions[int(i)].memory_kind
                         for i in (idx[:1] if one else np.unique(idx)))
        if not kinds:
            return False
        if len(kinds) > 1:
            raise ExtentOutOfBounds(f"one transfer mixes memory kinds {sorted(kinds)}")
        device = kinds.pop() != "cpu"
        return self._copier is not None and (device or bool(self.options["stage_host_memory"]))

    def _send_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None,
        staged: bool | None = None, prefix: bytes = b"",
        halt: npt.NDArray[np.uint32] | None = None, gate: object | None = None,
    ) -> None:
        """Send ``ext``'s bytes, after ``prefix``; ``staged``: what :meth:`_is_staged`
        answered for it (None: check it now); ``halt`` as :meth:`_Memory.move`. ``gate`` (the
        owner's grant gate, ``halt`` the state it marked this connection serving in): the
        request's last socket call is the C helper's, which leaves the gate as it ends
        (``serve_move``), so the gate never shows serving a thread that only waits for the GIL
        — a revoke would cut its connection, failing the peer's next request."""
        helpers = self._memory.native if gate is not None and halt is not None else None
        if self._is_staged(ext) if staged is None else staged:
            assert self._copier is not None and self._pool is not None
            left = int(ext["len"].sum())

            def send(mv: memoryview) -> None:
                nonlocal left
                if stop is not None and stop():
                    raise _PeerGone("access revoked mid-transfer")
                left -= len(mv)
                if helpers is not None and left == 0:  # the last chunk
                    self._serve_last(helpers, sock, gate, halt,
                                     make_extents(hostmem.address_of(mv), len(mv)), b"")
                else:
                    sock.sendall(mv)

            if prefix:
                sock.sendall(prefix)
            staging.send_staged(send, ext, self._copier, self._pool, self._chunk, self.timeout)
        elif helpers is not None and ext.dtype == EXTENT_DTYPE:  # (checked: _is_staged)
            self._serve_last(helpers, sock, gate, halt, ext, prefix)
        else:
            self._memory.move(sock, ext, True, stop, prefix, halt)

    def _serve_last(self, helpers: ModuleType, sock: socket.socket, gate: object,
                    state: npt.NDArray[np.uint32] | None, ext: Extents, prefix: bytes) -> None:
        """``prefix`` and ``ext``'s bytes (host memory, checked) sent by the C helper, which
        leaves ``gate`` as it ends (``serve_move``)."""
        ms = max(1, int(self.timeout * 1000))
        sent = helpers.serve_move(sock.fileno(), gate, state, np.ascontiguousarray(ext), ms,
                                  prefix)
        if sent is None:
            raise _PeerGone("connection closed by peer mid-transfer")
        if not sent:
            raise _PeerGone("access revoked mid-transfer")

    def _recv_ext(
        self, sock: socket.socket, ext: Extents, stop: Callable[[], bool] | None = None,
        staged: bool | None = None, expect: bytes = b"",
        done: npt.NDArray[np.uint32] | None = None,
    ) -> bytes | None:
        """Receive into ``ext`` the bytes that follow ``expect``; what came instead of
        ``expect`` where it differs (nothing more read); ``staged`` as for
        :meth:`_send_ext`, ``done`` as for :meth:`_Memory.move`."""
        if self._is_staged(ext) if staged is None else staged:
            assert self._copier is not None and self._pool is not None
            came = _expected(sock, expect)
            if came is not None:
                return came
            staging.recv_staged(lambda mv: _recv_views(sock, [[mv]], stop), ext, self._copier,
                                self._pool, self._chunk, self.timeout)
            return None
        return self._memory.move(sock, ext, False, stop, expect, done=done)
