"""What a sweep leaves: the table on stdout, the JSON, the PNG; and :func:`run_and_write`, the
one-host or two-host run that makes them."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from kvlink.bench.client import SweepConfig, run_sweep
from kvlink.bench.facts import human, machine
from kvlink.bench.server import local_server
from kvlink.bench.wire import DEFAULT_PORT

#: the table's columns: (header, width); the first five name a row, the rest are figures
COLUMNS = [("transport", 9), ("op", 5), ("block", 9), ("batch", 6), ("iters", 5),
           ("GB/s", 7), ("min", 7), ("max", 7), ("lat_avg_us", 10), ("lat_p99_us", 10),
           ("kmsg/s", 8), ("perftest", 8), ("memcpy", 7), ("%perftest", 9), ("%memcpy", 7)]


def table(result: dict[str, Any]) -> str:
    """nixlbench-style columns, and the baselines' own GB/s (perftest: get for READ, put for
    WRITE; memcpy of the same extents)."""
    def cell(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, float) else "-"

    rows = [" ".join(f"{h:{'<' if i < 2 else '>'}{w}s}" for i, (h, w) in enumerate(COLUMNS))]
    for p in result["points"]:
        ref = p["ucx_perftest_get_gbps" if p["op"] == "read" else "ucx_perftest_put_gbps"]
        pt = p["pct_of_ucx_perftest"]
        vals = [p["transport"], p["op"], f"{p['block_bytes']:,d}", str(p["batch"]),
                str(p["iterations"]), f"{p['gbps']:.2f}", f"{p['gbps_min']:.2f}",
                f"{p['gbps_max']:.2f}", f"{p['lat_avg_us']:.1f}", f"{p['lat_p99_us']:.1f}",
                f"{p['msg_per_s'] / 1e3:.1f}", cell(ref, ".2f"), f"{p['memcpy_gbps']:.2f}",
                f"{pt:.0f}%" if pt is not None else "-", f"{p['pct_of_memcpy']:.0f}%"]
        rows.append(" ".join(f"{v:{'<' if i < 2 else '>'}{w}s}"
                             for i, (v, (_h, w)) in enumerate(zip(vals, COLUMNS))))
    return "\n".join(rows)


def plot(result: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: pip install kvlink[bench]"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    pts = result["points"]
    for key in sorted({(p["transport"], p["op"]) for p in pts}):
        mine = [p for p in pts if (p["transport"], p["op"]) == key]
        xs = [p["block_bytes"] for p in mine]
        ys = [p["gbps"] for p in mine]
        err = [[p["gbps"] - p["gbps_min"] for p in mine], [p["gbps_max"] - p["gbps"] for p in mine]]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=f"kvlink {key[0]} {key[1]}")
    sizes = sorted({p["block_bytes"] for p in pts})
    copy_label = "device copy" if pts and pts[0]["memory"] == "VRAM" else "memcpy (local)"
    for base, style in (("ucx_perftest_get_gbps", "k--"), ("ucx_perftest_put_gbps", "k:"),
                        ("memcpy_gbps", "k-.")):
        ys = [next((p.get(base) for p in pts if p["block_bytes"] == s), None) for s in sizes]
        if ys and all(isinstance(y, float) for y in ys):
            label = copy_label if base == "memcpy_gbps" else base.replace("_gbps", "")
            ax.plot(sizes, ys, style, label=label)
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes)
        ax.set_xticklabels([human(s) for s in sizes], rotation=30)
        ax.minorticks_off()
    ax.set_xlabel("block (extent) size")
    ax.set_ylabel("GB/s (median; bars: min-max)")
    mem = pts[0]["memory"] if pts else "DRAM"
    srv = result.get("server", {})
    mine_m = result.get("machine", {})
    theirs = srv.get("machine") or {}
    where = ("one host" if srv.get("same_host")
             else f"{mine_m.get('host', '?')} -> {theirs.get('host', '?')}")
    ax.set_title(f"kvlink transfer bandwidth vs same-run baselines ({mem}, {where})\n"
                 f"{mine_m.get('host', '?')}: {mine_m.get('cpu_model') or mine_m.get('arch', '')}"
                 f", {mine_m.get('cpus', '?')} CPUs; {result.get('date', '')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_and_write(cfg: SweepConfig, json_path: str, png_path: str, command: str,
                  host: str | None = None, port: int = DEFAULT_PORT,
                  timeout: float = 10.0, secret: bytes | None = None) -> int:
    """Run the sweep (against HOST:PORT with ``secret``, or a server of our own on 127.0.0.1
    under a secret of this run's), print the table, write the JSON (and the PNG where
    matplotlib is)."""
    if host is None:
        own = secrets.token_bytes(32)
        with local_server(command, own) as local_port:
            result = run_sweep(cfg, "127.0.0.1", local_port, timeout, secret=own)
        result["server"]["mode"] = "one host: a server child on 127.0.0.1"
    else:
        result = run_sweep(cfg, host, port, timeout, secret=secret)
        result["server"]["mode"] = "two hosts: kvlink bench --server there"
    print(table(result))
    for name, why in result["skipped_transports"].items():
        print(f"skipped {name}: {why}")
    print(f"ib_write_bw: {result['rdma_baseline']}")
    result.update({"command": command,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": machine()})
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    why = plot(result, png_path)
    print(f"wrote {json_path}" + (f", {png_path}" if why is None else f" (no PNG: {why})"))
    return 0
