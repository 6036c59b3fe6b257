"""``tcp``: one-sided READ/WRITE emulated over plain TCP; works anywhere with only the core deps.

The transport is :class:`~kvlink_transports.tcp.transport.TcpTransport`; its module says what
it does and how the package splits it: ``wire`` (headers, framing), ``memory`` (registered
memory and the byte movers), ``client`` (the initiator's per-peer threads), ``server`` (the
accept and serving threads). This face hands on what others import from here, the wire
names included (``bench/fuzz_tcp.py`` forges headers with them).
"""

from kvlink_transports.tcp.transport import TcpTransport
from kvlink_transports.tcp.wire import _VERSION, _Descriptor, _enc, _Hdr

__all__ = ["_VERSION", "TcpTransport", "_Descriptor", "_Hdr", "_enc"]
