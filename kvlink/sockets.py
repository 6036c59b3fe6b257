"""Small socket helpers shared by the side channel and the tcp transport."""

from __future__ import annotations

import socket


def shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` (close() alone would not) and end the stream."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
