"""One read report's round trip over the kept-open side-channel session vs a plain TCP echo.

    .venv/bin/python bench/channel_rtt.py [--rounds 300] [--out PATH]

A server process runs a real ``SideChannelServer`` (its handler answers ``Ack``); this process
sends a 256-block ``ReadDone`` through ``kvlink.channel.Channels`` and polls for the answer in
a tight loop, over the peer's kept-open session (plain TCP to its side-channel port; the ZMQ
path measured before is gone: bench/results/channel_rtt_h200.json has it). Back-to-back requests and
with the cores left idle 2 ms between requests, as between a serving loop's requests. The
baseline, same run: a plain TCP echo of the same bytes between the same two processes' kind
(a server process blocked in ``recv``, this one polling non-blocking). Medians of the last
``rounds - 50``. Writes bench/results/channel_rtt.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

from _common import write_result

from kvlink import sidechannel, wire
from kvlink.channel import Channels
from kvlink.compat import WIRE_VERSION

GAPS = (0.0, 0.002)


def _serve(q: Any, stop: Any) -> None:
    srv = sidechannel.SideChannelServer("127.0.0.1", 0, lambda m: wire.Ack(v=WIRE_VERSION))
    echo = socket.create_server(("127.0.0.1", 0))
    q.put((srv.port, echo.getsockname()[1]))
    conn, _ = echo.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(1 << 16)
        if not data:
            break
        conn.sendall(data)
    stop.wait(30)
    srv.close()


def _median_us(ts: list[float]) -> float:
    return statistics.median(ts[50:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(q, stop), daemon=True)
    proc.start()
    port, echo_port = q.get(timeout=60)
    msg = wire.ReadDone(v=WIRE_VERSION, engine_id="bench", req_id="r", tp_rank=0, tp_size=1,
                        generation=1, block_ids=list(range(256)))
    body = wire.encode(msg)
    rows: dict[str, dict[str, float]] = {}
    for kind in ("session",):
        for gap in GAPS:
            chan = Channels(None)
            ts = []
            for _ in range(args.rounds):
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                pending = chan.call("127.0.0.1", port, msg, 5.0)
                chan.flush()
                while not pending.done():
                    chan.pump()
                pending.result()
                ts.append(time.perf_counter() - t0)
            chan.close()
            rows.setdefault(kind, {})[f"gap_{gap * 1e3:.0f}ms_us"] = _median_us(ts)
    sock = socket.create_connection(("127.0.0.1", echo_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    for gap in GAPS:
        ts = []
        for _ in range(args.rounds):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            sock.send(body)
            got = 0
            while got < len(body):
                try:
                    got += len(sock.recv(1 << 16))
                except BlockingIOError:
                    pass
            ts.append(time.perf_counter() - t0)
        rows.setdefault("plain_tcp_echo", {})[f"gap_{gap * 1e3:.0f}ms_us"] = _median_us(ts)
    sock.close()
    stop.set()
    proc.join(timeout=10)
    ratios = {f"{k}_over_plain_tcp_{g}": rows[k][g] / rows["plain_tcp_echo"][g]
              for k in ("session",) for g in rows["plain_tcp_echo"]}
    for kind, row in rows.items():
        print(f"{kind:>15}: " + ", ".join(f"{g} {v:7.1f}" for g, v in row.items()))
    write_result("channel_rtt", {
        "what": "median round trip of one 256-block ReadDone (answered Ack) per channel kind, "
                "caller polling in a tight loop; gap = idle time between requests",
        "frame_bytes": len(body), "rounds": args.rounds, "medians_us": rows,
        "ratios": ratios}, args.out)


if __name__ == "__main__":
    main()
