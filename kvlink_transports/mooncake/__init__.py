"""``mooncake``: one-sided READ/WRITE through the Mooncake Transfer Engine.

The transport is :class:`~kvlink_transports.mooncake.transport.MooncakeTransport`; its module
says what it does. ``wire`` holds the descriptor, ``peer`` the per-peer thread that submits and
waits on sub-batches. This face hands on what others import from here.
"""

from kvlink_transports.mooncake.transport import PIP_HINT, MooncakeTransport, split_bounds

__all__ = ["PIP_HINT", "MooncakeTransport", "split_bounds"]
