"""NixlTransport READ vs ``ucx_perftest -t ucp_get`` on this machine, and coalesced vs per-block.

Run:  .venv/bin/python bench/nixl_vs_perftest.py [--out bench/results/nixl_cpu.json]

1. Baseline: ``ucx_perftest`` server + client on 127.0.0.1, ``-t ucp_get -s 1048576`` (1 MiB), the
   same UCX_TLS as kvlink (inherited from the environment). Two variants: the server progressing
   (perftest's default) and not (``-o``, like a NIXL target that is busy elsewhere).
2. kvlink: a target process registers 256 MiB; this process READs 128 extents of 1 MiB each
   (2 MiB apart, so NIXL cannot merge them) per request with NixlTransport. GB/s = bytes / time
   from post to DONE. Ratio = kvlink / best perftest variant (goal >= 0.9).
3. A 20480-block request of 8 KiB blocks: coalesced extents (one per contiguous run, built with
   numpy) vs one descriptor per block, for fully contiguous ids and for runs of 64 blocks, in both
   post modes ("prepped": make_prepped_xfer, which merges adjacent descriptors itself; "direct":
   initialize_xfer, which does not). Goal: coalesced >= 3x per-block.
Bytes are verified after every configuration. Runs are interleaved and repeated; medians reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents  # noqa: E402
from kvlink_transports import _ucx  # noqa: E402
from kvlink_transports.nixl import NixlTransport  # noqa: E402

MiB = 1 << 20
BUF = 256 * MiB
BLOCK = 8 << 10
NBLOCKS = 20480


def _pattern(n: int) -> np.ndarray:
    return np.arange(n // 8, dtype=np.uint64).view(np.uint8)


def _target(conn: Connection, name: str, size: int = BUF) -> None:
    t = NixlTransport(TransportContext(agent_name=name), {"ucx_probe": False})
    buf = _pattern(size).copy()
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    conn.send((t.descriptor(), buf.ctypes.data))
    while True:  # block on the pipe: cma READs need no target progress
        msg = conn.recv()
        if msg == "stop":
            t.notifications()
            t.close()
            conn.send("bye")
            return
        conn.send(len(t.notifications()))


def perftest_get(size: int, iters: int, no_responder_progress: bool) -> dict[str, Any]:
    r = _ucx.run_perftest("ucp_get", size, iters, ("-o",) if no_responder_progress else (),
                          timeout=120)
    return {"server_cmd": r.server_cmd, "client_cmd": r.client_cmd, "iterations": r.iterations,
            "latency_us_avg": r.latency_us_avg, "MiBps_overall": r.mib_per_s, "GBps": r.gbps}


def _run(t: NixlTransport, peer: str, op: Op, lo: Any, ro: Any) -> float:
    t0 = time.perf_counter()
    h = t.post(op, peer, lo, ro)
    while (s := t.poll(h)).status is XferStatus.PENDING:
        pass
    t1 = time.perf_counter()
    t.release(h)
    if s.status is not XferStatus.DONE:
        raise RuntimeError(s.reason)
    return t1 - t0


TLS_MATRIX = [
    None,
    "tcp,self",
    "tcp",
    "tcp,cma",
    "tcp,sm",
    "tcp,sm,self",
    "tcp,posix",
    "tcp,sysv",
    "tcp,cma,posix,sysv,self",
    "sm,self",
    "cma,self",
    "posix,cma,self",
    "shm,self",
    "^tcp",
]


def tls_child() -> None:
    """One UCX_TLS setting (from the environment): READ and WRITE 64 x 1 MiB, print JSON."""
    size, n = 128 * MiB, 64
    out: dict[str, Any] = {"UCX_TLS": os.environ.get("UCX_TLS", "(default)")}
    try:
        t = NixlTransport(
            TransportContext(agent_name=f"tls-init-{os.getpid()}"), {"ucx_probe": False}
        )
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out))
        return
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    tname = f"tls-target-{os.getpid()}"
    proc = ctx.Process(target=_target, args=(child, tname, size), daemon=True)
    proc.start()
    child.close()
    try:
        desc, raddr = conn.recv()
        local = np.ones(size, dtype=np.uint8)
        t.register([Region(local.ctypes.data, local.nbytes)])
        t.connect(tname, desc)
        off = np.arange(n, dtype=np.uint64) * 2 * MiB
        lo, ro = make_extents(local.ctypes.data + off, MiB), make_extents(raddr + off, MiB)
        _run(t, tname, Op.READ, lo, ro)
        for op in (Op.READ, Op.WRITE):
            times = [_run(t, tname, op, lo, ro) for _ in range(5)]
            out[f"{op.value}_GBps"] = round(n * MiB / statistics.median(times) / 1e9, 3)
        sel = (off[:, None] + np.arange(MiB, dtype=np.uint64)[None, :]).ravel()
        out["verified"] = bool(np.array_equal(local[sel], _pattern(size)[sel]))
        out["protocols"] = _ucx.nixl_protocols()
        conn.send("stop")
        conn.recv()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        t.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    print(json.dumps(out))


def tls_matrix() -> list[dict[str, Any]]:
    rows = []
    for tls in TLS_MATRIX:
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if tls is not None:
            env["UCX_TLS"] = tls
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--tls-child"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
            row = json.loads(line)
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            row = {"UCX_TLS": tls or "(default)", "error": f"{type(exc).__name__}"}
        print(json.dumps(row))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results/nixl_cpu.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--tls-matrix",
        action="store_true",
        help="only measure NIXL READ/WRITE under several UCX_TLS values and merge "
        "them into --out under ucx_tls_matrix",
    )
    ap.add_argument("--tls-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tls_child:
        tls_child()
        return
    if args.tls_matrix:
        path = Path(args.out)
        doc = json.loads(path.read_text()) if path.exists() else {}
        doc["ucx_tls_matrix"] = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "what": "NixlTransport READ/WRITE, 64 x 1 MiB extents per request, median of 5",
            "rows": tls_matrix(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    tname = f"bench-target-{os.getpid()}"
    proc = ctx.Process(target=_target, args=(child, tname), daemon=True)
    proc.start()
    desc, raddr = conn.recv()
    ref = _pattern(BUF)

    transports = {
        mode: NixlTransport(
            TransportContext(agent_name=f"bench-init-{mode}-{os.getpid()}"),
            {"post_mode": mode, "ucx_probe": False},
        )
        for mode in ("prepped", "direct")
    }
    local = np.ones(BUF, dtype=np.uint8)  # touched: no page faults inside the timing
    for t in transports.values():
        t.register([Region(local.ctypes.data, local.nbytes)])
        t.connect(tname, desc)

    # ---- 1 MiB extents, 2 MiB apart (NIXL cannot merge them), 128 per request
    n1 = 128
    off = np.arange(n1, dtype=np.uint64) * 2 * MiB
    lo1, ro1 = make_extents(local.ctypes.data + off, MiB), make_extents(raddr + off, MiB)
    raw: dict[str, Any] = {"perftest": [], "perftest_o": [], "nixl_read_1MiB_s": []}
    tp = transports["prepped"]
    _run(tp, tname, Op.READ, lo1, ro1)  # warm-up (connection, rkeys)
    for _ in range(args.rounds):
        raw["perftest"].append(perftest_get(MiB, 4000, False))
        raw["perftest_o"].append(perftest_get(MiB, 4000, True))
        raw["nixl_read_1MiB_s"].append([_run(tp, tname, Op.READ, lo1, ro1) for _ in range(8)])
    sel = (off[:, None] + np.arange(MiB, dtype=np.uint64)[None, :]).ravel()
    assert np.array_equal(local[sel], ref[sel]), "1 MiB READ bytes differ"

    nixl_times = [x for r in raw["nixl_read_1MiB_s"] for x in r]
    nixl_gbps = n1 * MiB / statistics.median(nixl_times) / 1e9
    pt = statistics.median(r["GBps"] for r in raw["perftest"])
    pt_o = statistics.median(r["GBps"] for r in raw["perftest_o"])
    baseline = max(pt, pt_o)

    # ---- 20480 x 8 KiB blocks
    rng = np.random.default_rng(0)
    nb_total = BUF // BLOCK
    layouts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    layouts["contiguous"] = (np.arange(NBLOCKS), np.arange(NBLOCKS) + 1000)
    runs = NBLOCKS // 64
    starts = rng.choice(nb_total // 64 - 1, runs, replace=False) * 64
    layouts["runs_of_64"] = (np.arange(NBLOCKS), (starts[:, None] + np.arange(64)[None, :]).ravel())
    blocks: dict[str, Any] = {}
    for lname, (lid, rid) in layouts.items():
        lid, rid = lid.astype(np.uint64), rid.astype(np.uint64)
        # coalesce: a new run starts wherever either side's id does not follow the previous one
        brk = np.flatnonzero((np.diff(lid) != 1) | (np.diff(rid) != 1)) + 1
        first = np.concatenate(([0], brk))
        count = np.diff(np.concatenate((first, [NBLOCKS]))).astype(np.uint64)
        co_l = make_extents(local.ctypes.data + lid[first] * BLOCK, count * BLOCK)
        co_r = make_extents(raddr + rid[first] * BLOCK, count * BLOCK)
        pb_l = make_extents(local.ctypes.data + lid * BLOCK, BLOCK)
        pb_r = make_extents(raddr + rid * BLOCK, BLOCK)
        entry: dict[str, Any] = {"coalesced_extents": int(first.size), "per_block_extents": NBLOCKS}
        for mode, t in transports.items():
            res: dict[str, list[float]] = {"coalesced_s": [], "per_block_s": []}
            for _ in range(args.rounds):
                local[:] = 1
                res["coalesced_s"].append(_run(t, tname, Op.READ, co_l, co_r))
                lb = local.reshape(-1, BLOCK)
                assert np.array_equal(
                    lb[lid.astype(np.int64)], ref.reshape(-1, BLOCK)[rid.astype(np.int64)]
                )
                local[:] = 1
                res["per_block_s"].append(_run(t, tname, Op.READ, pb_l, pb_r))
                assert np.array_equal(
                    lb[lid.astype(np.int64)], ref.reshape(-1, BLOCK)[rid.astype(np.int64)]
                )
            c, p = statistics.median(res["coalesced_s"]), statistics.median(res["per_block_s"])
            entry[mode] = {
                **res,
                "coalesced_GBps": NBLOCKS * BLOCK / c / 1e9,
                "per_block_GBps": NBLOCKS * BLOCK / p / 1e9,
                "ratio": p / c,
            }
        blocks[lname] = entry

    stats = {m: vars(t.stats) for m, t in transports.items()}
    for t in transports.values():
        t.close()
    conn.send("stop")
    conn.recv()
    proc.join(30)

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib import metadata

    ucx_ver = ""
    info = _ucx.ucx_info_path()
    if info:
        out = subprocess.run([info, "-v"], env=_ucx.ucx_env(info), capture_output=True, text=True)
        m = re.search(r"version:?\s*([0-9.]+)", out.stdout)
        ucx_ver = m.group(1) if m else ""
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": cpu,
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "nixl": metadata.version("nixl"),
            "ucx_perftest_ucx": ucx_ver,
        },
        "UCX_TLS": os.environ.get("UCX_TLS", "(default)"),
        "nixl_selected_protocols": _ucx.nixl_protocols(),
        "read_1MiB": {
            "extents_per_request": n1,
            "requests_per_round": 8,
            "nixl_GBps": nixl_gbps,
            "perftest_GBps": pt,
            "perftest_no_responder_progress_GBps": pt_o,
            "ratio_vs_best_perftest": nixl_gbps / baseline,
            "best_of_runs": {
                "nixl_GBps": n1 * MiB / min(nixl_times) / 1e9,
                "perftest_GBps": max(r["GBps"] for r in raw["perftest"] + raw["perftest_o"]),
                "ratio": (n1 * MiB / min(nixl_times) / 1e9)
                / max(r["GBps"] for r in raw["perftest"] + raw["perftest_o"]),
            },
            "goal": 0.9,
            "raw": raw,
        },
        "blocks_20480x8KiB": blocks,
        "coalesce_goal": 3.0,
        "transport_stats": stats,
    }
    out_path = Path(args.out)
    if out_path.exists():  # keep a UCX_TLS matrix measured earlier by --tls-matrix
        old = json.loads(out_path.read_text())
        if "ucx_tls_matrix" in old:
            result["ucx_tls_matrix"] = old["ucx_tls_matrix"]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"READ 1 MiB: kvlink/nixl {nixl_gbps:.2f} GB/s, ucx_perftest ucp_get {pt:.2f} GB/s "
        f"(-o: {pt_o:.2f}), ratio {nixl_gbps / baseline:.2f} (goal >= 0.9)"
    )
    for lname, e in blocks.items():
        for mode in transports:
            r = e[mode]
            print(
                f"20480x8KiB {lname:10s} {mode:7s}: coalesced ({e['coalesced_extents']} ext) "
                f"{r['coalesced_GBps']:.2f} GB/s, per-block {r['per_block_GBps']:.2f} GB/s, "
                f"ratio {r['ratio']:.2f}x (goal >= 3)"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
