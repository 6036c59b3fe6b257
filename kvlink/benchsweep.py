"""`kvlink bench`: transfer bandwidth vs block size, each figure beside same-run baselines.

Baselines, measured in the same run: ``ucx_perftest`` (ucp_put_bw for WRITE, ucp_get for READ)
between two processes on 127.0.0.1 at the same message size; memcpy of the same bytes in one
process (the single-host ceiling); ``ib_write_bw``/``ib_read_bw`` only where an RDMA device exists
(detected, never faked: the JSON says why it did not run).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvlink.demo.proc import child_main, exit_reason
from kvlink.hostid import host_id
from kvlink.transport import (
    Op,
    Region,
    TransportContext,
    XferStatus,
    create_transport,
    make_extents,
    registered_transports,
)

MiB = 1 << 20
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


@dataclasses.dataclass
class SweepConfig:
    sizes: list[int] = dataclasses.field(default_factory=lambda: list(SIZES))
    transports: list[str] = dataclasses.field(default_factory=lambda: ["tcp", "nixl"])
    ops: list[str] = dataclasses.field(default_factory=lambda: ["read", "write"])
    total: int = 256 * MiB  # bytes per point (capped by max_extents)
    max_extents: int = 16384
    reps: int = 3
    memory: str = "dram"  # or "vram": buffers on cuda:0, baseline = device copy


def _buffer(total: int, memory: str, fill: int) -> tuple[Any, int, str]:
    """(owner, address, device) of a benchmark buffer in DRAM or VRAM."""
    if memory == "vram":
        import torch

        t = torch.full((total,), fill, dtype=torch.uint8, device="cuda:0")
        return t, int(t.data_ptr()), "cuda:0"
    a = np.full(total, fill, dtype=np.uint8)
    return a, int(a.__array_interface__["data"][0]), "cpu"


def _server(q: Any, stop: Any, names: list[str], total: int, memory: str = "dram") -> None:
    _keep, addr, device = _buffer(total, memory, 1)
    descs: dict[str, Any] = {}
    live = []
    for name in names:
        try:
            t = create_transport(name, TransportContext(f"bench-server-{name}",
                                                        host_id=host_id()))
            t.register([Region(addr, total, device)])
            descs[name] = (t.descriptor(), addr)
            live.append(t)
        except Exception as exc:
            descs[name] = f"{type(exc).__name__}: {exc}"
    q.put(descs)
    stop.wait(3600)
    for t in live:
        t.close()


def memcpy_gbps(total: int, reps: int) -> float:
    src = np.ones(total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return total / statistics.median(times[1:]) / 1e9


def device_copy_gbps(total: int, reps: int) -> float:
    import torch

    src = torch.ones(total, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return total / statistics.median(times[1:]) / 1e9


def perftest_gbps(test: str, size: int, iters: int) -> float | str:
    """ucx_perftest between two processes on loopback; a string says why it could not run."""
    try:
        from kvlink_transports import _ucx
    except ImportError as exc:
        return f"UCX helpers unavailable: {exc}"
    try:
        return _ucx.run_perftest(test, size, iters).gbps
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)


def rdma_baseline() -> str:
    devs = glob.glob("/sys/class/infiniband/*")
    if not devs:
        return "not run: no RDMA device (/sys/class/infiniband is empty)"
    if not shutil.which("ib_write_bw"):
        return "not run: RDMA device present but perftest (ib_write_bw) is not installed"
    return ("not run automatically: needs a second host; run `ib_write_bw -d DEV -s SIZE` on the "
            "server and `ib_write_bw -d DEV -s SIZE SERVER_IP` on the client")


def _first_message(q: Any, proc: Any, timeout: float) -> Any:
    """The server's first message; its death or failure ends the wait at once, saying why."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.1)
        except queue.Empty:
            if proc.exitcode is not None:
                try:
                    msg = q.get(timeout=0.1)
                except queue.Empty:
                    raise RuntimeError(f"bench server {exit_reason(proc.exitcode)} before "
                                       "it was ready") from None
            elif time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"bench server not ready within {timeout:.0f}s") from None
            else:
                continue
        if isinstance(msg, tuple) and msg[:1] == ("failed",):
            proc.join(10)
            raise RuntimeError(f"bench server failed at start-up: {msg[2]}")
        return msg


