"""The tcp wire: headers, the descriptor, and framing them over a socket.

Every message is a 4-byte little-endian length and a msgpack header (:class:`_Hdr`): H hello
(the memory key), R read, W write, N notification, and the answers A (ok) and E (error, with
a reason); a READ's bytes follow its A, a WRITE's bytes follow its header. The limits here
bound what a peer can make us allocate before and after it authenticates. Separate because it
is what both ends of a connection share (the initiator in ``client``, the owner in
``server``) and all that crosses the socket besides the bytes themselves.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import time

import msgspec

from kvlink.errors import WireError
from kvlink.transport import EXTENT_DTYPE

_VERSION = 2  # 2: R/W headers carry the grant's ticket
_LEN = struct.Struct("<I")
_MAX_HELLO = 4 << 10  # the first header of a connection, read before its memory key is checked
_MAX_EXTENTS = 1 << 20  # extents per R/W request; a longer transfer goes as several requests
_MAX_HEADER = _MAX_EXTENTS * EXTENT_DTYPE.itemsize + (1 << 20)  # one header, once authenticated
_MAX_REPLY = 64 << 10  # an A/E answer, on the initiator's side
_MAX_REASON = 1024  # characters of a refusal's reason sent back
_GROW = 1 << 20  # a longer header is buffered as its bytes arrive, not at its announced size


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


def _frame(hdr: _Hdr) -> bytes:
    body = _enc.encode(hdr)
    return _LEN.pack(len(body)) + body


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(frame)


def _send_hdr(sock: socket.socket, hdr: _Hdr) -> None:
    _send_frame(sock, _frame(hdr))


#: the owner's "ok" answer to a request, as framed on the wire: the same bytes every time, so
#: it goes out in one call with a READ's bytes and the initiator expects it the same way (an
#: E answer is never shorter: its reason is what differs)
_A_FRAME = _frame(_Hdr(_VERSION, "A"))


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


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):  # (a wait to send or to receive: either direction)
        return f"stalled: no bytes moved within {timeout:.1f}s"
    if isinstance(exc, OSError):
        return f"connection lost ({exc.strerror or exc})"
    return str(exc)


#: both socket buffers of a connection between two processes of one host: 4 MiB, as tcp set
#: on every connection before. 1 MiB READ 160 MiB faster on 127.0.0.1 at the transport layer
#: (bench/tcp_buffers.py, bench/results/tcp_socket_buffers/) but not measurably through the
#: public API. (The CI failure once seen with 1 MiB — a connection cut under a revoked grant —
#: was a Python-served READ's thread marked serving while it waited for the GIL, fixed by
#: serve_move in kvlink/_gate.c; the size is left as it is, the option sets any size.)
SAME_HOST_BUFFER = 4 << 20


def _same_host(sock: socket.socket) -> bool:
    """The connection's other end is on this host: a loopback address, or our own."""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
        return peer == local or ipaddress.ip_address(peer).is_loopback
    except (OSError, ValueError):
        return False


def _tune(sock: socket.socket, buffer_bytes: int | None = None) -> None:
    """No Nagle delay, and the socket buffers: ``buffer_bytes`` (tcp option
    ``socket_buffer_bytes``; 0: the kernel's), or where it is None, :data:`SAME_HOST_BUFFER`
    between two processes of one host and the kernel's autotuning between hosts — setting a
    size turns autotuning off, and where ``net.core.rmem_max`` is the common default (208
    KiB) clamps the buffer to twice that: a ceiling of ~416 KiB per round trip."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = buffer_bytes
    if size is None:
        size = SAME_HOST_BUFFER if _same_host(sock) else 0
    if size:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
