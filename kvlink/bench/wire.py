"""The bench's control messages: versioned msgspec Structs, decoded strictly, framed and bounded.

Every frame is :data:`kvlink.sidechannel.FRAME` (a 4-byte little-endian length) and one
msgpack-encoded :data:`Message`, a tagged union (``type``). Decoding checks, in this order: the
frame's announced length against the reader's bound (before a byte of the body is read; the
body is then read as it arrives, never allocated at its announced length); the version ``v``
(:data:`PROTOCOL`: another one is a :class:`WireVersionError` saying both); the typed decode
(unknown fields, wrong types, out-of-bound values: a :class:`WireError` naming the field). A
frame once started must be whole within ``frame_timeout`` seconds. Nothing is pickled and no
payload is packed into a string: descriptors are ``bytes`` fields.

Authentication, with a shared secret (the server's :class:`Challenge` carries a nonce; without
a secret its nonce is empty and the client goes on with :class:`Hello`): the client answers
:class:`Auth` with a nonce of its own and HMAC-SHA256(secret, :data:`CLIENT_LABEL` || server
nonce || client nonce); the server proves itself in :class:`Welcome`, HMAC-SHA256(secret,
:data:`SERVER_LABEL` || client nonce || server nonce). Both nonces are fresh per connection, so
neither proof can be replayed; the labels keep them apart from each other and from every MAC
of the side channel. It authenticates the connection; it neither seals nor encrypts its frames.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import time
from typing import Annotated, Literal

import msgspec

from kvlink.errors import WireError, WireVersionError
from kvlink.sidechannel import FRAME
from kvlink.wire import (
    MAX_MESSAGE_BYTES,
    MAX_TEXT_LEN,
    MAX_TRANSPORTS,
    U63,
    Body,
    Name,
    Nonce,
    Port,
    Tag,
    Text,
)

#: the control port a server listens on and a client dials unless told otherwise
DEFAULT_PORT = 13370
#: bumped when a message changes: an older peer gets a clean "protocol N, this is M" error
#: (1 was JSON lines)
PROTOCOL = 2
#: a frame the server takes from a client (the largest, a Hello, is well under 2 KiB)
CLIENT_FRAME_BYTES = 64 << 10
#: a frame the client takes from the server (a Ready: nixl's metadata is a few KiB)
SERVER_FRAME_BYTES = MAX_MESSAGE_BYTES
FRAME_TIMEOUT = 10.0  # s from a frame's first byte to its last
#: seconds a control connection may be idle before the kernel probes its peer
#: (kvlink.sockets.keepalive): the server waits for a client's next message however long its
#: sweep runs, and a client whose host vanished held it — and every client behind it — forever
KEEPALIVE_S = 30.0
CLIENT_LABEL = b"kvlink-bench-client-v1"
SERVER_LABEL = b"kvlink-bench-server-v1"
_CHUNK = 256 << 10  # bytes one recv takes at most


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    v: int


class Challenge(_Msg, tag="challenge", frozen=True):
    """The server's first frame: a fresh nonce to answer with :class:`Auth`, or empty (this
    server has no secret: send :class:`Hello`)."""

    nonce: Nonce


class Auth(_Msg, tag="auth", frozen=True):
    nonce: Nonce  # the client's
    mac: Nonce  # proof(secret, CLIENT_LABEL, server nonce, client nonce)


class Welcome(_Msg, tag="welcome", frozen=True):
    mac: Nonce  # proof(secret, SERVER_LABEL, client nonce, server nonce)


class Hello(_Msg, tag="hello", frozen=True):
    """The client's buffer (the server allocates one of the same size) and transports."""

    total: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    memory: Literal["dram", "vram"]
    transports: Annotated[list[Tag], msgspec.Meta(max_length=MAX_TRANSPORTS)]


