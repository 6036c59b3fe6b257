"""Typed exceptions.

Every error a caller can act on has its own type, and every message names the offending value
(and, for mismatches, both sides' values) so a log line is enough to fix a deployment.
"""

from __future__ import annotations


class KVLinkError(Exception):
    """Base of every error kvlink raises on purpose."""

    code: str = ""  # a peer's ErrorReply code, when the error is its answer

class ConfigError(KVLinkError, ValueError):
    """A configuration value is invalid (names the key and the value)."""


class LayoutError(KVLinkError, ValueError):
    """A KV cache tensor or spec cannot be described by kvlink's layout model."""


class BlockIdOutOfRange(KVLinkError, IndexError):
    """A block id lies outside ``[0, num_blocks)`` of the cache it addresses."""


class ExtentOutOfBounds(KVLinkError, ValueError):
    """A requested byte range is not inside memory that was registered and offered."""


class UnknownTransportError(KVLinkError, LookupError):
    """A transport name is not registered (the message lists the registered ones)."""


class TransportUnavailable(KVLinkError):
    """A transport is registered but cannot work here or for this peer (library, host, memory)."""


class WireError(KVLinkError, ValueError):
    """A message could not be decoded: malformed, oversized, or of an unknown type."""


class WireVersionError(WireError):
    """A message carries a wire version this build does not speak."""


class HandshakeError(KVLinkError):
    """The handshake with a peer failed."""


class IncompatibleSpecError(HandshakeError):
    """The two sides' KV caches cannot exchange blocks (the message names both values)."""


class SideChannelError(KVLinkError):
    """The side channel failed (bind, send, or an error answer from the peer)."""


class TransferRefused(KVLinkError):
    """The producer refused a transfer (not held, released, blocks it does not hold)."""


class TransferCancelled(KVLinkError):
    """A push the consumer cancelled (or that passed its deadline) must not be posted."""


class PeerUnreachable(SideChannelError, TimeoutError):
    """No answer from a peer's side channel before the deadline (names host:port and timeout)."""


class AuthError(SideChannelError):
    """A peer failed authentication on the side channel."""


class TransferError(KVLinkError):
    """A posted transfer failed; the reason names the peer and the cause."""


class AllReduceError(KVLinkError):
    """The custom all-reduce cannot run for this input or process group."""
