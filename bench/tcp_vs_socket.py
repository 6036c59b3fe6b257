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


def _socket_server(port_q: Any, total: int, chunk: int, rounds: int) -> None:
    buf = np.ones(total, dtype=np.uint8)
    mv = memoryview(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        conn.recv(1)
        for off in range(0, total, chunk):
            conn.sendall(mv[off : off + chunk])
    conn.close()


def socket_rounds(total: int, chunk: int, rounds: int) -> list[float]:
    q: Any = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_socket_server, args=(q, total, chunk, rounds))
    p.start()
    port = q.get(timeout=60)
    s = socket.create_connection(("127.0.0.1", port))
    dst = np.zeros(total, dtype=np.uint8)
    mv = memoryview(dst)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        s.send(b"g")
        got = 0
        while got < total:
            n = s.recv_into(mv[got:], min(chunk, total - got))
            if n == 0:
                raise RuntimeError("baseline peer closed")
            got += n
        out.append(time.perf_counter() - t)
    s.close()
    p.join(timeout=30)
    return out


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