class Offer(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One transport of the server's: its descriptor and buffer address, or why not."""

    descriptor: Body = b""
    addr: U63 = 0
    error: Text | None = None


class Machine(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What the JSON says about the host a side ran on (:func:`kvlink.bench.facts.machine`)."""

    host: Text
    platform: Text
    arch: Text
    cpus: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] | None
    cpu_model: Text
    ucx_env: Annotated[dict[Text, Text], msgspec.Meta(max_length=1024)]


#: ``kvlink doctor``'s versions: a version, a distribution -> version map, or None
Versions = Annotated[
    dict[Tag, Text | Annotated[dict[Name, Text], msgspec.Meta(max_length=256)] | None],
    msgspec.Meta(max_length=256)]


class Ready(_Msg, tag="ready", frozen=True):
    transports: Annotated[dict[Tag, Offer], msgspec.Meta(max_length=MAX_TRANSPORTS)]
    versions: Versions
    machine: Machine
    command: Text
    host_id: Name


class PerftestStart(_Msg, tag="perftest_start", frozen=True):
    args: Annotated[list[Name], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list)


class PerftestReady(_Msg, tag="perftest_ready", frozen=True):
    port: Port
    command: Text


class PerftestEnd(_Msg, tag="perftest_end", frozen=True):
    pass


class PerftestEnded(_Msg, tag="perftest_ended", frozen=True):
    rc: Annotated[int, msgspec.Meta(ge=-(1 << 31), le=1 << 31)] | None


class Bye(_Msg, tag="bye", frozen=True):
    pass


class Error(_Msg, tag="error", frozen=True):
    message: Text


Message = (Challenge | Auth | Welcome | Hello | Ready | PerftestStart | PerftestReady
           | PerftestEnd | PerftestEnded | Bye | Error)


class _Version(msgspec.Struct):
    v: int | None = None  # unconstrained: another version is answered as such


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_version_decoder = msgspec.msgpack.Decoder(_Version)


def error(message: str) -> Error:
    """An :class:`Error` whose message fits its bound."""
    return Error(v=PROTOCOL, message=message[:MAX_TEXT_LEN])


def proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256(secret, label || first || second): one side's answer to the other's nonce."""
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def encode(msg: Message) -> bytes:
    """``msg`` as one length-prefixed frame."""
    body = _encoder.encode(msg)
    return FRAME.pack(len(body)) + body


def decode(buf: bytes, where: str) -> Message:
    """One frame's body, strictly: the version first, then the typed decode."""
    try:
        got = _version_decoder.decode(buf).v
        if got is None:
            raise WireError(f"malformed control frame from {where}: no version field `v`")
        if got != PROTOCOL:
            raise WireVersionError(
                f"{where} speaks kvlink bench protocol {got}, this side {PROTOCOL}: run the "
                "same kvlink version on both hosts")
        msg: Message = _decoder.decode(buf)
        return msg
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError(f"malformed control frame from {where}: {type(exc).__name__}: "
                        f"{exc}") from None


class Conn:
    """The bench's control connection: one :data:`Message` per frame over a TCP socket."""

    def __init__(self, sock: socket.socket, peer: str, bound: int,
                 frame_timeout: float = FRAME_TIMEOUT) -> None:
        self.sock, self.peer, self.bound = sock, peer, bound
        self.frame_timeout = frame_timeout

    def send(self, msg: Message) -> None:
        self.sock.settimeout(self.frame_timeout)  # a peer that reads nothing ends it too
        self.sock.sendall(encode(msg))

    def recv(self, timeout: float | None) -> Message:
        """The next message, its first byte within ``timeout`` (None: however long that takes;
        that wait's end is a TimeoutError), the rest within ``frame_timeout``. EOFError: the
        peer closed between frames; WireError: the frame is over the bound, cut, late or
        malformed."""
        self.sock.settimeout(timeout)
        first = self.sock.recv(FRAME.size)
        if not first:
            raise EOFError(f"{self.peer} closed the control connection")
        deadline = time.monotonic() + self.frame_timeout
        head = self._read(bytearray(first), FRAME.size, deadline)
        (n,) = FRAME.unpack(head)
        if n > self.bound:
            hint = (" (it looks like JSON: a kvlink bench of protocol 1? run the same kvlink "
                    "version on both hosts)") if head[:1] == b"{" else ""
            raise WireError(f"control frame of {n} B from {self.peer} exceeds the "
                            f"{self.bound} B bound{hint}")
        return decode(bytes(self._read(bytearray(), n, deadline)), self.peer)

    def _read(self, buf: bytearray, n: int, deadline: float) -> bytearray:
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"control frame from {self.peer} not complete within "
                                f"{self.frame_timeout:g} s ({len(buf)} of {n} B)")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(min(n - len(buf), _CHUNK))
            except TimeoutError:
                continue  # the deadline check above says it
            if not chunk:
                raise WireError(f"control frame from {self.peer} cut after {len(buf)} of "
                                f"{n} B: the connection closed")
            buf += chunk
        return buf

    def refuse(self, message: str, drain: float = 1.0) -> None:
        """Send ``message`` as an :class:`Error`, then end our half and read (and drop) what the
        peer still sends for up to ``drain`` seconds, so that closing does not reset the
        connection before the error arrived. The caller closes."""
        with contextlib.suppress(OSError):
            self.send(error(message))
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + drain
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv(_CHUNK):
                    break

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
