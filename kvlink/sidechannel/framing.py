"""The side channel's framing: a 4-byte little-endian length, then one :mod:`kvlink.wire`
message; the bounds a frame is read under (see :mod:`kvlink.sidechannel`); ending a stream's
write half. Shared by the server and the one-shot client."""

from __future__ import annotations

import socket
import struct

from kvlink import wire

FRAME = struct.Struct("<I")  # a frame's length prefix
#: a frame's bound until its connection authenticated (Hello, Challenge, Signed handshakes)
PREAUTH_BYTES = 64 << 10
#: a request frame's bound after (a Batch of many calls; replies may be wire.MAX_MESSAGE_BYTES)
REQUEST_BYTES = 8 << 20  # a call with wire.MAX_BLOCK_IDS block ids encodes to about 5 MiB
_SCRATCH = 256 << 10  # bytes one recv takes at most


def frame(msg: wire._Msg) -> bytes:
    """``msg`` as one length-prefixed frame."""
    body = wire.encode(msg)
    return FRAME.pack(len(body)) + body


def shutdown_write(sock: socket.socket) -> None:
    """End our half of the stream (what was sent still arrives), keep reading."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
