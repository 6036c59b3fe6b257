"""Small socket helpers shared by the side channel, the tcp transport and the bench."""

from __future__ import annotations

import socket

#: probes a kept-open connection takes unanswered before the kernel ends it (see keepalive)
KEEPALIVE_PROBES = 4


def keepalive(sock: socket.socket, idle_s: float) -> None:
    """Have the kernel probe ``sock`` once it has been idle ``idle_s`` seconds (0: never), every
    quarter of that, and end it after :data:`KEEPALIVE_PROBES` unanswered: a peer host that
    vanished without closing (powered off, cut off, a spot instance taken back) is then an
    error on the connection in about twice ``idle_s``, where a wait for its next message
    lasted forever — and held its thread, its descriptor and one of ``max_connections``."""
    if idle_s <= 0:
        return
    idle = max(1, int(idle_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # (Linux; elsewhere the system's timers)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 4))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        # the same bound where bytes we sent are still unacknowledged as the host vanishes
        # (keepalive probes only an idle connection: the kernel otherwise retransmits for
        # ~15 min), a delayed ACK of our last message included
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 2000 * idle)


def shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` (close() alone would not) and end the stream."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
