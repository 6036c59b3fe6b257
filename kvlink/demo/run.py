"""Process orchestration for `kvlink demo`, `kvlink serve` and `kvlink pull`."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import random
import socket
import time
from typing import Any

from kvlink.demo.roles import DemoPlan, pull_rank, serve_rank
from kvlink.errors import KVLinkError

_mp = mp.get_context("spawn")  # no fork: transports own threads and sockets


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_range(n: int, host: str = "127.0.0.1") -> int:
    """A base port with n consecutive free ports (rank r listens on base + r).

    Chosen below the kernel's ephemeral range where it can be: a port in that range may be
    taken by any outgoing connection (every side-channel call opens one) between this check
    and the bind."""
    lo, _hi = _ephemeral_range()
    rng = random.Random()
    for attempt in range(100):
        if attempt < 80 and lo - n > 10000:
            base = rng.randrange(10000, lo - n)
        else:
            with socket.socket() as s:
                s.bind((host, 0))
                base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        socks = []
        try:
            for r in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind((host, base + r))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise KVLinkError(f"no {n} consecutive free ports on {host}")


class Serving:
    """Prefill ranks running in child processes."""

    def __init__(self, plan: DemoPlan) -> None:
        self.plan = plan
        self.events: Any = _mp.Queue()
        self.stop = _mp.Event()
        self.procs = [
            _mp.Process(target=serve_rank, args=(plan, r, self.events, self.stop),
                        name=f"kvlink-prefill-{r}")
            for r in range(plan.prefill_tp)
        ]
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float) -> None:
        waiting = set(range(self.plan.prefill_tp))
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                kind, rank, _ = self.events.get(timeout=min(0.5, max(0.1, deadline
                                                                     - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise KVLinkError(f"prefill ranks not ready within {timeout:.0f}s "
                                      f"(exited: {dead or 'none'})") from None
                continue
            if kind == "ready":
                waiting.discard(rank)

    def wait_served(self, timeout: float) -> dict[int, dict[str, int]]:
        """Lease accounting of each prefill rank once all readers are done (or timeout, or
        every rank that has not reported is dead: see :meth:`failures`)."""
        out: dict[int, dict[str, int]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.plan.prefill_tp and time.monotonic() < deadline:
            try:
                kind, rank, stats = self.events.get(timeout=0.5)
            except queue.Empty:
                if all(not self.procs[r].is_alive() for r in range(self.plan.prefill_tp)
                       if r not in out):
                    break  # a rank died without a word: nothing more will come
                continue
            if kind == "served":
                out[rank] = stats
        return out

    def failures(self) -> dict[str, int]:
        """Ranks that ended badly so far, by name: their exit code (an exception, a signal:
        negative; killed by :meth:`close` after not stopping in time: -9)."""
        return {p.name: p.exitcode for p in self.procs
                if p.exitcode is not None and p.exitcode != 0}

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def run_pull(plan: DemoPlan, show_progress: bool = True) -> dict[str, Any]:
    results: Any = _mp.Queue()
    procs = [
        _mp.Process(target=pull_rank, args=(plan, r, results, show_progress and r == 0),
                    name=f"kvlink-decode-{r}")
        for r in range(plan.decode_tp)
    ]
    for p in procs:
        p.start()
    ranks: list[dict[str, Any]] = []
    deadline = time.monotonic() + plan.timeout * max(1, plan.requests) + 120
    while len(ranks) < len(procs) and time.monotonic() < deadline:
        try:
            ranks.append(results.get(timeout=1))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=10)
    return summarize(plan, ranks)


def summarize(plan: DemoPlan, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    ranks.sort(key=lambda r: r["rank"])
    total = sum(r["bytes"] for r in ranks)
    seconds = max((r["seconds"] for r in ranks), default=0.0)
    failed = {k: v for r in ranks for k, v in r["failed"].items()}
    verified = (len(ranks) == plan.decode_tp and not failed
                and all(r["mismatches"] == 0 and r["requests"] == plan.requests for r in ranks))
    return {
        "verified": verified, "transport": plan.transport, "mode": plan.mode,
        "requests": plan.requests, "tokens": plan.tokens, "bytes": total,
        "seconds": seconds, "gbps": total / seconds / 1e9 if seconds else 0.0,
        "raw_descriptors": sum(r["raw_descriptors"] for r in ranks),
        "descriptors": sum(r["descriptors"] for r in ranks),
        "prefill_tp": plan.prefill_tp, "decode_tp": plan.decode_tp,
        "integrity": plan.integrity,
        "integrity_checked_blocks": sum(r.get("integrity_checked_blocks", 0) for r in ranks),
        "geometry": plan.geo.__dict__, "ranks": ranks, "failed": failed,
    }


def run_demo(plan: DemoPlan, show_progress: bool = True) -> dict[str, Any]:
    if plan.mode == "push" and not plan.decode_port:
        plan = dataclasses.replace(plan, decode_port=free_port_range(plan.decode_tp, plan.host))
    serving = Serving(plan)
    try:
        serving.wait_ready(timeout=300)
        result = run_pull(plan, show_progress)
        # returns as soon as every rank reported; the bound only matters on a loaded machine
        result["prefill_leases"] = serving.wait_served(timeout=120 if result["verified"] else 1)
    finally:
        serving.close()
    result["prefill_failures"] = serving.failures()  # a rank that died verifies nothing
    leases = result["prefill_leases"]
    result["leaks"] = sum(s.get("held_blocks", 0) for s in leases.values())
    if plan.mode == "push":  # the prefill side planned and posted the writes
        result["raw_descriptors"] = sum(s.get("raw_descriptors", 0) for s in leases.values())
        result["descriptors"] = sum(s.get("descriptors", 0) for s in leases.values())
        result["verified"] = result["verified"] and all(
            s.get("push_failed", 1) == 0 for s in leases.values())
    result["verified"] = bool(result["verified"] and len(leases) == plan.prefill_tp
                              and result["leaks"] == 0 and not result["prefill_failures"])
    return result
