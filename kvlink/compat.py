"""Handshake-time compatibility: everything that must match, checked once per peer.

Unsupported combinations fail here — naming both sides' values — never per request and never
silently. Different block sizes are rejected (decision recorded in docs/heterogeneous-tp.md):
splitting pages across block boundaries would multiply descriptors by the head count for NHD and
buys little, since both instances of a deployment are configured by the same operator.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from kvlink.errors import IncompatibleSpecError
from kvlink.headmap import check_tp

WIRE_VERSION = 7  # 2: transfer lifecycle (grants, validate-after-read, push cancel)
#                  3: kept-open sessions, batches, READs validated without an intent
#                  4: the hold board (HandshakeResponse.board), calls that want no answer
#                     (Call.id 0), push digests and layer ranges on Notification
#                  5: the landing board (PushRequest.landing)
#                  6: digest areas on the landing board (LandingMsg.digests_at, _bytes)
#                  7: with a secret, a session's answers are sealed too (the server proves
#                     the key: an impostor at a peer's address cannot answer for it)


def compat_hash(geometry: dict[str, Any]) -> str:
    """Hash over the wire version and the geometry both sides must agree on."""
    blob = msgspec.json.encode({"wire": WIRE_VERSION, **geometry}, order="sorted")
    return hashlib.sha256(blob).hexdigest()[:16]


def check_compatible(
    local: dict[str, Any], remote: dict[str, Any], local_tp: int, remote_tp: int
) -> None:
    """Raise IncompatibleSpecError listing every mismatched key with both values."""
    def differs(key: str) -> bool:
        a, b = local.get(key), remote.get(key)
        return a != b and not (key == "layout" and "any" in (a, b))

    diffs = [
        f"{key}: local={local.get(key)!r} remote={remote.get(key)!r}"
        for key in sorted(set(local) | set(remote))
        if differs(key)
    ]
    if diffs:
        raise IncompatibleSpecError("KV caches are incompatible: " + "; ".join(diffs))
    if not local.get("mla"):
        heads = int(local["total_kv_heads"])
        check_tp(heads, local_tp, "local tp")
        check_tp(heads, remote_tp, "remote tp")
