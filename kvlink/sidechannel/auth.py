"""Who may talk to a side channel: the shared secret, the MAC of a lone ``Signed`` message,
a kept-open connection's session key and its ``Sealed`` frames, single-use nonces, and what
counts as loopback (bound without a secret). The rules are :mod:`kvlink.sidechannel`'s."""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import os
import secrets
import time

from kvlink import wire
from kvlink.errors import AuthError

SESSION_LABEL = b"kvlink-session-v1"
#: the label of a session's answer key (:func:`answer_key`): the server seals its answers
#: under a key of their own, so a client's sealed frame reflected back is no answer
ANSWER_LABEL = b"kvlink-answers-v1"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secret_from_env(explicit: bytes | str | None = None) -> bytes | None:
    """The shared secret: explicit config wins, then ``KVLINK_SECRET``; None when neither."""
    value = explicit if explicit is not None else os.environ.get("KVLINK_SECRET")
    if value is None or value == "":
        return None
    return value.encode() if isinstance(value, str) else value


def _mac(secret: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, nonce + body, hashlib.sha256).digest()


def session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The key of one kept-open connection: both sides' nonces in it, so neither picks it."""
    return hmac.new(secret, SESSION_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def answer_key(key: bytes) -> bytes:
    """The key a session's answers are sealed with (the server's side of the session)."""
    return hmac.new(key, ANSWER_LABEL, hashlib.sha256).digest()


def seal_mac(key: bytes, counter: int, body: bytes) -> bytes:
    return hmac.new(key, counter.to_bytes(8, "little") + body, hashlib.sha256).digest()


def seal(key: bytes, counter: int, msg: wire.Batch | wire.Replies | bytes) -> wire.Sealed:
    """``msg`` (or its encoding) under a session key, as frame number ``counter``."""
    body = msg if isinstance(msg, bytes) else wire.encode(msg)
    return wire.Sealed(v=wire.WIRE_VERSION, counter=counter, mac=seal_mac(key, counter, body),
                       body=body)


def unseal_answers(key: bytes, after: int, sealed: wire.Sealed, where: str) -> wire.Replies:
    """The answers a server sealed under ``key`` (:func:`answer_key`), frame ``after + 1``
    or later; raises AuthError for a frame the session's server did not seal (a MAC that
    fails: whoever answered does not hold the secret) or one replayed or reordered."""
    if sealed.counter <= after:
        raise AuthError(f"{where} answered frame {sealed.counter} after {after}: replayed or "
                        "reordered")
    if not hmac.compare_digest(sealed.mac, seal_mac(key, sealed.counter, sealed.body)):
        raise AuthError(f"{where} answered under another key: it does not hold our secret")
    return wire.decode(sealed.body, wire.Replies)


class _Nonces:
    """Outstanding single-use nonces with an expiry (bounded, so a flood cannot grow memory)."""

    def __init__(self, ttl: float = 30.0, limit: int = 4096) -> None:
        self.ttl = ttl
        self._issued: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._limit = limit

    def issue(self) -> bytes:
        nonce = secrets.token_bytes(16)
        self._issued[nonce] = time.monotonic() + self.ttl
        while len(self._issued) > self._limit:
            self._issued.popitem(last=False)
        return nonce

    def redeem(self, nonce: bytes) -> bool:
        deadline = self._issued.pop(nonce, None)
        return deadline is not None and time.monotonic() <= deadline
