"""The side channel: handshakes and notifications over plain TCP, bounded before authentication.

Each producer (and, in push mode, each consumer) runs one :class:`SideChannelServer`: one
thread, one listening TCP port, every connection read non-blocking from one ``selectors`` loop.
Every frame is a 4-byte little-endian length (:data:`FRAME`) and one :mod:`kvlink.wire`
message; each frame is answered by one frame, in order. The same port serves one-shot calls
(:func:`request`: connect, one exchange, close — handshakes) and the kept-open connections of
:mod:`kvlink.channel` (one per peer, every per-request message). The server's thread is the one
that answers: a frame wakes it out of ``epoll`` with the GIL released, no I/O-thread hops. The
handler runs on that thread, one message at a time, for every peer: it must not block.

Who may connect: the handshake hands out what is needed to reach registered memory, so with a
shared secret (config or ``KVLINK_SECRET``) a connection authenticates before anything but a
handshake-sized frame is read: ``Hello`` (client nonce) -> ``Welcome`` (server nonce), a key
derived from both, then :class:`wire.Sealed` frames, HMAC-SHA256 over a counter that only grows
(replayed and reordered frames are refused), both ways: the server seals its answers under a
key of their own (:func:`~kvlink.sidechannel.auth.answer_key`), so a client takes no answer
from whoever holds the address without the secret (a process bound there after the peer
died, a forger on the path) — an unsealed ``ErrorReply`` can only fail its calls. A lone
:class:`wire.Signed` message (single-use server nonce from a ``Challenge``) is taken too (its
answer is not sealed: no kvlink client sends one). Without a secret the server binds loopback
only, unless told explicitly that the network is trusted (then it warns).

Bounds, with and without a secret (issue 20, item 4): a frame's body is read as it arrives —
never allocated at its announced length — and a length over the connection's bound is answered
by an ``ErrorReply`` (code ``too_large``) naming the bound, then the connection is closed (the
stream cannot resync). With a secret the bound is :data:`PREAUTH_BYTES` until the connection
authenticated (its first valid ``Sealed`` or ``Signed`` frame), :data:`REQUEST_BYTES` after;
without one, :data:`REQUEST_BYTES` from the first frame (and the connection counts as
authenticated at its first message). A frame started must be complete within
``frame_timeout``; a connection must authenticate within ``auth_timeout`` of its accept;
authenticated connections may idle. At most ``max_pending`` connections wait to authenticate —
one more closes the oldest of them, so idle sockets cannot lock a legitimate peer out — and at
most ``max_connections`` in all (beyond: the oldest unauthenticated one is closed, or, with
none, the new one refused). So before authentication the server holds at most ``max_pending``
x 64 KiB of frames (4 MiB); an authenticated peer may hold 4 MiB per connection. Closes and
refusals are logged, at most one line a second of each kind.

Why no ZMQ any more: ZMQ's ``MAXMSGSIZE`` bounds each frame of a multipart message, not the
message, and no libzmq option bounds a whole one — 24 frames of 15 MiB were buffered (360 MiB,
three peers 1.2 GB) inside libzmq before any of our code, secret or not, saw a byte.

The package, a module per job, bottom to top: :mod:`~kvlink.sidechannel.framing` (the length
prefix, the frame bounds, a frame), :mod:`~kvlink.sidechannel.auth` (the shared secret, MACs,
session keys, sealed batches, single-use nonces, loopback), :mod:`~kvlink.sidechannel.server`
(:class:`SideChannelServer`: its ``selectors`` loop, ``serve_ready``, the bounds, eviction and
sweeps above) and :mod:`~kvlink.sidechannel.client` (:func:`request`, the one-shot call). This
face hands on every name other code imports from ``kvlink.sidechannel``; a test that patches a
module's attribute patches it where it lives.
"""

from kvlink.sidechannel.auth import (
    ANSWER_LABEL,
    SESSION_LABEL,
    _mac,
    answer_key,
    is_loopback,
    seal,
    seal_mac,
    secret_from_env,
    session_key,
    unseal_answers,
)
from kvlink.sidechannel.client import _exchange, request
from kvlink.sidechannel.framing import FRAME, PREAUTH_BYTES, REQUEST_BYTES, frame, shutdown_write
from kvlink.sidechannel.server import (
    AUTH_TIMEOUT,
    FRAME_TIMEOUT,
    KEEPALIVE_S,
    MAX_CONNECTIONS,
    MAX_PENDING,
    Handler,
    SideChannelServer,
)

__all__ = [
    "ANSWER_LABEL", "AUTH_TIMEOUT", "FRAME", "FRAME_TIMEOUT", "KEEPALIVE_S", "MAX_CONNECTIONS",
    "MAX_PENDING", "PREAUTH_BYTES", "REQUEST_BYTES", "SESSION_LABEL", "Handler",
    "SideChannelServer", "_exchange", "_mac", "answer_key", "frame", "is_loopback", "request",
    "seal", "seal_mac", "secret_from_env", "session_key", "shutdown_write", "unseal_answers",
]
