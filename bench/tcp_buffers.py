"""The tcp transport alone on 127.0.0.1 with each socket-buffer size, against a plain socket.

    .venv/bin/python bench/tcp_buffers.py [--sizes 0,262144,1048576,4194304] [--reps 30]
                                          [--out bench/results/tcp_buffers.json]

Why: tcp set both socket buffers to 4 MiB on every connection. Setting a size turns Linux's
autotuning off (and is clamped to twice ``net.core.rmem_max``, 416 KiB where that is the
common default), so the size is worth choosing, per where the peer is (kvlink_transports/
tcp/wire.py, ``_tune``). This measures the layer the choice acts on, the transport alone
(``post(READ)`` -> ``poll`` DONE, the caller sleeping 0.2 ms between polls as a serving loop
does; the owner in another process, connections made per size with the tcp option
``socket_buffer_bytes``, 0 = the kernel's autotuning): a 10 MiB READ (a 16-block request's
bytes) as one extent and as 2,560 scattered 4 KiB extents, and a 160 MiB one (the 70B TP8
rank request) as one extent — each size in turn, every round, so they share the VM's drift.
The same-run baseline: a plain socket moving the same bytes (bench/tcp_vs_socket.py). Every
READ's bytes are checked once per size. Writes bench/results/tcp_buffers.json (command,
machine, date).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result
from tcp_vs_socket import socket_rounds

from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink_transports.tcp import TcpTransport

MiB = 1 << 20
SPAN = 192 * MiB  # each side's registered memory
POLL_SLEEP = 0.0002


def _owner(q: Any, done: Any, sizes: list[int]) -> None:
    """One owner per buffer size (its accepted connections take that size too)."""
    src = (np.arange(SPAN, dtype=np.uint64) % 251).astype(np.uint8)
    ts = [TcpTransport(TransportContext(f"own{s}"), {"socket_buffer_bytes": s}) for s in sizes]
    for t in ts:
        t.register([Region(src.ctypes.data, SPAN)])
    q.put(([t.descriptor() for t in ts], src.ctypes.data))
    done.wait(1800)
    for t in ts:
        t.close()


def _read_ms(t: TcpTransport, peer: str, local: Any, remote: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = t.post(Op.READ, peer, local, remote)
        while (st := t.poll(h)).status is XferStatus.PENDING:
            time.sleep(POLL_SLEEP)
        out.append((time.perf_counter() - t0) * 1e3)
        if st.status is not XferStatus.DONE:
            raise RuntimeError(f"READ failed: {st.reason}")
        t.release(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0,262144,1048576,4194304")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_owner, args=(q, done, sizes), daemon=True)
    proc.start()
    descs, far = q.get(timeout=120)
    dst = np.zeros(SPAN, dtype=np.uint8)
    want = (np.arange(SPAN, dtype=np.uint64) % 251).astype(np.uint8)
    rng = np.random.default_rng(0)
    pieces = 10 * MiB // 4096
    li = rng.permutation(SPAN // 4096)[:pieces].astype(np.uint64)
    ri = rng.permutation(SPAN // 4096)[:pieces].astype(np.uint64)
    cases = {
        "10MiB_one": (make_extents(dst.ctypes.data, 10 * MiB), make_extents(far, 10 * MiB)),
        "10MiB_scattered": (make_extents(dst.ctypes.data + li * 4096, 4096),
                            make_extents(far + ri * 4096, 4096)),
        "160MiB_one": (make_extents(dst.ctypes.data, 160 * MiB), make_extents(far, 160 * MiB)),
    }
    readers = []
    for s, desc in zip(sizes, descs):
        t = TcpTransport(TransportContext(f"rd{s}"), {"socket_buffer_bytes": s})
        t.register([Region(dst.ctypes.data, SPAN)])
        t.connect(f"own{s}", desc)
        readers.append(t)
    ms: dict[str, dict[int, list[float]]] = {c: {s: [] for s in sizes} for c in cases}
    sock: dict[str, list[float]] = {"10MiB": [], "160MiB": []}
    try:
        for s, t in zip(sizes, readers):  # connect, warm, and check the bytes once
            for name, (local, remote) in cases.items():
                dst[:] = 0
                _read_ms(t, f"own{s}", local, remote, 1)
                if name == "10MiB_scattered":
                    ok = all(np.array_equal(dst[int(a) * 4096:int(a) * 4096 + 4096],
                                            want[int(b) * 4096:int(b) * 4096 + 4096])
                             for a, b in zip(li[:64], ri[:64]))
                else:
                    n = 10 * MiB if name.startswith("10") else 160 * MiB
                    ok = bool(np.array_equal(dst[:n], want[:n]))
                if not ok:
                    raise RuntimeError(f"{name} with buffers {s}: wrong bytes")
        for r in range(args.rounds):
            order = sizes if r % 2 == 0 else sizes[::-1]
            for s in order:
                t = readers[sizes.index(s)]
                for name, (local, remote) in cases.items():
                    reps = args.reps if name.startswith("10") else max(4, args.reps // 5)
                    ms[name][s] += _read_ms(t, f"own{s}", local, remote, reps)
            sock["10MiB"] += [x * 1e3 for x in socket_rounds(10 * MiB, MiB, args.reps)]
            sock["160MiB"] += [x * 1e3 for x in socket_rounds(160 * MiB, MiB,
                                                               max(4, args.reps // 5))]
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for t in readers:
            t.close()
        done.set()
        proc.join(30)
    med = {c: {str(s): round(statistics.median(v), 3) for s, v in by.items()}
           for c, by in ms.items()}
    sock_med = {k: round(statistics.median(v), 3) for k, v in sock.items()}
    print(f"{'case':18} " + " ".join(f"{s:>10}" for s in sizes) + "   plain socket")
    for c in cases:
        base = sock_med["10MiB" if c.startswith("10") else "160MiB"]
        print(f"{c:18} " + " ".join(f"{med[c][str(s)]:10.2f}" for s in sizes)
              + f"   {base:.2f} ms")
    write_result("tcp_buffers", {
        "what": "tcp transport alone, READ post -> DONE on 127.0.0.1 (caller sleeps 0.2 ms "
                "between polls), median ms per socket_buffer_bytes (0: kernel autotuning); "
                "plain socket of the same bytes in the same run",
        "sizes": sizes, "reps": args.reps, "rounds": args.rounds,
        "median_ms": med, "plain_socket_median_ms": sock_med,
        "raw_ms": {c: {str(s): v for s, v in by.items()} for c, by in ms.items()},
    }, args.out)


if __name__ == "__main__":
    main()
