"""kvlink's tcp transport vs a plain-socket sendall/recv_into baseline, same bytes, same run.

Both move ``--total`` bytes as 1 MiB extents from one process to another over 127.0.0.1. The
baseline is the ceiling of any TCP transport here: one stream, no framing, recv_into straight
into the destination buffer. Runs alternate (baseline, kvlink, baseline, ...) to share the noise.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
from typing import Any

import numpy as np
from _common import write_result


def _socket_server(port_q: Any, chunk: int) -> None:
    """Serves rounds until the client closes: each asks for ``total`` bytes (8 bytes, little
    endian) and gets them in ``chunk``-byte sends from a buffer made once per size."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs: dict[int, memoryview] = {}
    while len(ask := conn.recv(8, socket.MSG_WAITALL)) == 8:
        total = int.from_bytes(ask, "little")
        mv = bufs.get(total)
        if mv is None:
            mv = bufs[total] = memoryview(np.ones(total, dtype=np.uint8))
        for off in range(0, total, chunk):
            conn.sendall(mv[off : off + chunk])
    conn.close()


class SocketPeer:
    """A plain-socket peer in a process of its own (spawned once): :meth:`round` asks it for
    ``total`` bytes and times their arrival, ``recv_into`` straight into a destination buffer
    of ours in ``chunk``-byte calls — the ceiling of any TCP transfer of those bytes here. One
    peer serves a whole run, so its rounds can be interleaved with what they are the baseline
    of (bench/e2e_request.py: one after each kvlink request), sharing the machine's noise."""

    def __init__(self, chunk: int) -> None:
        ctx = mp.get_context("spawn")
        q: Any = ctx.Queue()
        self._proc = ctx.Process(target=_socket_server, args=(q, chunk), daemon=True)
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
        self._chunk = chunk
        self._dst: dict[int, memoryview] = {}

    def round(self, total: int) -> float:
        """Seconds from asking for ``total`` bytes to the last of them received. A size's
        first round, which allocates and faults in both sides' buffers (several times a warm
        round's time), runs untimed first."""
        mv = self._dst.get(total)
        if mv is None:
            mv = self._dst[total] = memoryview(np.zeros(total, dtype=np.uint8))
            self._move(total, mv)
        return self._move(total, mv)

    def _move(self, total: int, mv: memoryview) -> float:
        s, chunk = self._sock, self._chunk
        t = time.perf_counter()
        s.sendall(total.to_bytes(8, "little"))
        got = 0
        while got < total:
            n = s.recv_into(mv[got:], min(chunk, total - got))
            if n == 0:
                raise RuntimeError("baseline peer closed")
            got += n
        return time.perf_counter() - t

    def close(self) -> None:
        self._sock.close()
        self._proc.join(timeout=30)


def socket_rounds(total: int, chunk: int, rounds: int) -> list[float]:
    """``rounds`` plain-socket transfers of ``total`` bytes in a row (a peer of their own)."""
    peer = SocketPeer(chunk)
    try:
        return [peer.round(total) for _ in range(rounds)]
    finally:
        peer.close()


def _kvlink_server(q: Any, done: Any, total: int) -> None:
    from kvlink.transport import Region, TransportContext
    from kvlink_transports.tcp import TcpTransport

    buf = np.ones(total, dtype=np.uint8)
    t = TcpTransport(TransportContext("bench-server"))
    t.register([Region(int(buf.__array_interface__["data"][0]), total)])
    q.put((t.descriptor(), int(buf.__array_interface__["data"][0])))
    done.wait(600)
    t.close()


def kvlink_rounds(total: int, chunk: int, rounds: int) -> list[float]:
    from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
    from kvlink_transports.tcp import TcpTransport

    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    done = ctx.Event()
    p = ctx.Process(target=_kvlink_server, args=(q, done, total))
    p.start()
    desc, raddr = q.get(timeout=60)
    dst = np.zeros(total, dtype=np.uint8)
    laddr = int(dst.__array_interface__["data"][0])
    t = TcpTransport(TransportContext("bench-client"))
    t.register([Region(laddr, total)])
    t.connect("server", desc)
    n = total // chunk
    offs = np.arange(n, dtype=np.uint64) * np.uint64(chunk)
    local, remote = make_extents(laddr + offs, chunk), make_extents(raddr + offs, chunk)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        h = t.post(Op.READ, "server", local, remote)
        st = t.wait(h, 120)
        out.append(time.perf_counter() - t0)
        t.release(h)
        if st.status is not XferStatus.DONE:
            raise RuntimeError(st.reason)
    if not np.all(dst == 1):
        raise RuntimeError("kvlink tcp moved wrong bytes")
    t.close()
    done.set()
    p.join(timeout=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--total", type=int, default=256 << 20)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base, ours = [], []
    for _ in range(3):  # interleave to share the machine's noise between both
        base += socket_rounds(args.total, args.chunk, args.rounds)
        ours += kvlink_rounds(args.total, args.chunk, args.rounds)
    gb = args.total / 1e9
    b, k = gb / float(np.median(base)), gb / float(np.median(ours))
    print(f"plain socket {b:.2f} GB/s   kvlink tcp {k:.2f} GB/s   ratio {k / b:.2f}")
    write_result("tcp_vs_socket", {
        "total_bytes": args.total, "extent_bytes": args.chunk,
        "baseline_seconds": base, "kvlink_seconds": ours,
        "baseline_gbps_median": b, "kvlink_gbps_median": k, "ratio": k / b, "goal": 0.8,
    }, args.json)


if __name__ == "__main__":
    main()
