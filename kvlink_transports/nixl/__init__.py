"""``nixl``: one-sided READ/WRITE through NVIDIA NIXL (UCX backend by default).

The transport is :class:`~kvlink_transports.nixl.transport.NixlTransport`; its module says
what it does and which module of this package holds each of its jobs. This face hands on the
names the rest of kvlink (and the ``kvlink.transports`` entry point) import from here.
"""

from kvlink_transports.nixl.agent import PIP_HINT, quiet_third_party_logs
from kvlink_transports.nixl.transport import NixlTransport

__all__ = ["PIP_HINT", "NixlTransport", "quiet_third_party_logs"]
