"""The mooncake descriptor: what a peer learns of us at the handshake, and its checks.

A versioned msgspec struct: the engine's session id (``host:rpc_port``), the protocol and the
table of registered regions, which bounds every remote extent we later post against that peer.
Separate because it is the one thing of this transport that crosses a socket: decoding it is
where a peer's bytes are checked, before the transport or a peer thread sees them.
"""

from __future__ import annotations

import msgspec

from kvlink.errors import ConfigError, WireError
from kvlink.wire import decode_versioned

_VERSION = 1
_MAX_DESCRIPTOR = 64 << 20
_MAX_REGIONS = 1 << 16
_PROTOCOLS = ("tcp", "rdma")


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    session: str  # engine session id: host:rpc_port
    protocol: str
    regions: list[tuple[int, int, str]]


_enc = msgspec.msgpack.Encoder()


def _decode_descriptor(buf: bytes) -> _Descriptor:
    desc = decode_versioned(buf, _Descriptor, _VERSION, "mooncake descriptor", _MAX_DESCRIPTOR)
    host, _, port = desc.session.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError(f"mooncake descriptor session {desc.session!r} is not host:port")
    if desc.protocol not in _PROTOCOLS:
        raise WireError(
            f"mooncake descriptor protocol {desc.protocol!r} is not one of {_PROTOCOLS}"
        )
    if len(desc.regions) > _MAX_REGIONS:
        raise WireError(
            f"mooncake descriptor offers {len(desc.regions)} regions (max {_MAX_REGIONS})"
        )
    for addr, nbytes, device in desc.regions:
        if not (0 < addr < 1 << 64 and 0 < nbytes < 1 << 64 and addr + nbytes < 1 << 64):
            raise WireError(f"mooncake descriptor region [{addr:#x}, +{nbytes}) is invalid")
        _location(device, "cpu", WireError)
    return desc


def _location(device: str, cpu_location: str, exc: type[Exception] = ConfigError) -> str:
    """Region.device -> register_memory location: cpu -> the ``location`` option, cuda:N."""
    kind, _, idx = device.partition(":")
    if kind == "cpu" and not idx:
        return cpu_location
    if kind == "cuda" and (not idx or idx.isdigit()):
        return f"cuda:{int(idx or 0)}"
    raise exc(f"region device {device!r} is not 'cpu' or 'cuda:N'")