def run_sweep(cfg: SweepConfig, progress: bool = True) -> dict[str, Any]:
    names = [n for n in cfg.transports if n in registered_transports()]
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=child_main, args=(
        _server, logging.getLogger().getEffectiveLevel(), os.getpid(), q, 0,
        q, stop, names, cfg.total, cfg.memory), name="kvlink-bench-server")
    proc.start()
    descs = _first_message(q, proc, 300.0)
    _keep, laddr, device = _buffer(cfg.total, cfg.memory, 0)
    clients: dict[str, Any] = {}
    skipped = {n: "not registered" for n in cfg.transports if n not in names}
    for name in names:
        if isinstance(descs[name], str):
            skipped[name] = descs[name]
            continue
        try:
            t = create_transport(name, TransportContext(f"bench-client-{name}",
                                                        host_id=host_id()))
            t.register([Region(laddr, cfg.total, device)])
            t.connect("server", descs[name][0])
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        clients[name] = (t, descs[name][1])
    points = []
    steps = len(cfg.sizes) * (1 + len(clients) * len(cfg.ops))
    done = 0
    try:
        for size in cfg.sizes:
            n = max(1, min(cfg.max_extents, cfg.total // size))
            nbytes = n * size
            iters = max(50, min(20000, (1 << 30) // size))
            if cfg.memory == "vram":
                mem = device_copy_gbps(nbytes, cfg.reps)
                base: dict[str, float | str] = {
                    "memcpy_gbps": mem,
                    "ucx_perftest_put_gbps": "not run for VRAM (baseline: device copy)",
                    "ucx_perftest_get_gbps": "not run for VRAM (baseline: device copy)"}
            else:
                mem = memcpy_gbps(nbytes, cfg.reps)
                base = {"memcpy_gbps": mem,
                        "ucx_perftest_put_gbps": perftest_gbps("ucp_put_bw", size, iters),
                        "ucx_perftest_get_gbps": perftest_gbps("ucp_get", size, iters)}
            done += 1
            offs = np.random.default_rng(size).permutation(cfg.total // size)[:n].astype(np.uint64)
            offs *= np.uint64(size)
            for name, (t, raddr) in clients.items():
                for op in cfg.ops:
                    times = []
                    for _ in range(cfg.reps):
                        t0 = time.perf_counter()
                        h = t.post(Op(op), "server", make_extents(laddr + offs, size),
                                   make_extents(raddr + offs, size))
                        st = t.wait(h, 600)
                        times.append(time.perf_counter() - t0)
                        t.release(h)
                        if st.status is not XferStatus.DONE:
                            raise RuntimeError(f"{name} {op} {size}: {st.reason}")
                    gbps = nbytes / statistics.median(times) / 1e9
                    ref = base["ucx_perftest_get_gbps" if op == "read" else
                               "ucx_perftest_put_gbps"]
                    points.append({
                        "transport": name, "op": op, "memory": cfg.memory.upper(),
                        "block_bytes": size,
                        "blocks": n, "bytes": nbytes, "gbps": gbps,
                        "pct_of_ucx_perftest": 100 * gbps / ref if isinstance(ref, float) else None,
                        "pct_of_memcpy": 100 * gbps / mem, **base})
                    done += 1
                    if progress:
                        print(f"[{done}/{steps}] {name:8s} {op:5s} {size:>9,d} B x {n:>6d}: "
                              f"{gbps:7.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        for t, _ in clients.values():
            t.close()
        stop.set()
        proc.join(30)
    return {"points": points, "skipped_transports": skipped, "rdma_baseline": rdma_baseline(),
            "config": dataclasses.asdict(cfg)}


def table(result: dict[str, Any]) -> str:
    rows = [f"{'transport':9s} {'op':5s} {'block':>9s} {'GB/s':>7s} {'%perftest':>9s} "
            f"{'%memcpy':>8s}"]
    for p in result["points"]:
        pt = f"{p['pct_of_ucx_perftest']:.0f}%" if p["pct_of_ucx_perftest"] is not None else "-"
        rows.append(f"{p['transport']:9s} {p['op']:5s} {p['block_bytes']:>9,d} "
                    f"{p['gbps']:7.2f} {pt:>9s} {p['pct_of_memcpy']:7.0f}%")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: pip install kvlink[bench]"
    fig, ax = plt.subplots(figsize=(8, 5))
    pts = result["points"]
    for key in sorted({(p["transport"], p["op"]) for p in pts}):
        xs = [p["block_bytes"] for p in pts if (p["transport"], p["op"]) == key]
        ax.plot(xs, [p["gbps"] for p in pts if (p["transport"], p["op"]) == key], "o-",
                label=f"kvlink {key[0]} {key[1]}")
    sizes = sorted({p["block_bytes"] for p in pts})
    copy_label = "device copy" if pts and pts[0]["memory"] == "VRAM" else "memcpy"
    for base, style in (("ucx_perftest_get_gbps", "k--"), ("ucx_perftest_put_gbps", "k:"),
                        ("memcpy_gbps", "k-.")):
        ys = [next(p[base] for p in pts if p["block_bytes"] == s) for s in sizes]
        if all(isinstance(y, float) for y in ys):
            label = copy_label if base == "memcpy_gbps" else base.replace("_gbps", "")
            ax.plot(sizes, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block (extent) size, bytes")
    ax.set_ylabel("GB/s")
    mem = pts[0]["memory"] if pts else "DRAM"
    ax.set_title(f"kvlink transfer bandwidth vs same-run baselines ({mem}, one host)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def run_and_write(cfg: SweepConfig, json_path: str, png_path: str, command: str) -> int:
    """Run the sweep, print the table, write the JSON (and the PNG where matplotlib is)."""
    result = run_sweep(cfg)
    print(table(result))
    for name, why in result["skipped_transports"].items():
        print(f"skipped {name}: {why}")
    print(f"ib_write_bw: {result['rdma_baseline']}")
    result.update({"command": command,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": {"platform": sys.platform, "cpus": mp.cpu_count(),
                               "host": socket.gethostname()}})
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    why = plot(result, png_path)
    print(f"wrote {json_path}" + (f", {png_path}" if why is None else f" (no PNG: {why})"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvlink bench`` with these arguments (the options live in :mod:`kvlink.cli`)."""
    from kvlink.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
