"""The nixl descriptor: what a peer learns of us at the handshake, and its checks.

A versioned msgspec struct: the agent's NIXL metadata, the host identity, the backends, and
the table of registered regions, which bounds every remote extent we later post against that
peer. Separate because it is the one thing of this transport that crosses a socket: decoding
it is where a hostile peer's bytes are checked, before anything else of ours sees them.
"""

from __future__ import annotations

import msgspec

from kvlink.errors import WireError
from kvlink.wire import decode_versioned
from kvlink_transports.nixl.memory import _mem_of

_VERSION = 1
_MAX_DESCRIPTOR = 64 << 20
_MAX_REGIONS = 1 << 16


class _RegionWire(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: int
    nbytes: int
    device: str


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    host: str
    metadata: bytes
    backends: list[str]
    regions: list[_RegionWire]


_enc = msgspec.msgpack.Encoder()


def _decode_descriptor(buf: bytes) -> _Descriptor:
    desc = decode_versioned(buf, _Descriptor, _VERSION, "nixl descriptor", _MAX_DESCRIPTOR)
    if not desc.agent or not desc.metadata:
        raise WireError("nixl descriptor lacks the agent name or its metadata")
    if len(desc.regions) > _MAX_REGIONS:
        raise WireError(f"nixl descriptor offers {len(desc.regions)} regions (max {_MAX_REGIONS})")
    for r in desc.regions:
        if not (0 < r.addr < 1 << 64 and 0 < r.nbytes < 1 << 64 and r.addr + r.nbytes < 1 << 64):
            raise WireError(f"nixl descriptor region [{r.addr:#x}, +{r.nbytes}) is invalid")
        _mem_of(r.device, WireError)
    return desc
