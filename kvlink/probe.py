"""`kvlink probe URL`: achieved KV bandwidth of a running decode server, from its /metrics.

Reads kvlink's Prometheus series (``kvlink_recv_bytes_total`` and the ``kvlink_recv_seconds``
histogram, summed over engines and ranks) and prints the achieved bandwidth beside the NIC's
theoretical rate and a baseline measured on this machine (``kvlink bench`` JSON). With
``--interval`` it scrapes twice and reports the rate over that window only.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.request
from typing import Any

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its label sets (Prometheus text format)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def achieved(before: dict[str, float] | None, after: dict[str, float]) -> dict[str, float]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - (before or {}).get(name, 0.0)

    nbytes = delta("kvlink_recv_bytes_total")
    seconds = delta("kvlink_recv_seconds_sum")
    pulls = delta("kvlink_recv_seconds_count")
    return {"bytes": nbytes, "transfer_seconds": seconds, "pulls": pulls,
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0}


def baseline_gbps(path: str) -> tuple[float, str] | str:
    """The best same-machine figure from a `kvlink bench` JSON: the largest ucx_perftest
    figure, else (a bench run without perftest, or on a host without it) kvlink's own
    largest. Where there is none, why (the file missing, unreadable, or without figures)."""
    try:
        with open(path) as f:
            doc: dict[str, Any] = json.load(f)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}: run `kvlink bench`"
    except ValueError as exc:
        return f"{path} is not a kvlink bench JSON ({exc})"
    points = doc.get("points", []) if isinstance(doc, dict) else []
    for keys in (("ucx_perftest_get_gbps", "ucx_perftest_put_gbps"), ("gbps",)):
        best: tuple[float, str] | None = None
        for p in points:
            for key in keys:
                v = p.get(key)
                if isinstance(v, (int, float)) and v > 0 and (best is None or v > best[0]):
                    what = (key.removesuffix("_gbps") if key != "gbps" else
                            f"kvlink {p.get('transport', '?')} {p.get('op', '?')}")
                    best = (float(v), f"{what} at {p.get('block_bytes', '?')} B")
        if best is not None:
            return best
    return f"{path} has no bandwidth figure"


class ProbeError(Exception):
    """The metrics could not be read: one line saying which URL and why."""


def _scrape(url: str, timeout: float) -> dict[str, float]:
    try:
        return scrape(url, timeout)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError is an OSError
        why = getattr(exc, "reason", None) or exc
        raise ProbeError(f"cannot read {url}: {why}") from None


def run(url: str, interval: float = 0.0, nic_gbit: float = 400.0,
        baseline: str = "bandwidth.json", timeout: float = 10.0) -> int:
    """Print the achieved bandwidth (over ``interval`` seconds if > 0, else the totals)."""
    first = _scrape(url, timeout) if interval > 0 else None
    if first is not None:
        time.sleep(interval)  # the measurement window itself
    res = achieved(first, _scrape(url, timeout))
    nic = nic_gbit / 8
    print(f"pulls {res['pulls']:.0f}, {res['bytes'] / 2**20:.1f} MiB in "
          f"{res['transfer_seconds']:.3f} s of transfer time")
    print(f"achieved   {res['gbps']:8.2f} GB/s")
    print(f"NIC        {nic:8.2f} GB/s ({nic_gbit:.0f} Gb/s line rate) -> "
          f"{100 * res['gbps'] / nic:.0f} %")
    base = baseline_gbps(baseline)
    if isinstance(base, str):
        print(f"baseline   none ({base})")
    else:
        print(f"baseline   {base[0]:8.2f} GB/s ({base[1]}, {baseline}) -> "
              f"{100 * res['gbps'] / base[0]:.0f} %")
    return 0
