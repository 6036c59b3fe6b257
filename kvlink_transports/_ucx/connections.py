"""UCX's TCP connections in this process, found and shut down to stop a hung peer's requests.

NIXL 1.5.1 has no call that stops a UCX READ/WRITE in flight (releasing the request or removing
the remote agent leaves UCX's operation running: docs/nixl.md "Deadlines"). What does stop it is
UCX failing the endpoint, which it does when a TCP connection of the endpoint breaks. These
helpers find the TCP connections this process's UCX opened to a peer and shut them down. Linux
only (/proc); elsewhere they find nothing.

:func:`tcp_sockets`, :func:`new_ucx_connections` and :func:`shutdown_connections` read this
process's TCP sockets from /proc (no UCX call): the nixl transport uses them to tear down a
hung peer's UCX connections (docs/nixl.md "Deadlines"). Separate because it is the one part of
the package that acts on live connections rather than describing UCX.
"""

from __future__ import annotations

import dataclasses
import os

TcpEnd = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process (from /proc/self/fd and /proc/self/net/tcp{,6})."""

    fd: int
    inode: int
    local: TcpEnd
    remote: TcpEnd
    listening: bool


def _proc_addr(text: str) -> TcpEnd:
    """``0100007F:1F90`` (/proc/net/tcp: 32-bit words in host order) -> ("127.0.0.1", 8080)."""
    import socket

    ip_hex, _, port_hex = text.partition(":")
    raw = bytes.fromhex(ip_hex)
    ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(ip) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, ip), int(port_hex, 16)


def tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets, listening or connected (any state); empty where /proc is not."""
    inodes: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes[int(link[8:-1])] = int(fd)
    out: list[TcpSocket] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or int(cols[9]) not in inodes:
                continue
            inode = int(cols[9])
            out.append(TcpSocket(inodes[inode], inode, _proc_addr(cols[1]), _proc_addr(cols[2]),
                                 int(cols[3], 16) == 0x0A))
    return out


def _in_ucx_address(end: TcpEnd, blob: bytes) -> bool:
    """Whether ``blob`` (a peer's NIXL metadata, which holds its UCX worker address) carries
    ``end`` as a UCX tcp interface: the iface address is the listening port, big-endian, after
    a length byte whose low 6 bits are 2 (the top two are flags); a non-loopback device address
    carries the IP's bytes."""
    import ipaddress
    import socket

    ip, port = end
    pb = port.to_bytes(2, "big")
    at = blob.find(pb, 1)
    while at > 0 and (blob[at - 1] & 0x3F) != 2:
        at = blob.find(pb, at + 1)
    if at <= 0:
        return False
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback:  # UCX's loopback device address holds namespace ids, not the IP
        return True
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    return socket.inet_pton(family, ip) in blob


def new_ucx_connections(before: list[TcpSocket], after: list[TcpSocket],
                        metadata: bytes) -> frozenset[TcpEnd]:
    """Remote ends of the TCP connections this process opened between two :func:`tcp_sockets`
    snapshots to UCX interfaces named in a peer's ``metadata``: what NIXL's ``add_remote_agent``
    (UCX's endpoint creation) dialled. Connections accepted on one of our listening ports and
    ones to ports the peer's UCX address does not name are left out."""
    seen = {s.inode for s in before}
    ours = {s.local[1] for s in after if s.listening}
    return frozenset(
        s.remote
        for s in after
        if s.inode not in seen and not s.listening and s.local[1] not in ours
        and _in_ucx_address(s.remote, metadata)
    )


def shutdown_connections(remotes: frozenset[TcpEnd]) -> int:
    """``shutdown(SHUT_RDWR)`` every TCP connection of this process to one of ``remotes``; the
    descriptors stay open (UCX closes its own once it sees the connection end). Each socket is
    checked by inode through a duplicate of its descriptor first, so one closed and reused
    meanwhile is left alone. Returns how many were shut down."""
    import socket

    done = 0
    for s in tcp_sockets():
        if s.listening or s.remote not in remotes:
            continue
        try:
            dup = os.dup(s.fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != s.inode:
                continue
            sock = socket.socket(fileno=dup)
            dup = -1  # the socket object owns it now
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # already shut or reset
                pass
            finally:
                sock.close()
        finally:
            if dup >= 0:
                os.close(dup)
    return done
