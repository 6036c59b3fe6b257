"""The goals, the table and the run's facts (load, commit, GPU) of ``bench/e2e_request.py``."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from e2e_producer import POLL_SLEEP, MiB, _torch

GOALS_TEXT = {
    "cuda": ["70b-tp8 one at a time: median post->done <= 0.2 ms and >= 0.45x device copy",
             "70b-tp8 inflight8: >= 0.7x device copy", "8b-tp1 one at a time: >= 0.8x device copy",
             "spin median within 1.2x of sleep median"],
    "cpu": ["70b-tp8 over tcp: kvlink adds <= 10% to the transport alone",
            "16-blocks over tcp: post->done <= 2x a plain-socket round trip of the same bytes"],
}


# --------------------------------------------------------------------------- report
def goals(device: str, transport: str, cases: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(text: str, value: float | None, ok: bool | None) -> None:
        out.append({"goal": text, "value": value, "met": ok})

    def mode(case: str, m: str) -> dict[str, Any] | None:
        r: dict[str, Any] | None = cases.get(case, {}).get("modes", {}).get(m)
        return r

    for m in ("sleep", "spin"):
        if device == "cuda":
            r = mode("70b-tp8", m)
            if r:
                med = r["kvlink"]["median_s"]
                add(f"70b-tp8 {m}: median post->done <= 0.2 ms", med * 1e3, med <= 0.2e-3)
                x = r.get("ratio_device_copy_over_kvlink")
                add(f"70b-tp8 {m}: >= 0.45x device copy", x, None if x is None else x >= 0.45)
            r = mode("8b-tp1", m)
            if r and "ratio_device_copy_over_kvlink" in r:
                x = r["ratio_device_copy_over_kvlink"]
                add(f"8b-tp1 {m}: >= 0.8x device copy", x, x >= 0.8)
        elif transport == "tcp":
            r = mode("70b-tp8", m)
            if r:
                x = r["ratio_kvlink_over_transport_alone"]
                add(f"70b-tp8 {m}: kvlink / transport alone <= 1.10", x, x <= 1.10)
            r = mode("16-blocks", m)
            if r and "ratio_kvlink_over_plain_socket" in r:
                x = r["ratio_kvlink_over_plain_socket"]
                add(f"16-blocks {m}: kvlink / plain socket <= 2.0", x, x <= 2.0)
    if device == "cuda":
        for m, poller in (("inflight8", "caller sleeps between polls"),
                          ("inflight8_spin", "caller polls in a loop")):
            r = mode("70b-tp8", m)
            if r and "ratio_device_copy_over_kvlink" in r:
                x = r["ratio_device_copy_over_kvlink"]
                add(f"70b-tp8 {m} ({poller}): >= 0.7x device copy", x, x >= 0.7)
        for name, cr in cases.items():
            s, p = cr["modes"].get("sleep"), cr["modes"].get("spin")
            if s and p:
                x = p["kvlink"]["median_s"] / s["kvlink"]["median_s"]
                add(f"{name}: spin median / sleep median <= 1.2", x, x <= 1.2)
    return out


def print_table(device: str, cases: dict[str, Any]) -> None:
    cols = ["case", "mode", "MiB", "median ms", "p10 ms", "p90 ms", "GB/s", "alone ms",
            "k/alone"]
    cols += ["copy ms", "copy/k", "gather/k"] if device == "cuda" else ["socket ms", "k/socket"]
    cols += ["verified", "mismatch"]
    rows = []
    for name, cr in cases.items():
        for mode, r in cr["modes"].items():
            k, b = r["kvlink"], r["baselines"]
            row = [name, mode, f"{r['bytes'] / MiB:.0f}", f"{k['median_s'] * 1e3:.3f}",
                   f"{k['p10_s'] * 1e3:.3f}", f"{k['p90_s'] * 1e3:.3f}",
                   f"{r['kvlink_gbps']:.2f}", f"{r['transport_alone']['median_s'] * 1e3:.3f}",
                   f"{r['ratio_kvlink_over_transport_alone']:.2f}"]
            if device == "cuda":
                row += [f"{b['device_copy']['median_s'] * 1e3:.3f}",
                        f"{r['ratio_device_copy_over_kvlink']:.2f}",
                        f"{r['ratio_gather_over_kvlink']:.2f}"]
            else:
                row += [f"{b['plain_socket']['median_s'] * 1e3:.3f}",
                        f"{r['ratio_kvlink_over_plain_socket']:.2f}"]
            row += [f"{r['verified']}+{r['transport_alone_verified']}",
                    str(r["mismatches"] + r["transport_alone_mismatches"])]
            rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(wd) for c, wd in zip(cols, widths)))
    for r in rows:
        print("  ".join(x.rjust(wd) for x, wd in zip(r, widths)))
    print("k = kvlink post->done (read() or write() to the poll that reports it finished); "
          "alone = the same extents through the worker's transport directly;")
    ph = [(n, m, r["worker_phases_median_s"]) for n, cr in cases.items()
          for m, r in cr["modes"].items() if "worker_phases_median_s" in r]
    if ph:
        keys = list(ph[0][2])
        print("worker phases (KVWorker.phases, median ms per request): case mode "
              + " ".join(keys))
        for n, m, p in ph:
            print(f"  {n} {m} " + " ".join(f"{k}={p.get(k, float('nan')) * 1e3:.3f}"
                                          for k in keys))
    grace = [(n, cr["worker_stats_decode"]["poll_grace"]) for n, cr in cases.items()
             if "poll_grace" in cr.get("worker_stats_decode", {})]
    for n, g in grace:  # (poll_grace_us: the polls' waits for copies about to end)
        print(f"poll grace {n}: {g['waits']} polls waited {g['seconds'] * 1e3:.2f} ms in all, "
              f"reported {g['reported']} requests, {g['timed_out']} timed out")
        est = cases[n].get("copy_rate_estimate_gbps")
        copy = cases[n]["modes"].get("spin", {}).get("baselines", {}).get("device_copy")
        if est and copy:  # (what those waits counted with, against the copy's own rate)
            print(f"  the transport expects its copies at {est:.0f} GB/s; a device copy ran "
                  f"at {copy['bytes'] / copy['median_s'] / 1e9:.0f} GB/s")
        if est:  # (the rate of its copies timed on the device, each from right before its
            # kernel: what the host adds around one request's kernel, start by start)
            kernel = cases[n]["bytes_per_request"] / (est * 1e9)
            above = [f"{m} +{cases[n]['modes'][m]['kvlink']['median_s'] * 1e3 - kernel * 1e3:.3f}"
                     for m in ("sleep", "spin") if m in cases[n]["modes"]]
            print(f"  one request's copy at that rate: {kernel * 1e3:.3f} ms; kvlink's median "
                  f"post->done above it (the host's share), ms: {', '.join(above)}")
    rw = [(n, m, r["read_vs_write"]) for n, cr in cases.items()
          for m, r in cr["modes"].items() if "read_vs_write" in r]
    if rw:
        print("READ time against WRITE time (negative: READ faster) [90 % interval]:")
        for n, m, v in rw:
            print(f"  {n} {m} kvlink {v['kvlink']:+.1%} [{v['kvlink_90pct'][0]:+.1%}, "
                  f"{v['kvlink_90pct'][1]:+.1%}]  transport alone "
                  f"{v['transport_alone']:+.1%} [{v['transport_alone_90pct'][0]:+.1%}, "
                  f"{v['transport_alone_90pct'][1]:+.1%}]")
    if device == "cuda":
        print("copy/k = device copy time / kvlink time (fraction of the copy's speed); "
              "copy and gather timed by CUDA events")
    else:
        print("k/socket = kvlink time / plain-socket time of the same bytes")

def _loadavg() -> list[float] | None:
    """The machine's load (others' processes skew a 2-core machine's figures)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    """The checkout measured: HEAD, and "+dirty" when kvlink/ has uncommitted changes
    (``KVLINK_COMMIT`` names it instead, for a tree exported without its git metadata)."""
    import subprocess

    if os.environ.get("KVLINK_COMMIT"):
        return os.environ["KVLINK_COMMIT"]

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "kvlink",
                                "kvlink_transports"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def _sleep_measured() -> float:
    """How long ``time.sleep(POLL_SLEEP)`` really sleeps here: the sleep mode's poll grain."""
    ts = []
    for _ in range(200):
        a = time.perf_counter()
        time.sleep(POLL_SLEEP)
        ts.append(time.perf_counter() - a)
    return statistics.median(ts)


def _gpu_name(args: argparse.Namespace) -> str:
    torch = _torch()
    return f"{torch.cuda.get_device_name(args.gpu)} (torch {torch.__version__}, " \
           f"cuda {torch.version.cuda})"
