"""Process orchestration for `kvlink demo`, `kvlink serve` and `kvlink pull`."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from kvlink.demo.proc import RankEvents, StopFlag, child_main, exit_reason
from kvlink.demo.progress import Display
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


def _level() -> int:
    return logging.getLogger().getEffectiveLevel()


class Serving:
    """Prefill ranks running in child processes (dying with this one: kvlink.demo.proc).

    Every event of the ranks is read through :meth:`poll`, which keeps what it saw: the ranks
    that are ready, those that reported their lease accounting ("served"), and those that
    failed (their own reason, or how they exited)."""

    def __init__(self, plan: DemoPlan, display: Display | None = None) -> None:
        self.plan = plan
        self.display = display or Display(enabled=False)
        self.events = RankEvents(_mp, plan.prefill_tp)
        self.stop = StopFlag(_mp)  # (not an Event: a rank killed looking at it wedged set())
        self.ready: set[int] = set()
        self.served: dict[int, dict[str, Any]] = {}
        self.reasons: dict[int, str] = {}  # a rank's own account of why it failed
        self.procs = [
            _mp.Process(target=child_main, args=(serve_rank, _level(), os.getpid(),
                                                 self.events.of(r), r, plan, r,
                                                 self.events.of(r), self.stop),
                        name=f"kvlink-prefill-{r}")
            for r in range(plan.prefill_tp)
        ]
        n = plan.prefill_tp
        self.display.phase(f"starting {n} prefill rank{'s' if n > 1 else ''} "
                           f"({plan.device}, {plan.transport})")
        for p in self.procs:
            p.start()

    def poll(self, timeout: float = 0.0) -> None:
        """Take every event queued now (waiting up to ``timeout`` for the first)."""
        while True:
            try:
                ev = self.events.get(timeout)
            except queue.Empty:
                return
            timeout = 0.0
            kind, rank, detail = ev
            if kind == "phase":
                self.display.rank_phase("prefill", rank, self.plan.prefill_tp, detail)
            elif kind == "ready":
                self.ready.add(rank)
            elif kind == "served":
                self.served[rank] = detail
            elif kind == "failed":
                self.reasons[rank] = detail

    def dead(self) -> dict[str, str]:
        """Ranks that failed or ended without reporting, by name: why (their own reason where
        they gave one). A rank that exited 0 after reporting is not here."""
        self.poll()
        out: dict[str, str] = {}
        for r, p in enumerate(self.procs):
            if r in self.reasons:
                out[p.name] = self.reasons[r]
            elif p.exitcode is not None and (p.exitcode != 0 or r not in self.served):
                self.poll(0.05)  # its last words may still be in the pipe
                if p.exitcode == 0 and r in self.served and r not in self.reasons:
                    continue
                out[p.name] = self.reasons.get(r) or exit_reason(p.exitcode)
        return out

    def wait_ready(self, timeout: float) -> None:
        """Until every rank is ready; a rank that fails first ends the wait at once, with its
        reason (the others are stopped)."""
        deadline = time.monotonic() + timeout
        while len(self.ready) < self.plan.prefill_tp:
            self.poll(0.1)
            dead = self.dead()
            if dead:
                self.close()
                raise KVLinkError("; ".join(f"{name} failed at start-up: {why}"
                                            for name, why in sorted(dead.items())))
            if time.monotonic() > deadline:
                self.close()
                raise KVLinkError(f"prefill ranks not ready within {timeout:.0f}s "
                                  f"(ready: {sorted(self.ready) or 'none'})")

    def wait_served(self, timeout: float) -> dict[int, dict[str, Any]]:
        """Lease accounting of each prefill rank once all readers are done (or timeout, or
        every rank that has not reported is dead: see :meth:`failures`)."""
        deadline = time.monotonic() + timeout
        while len(self.served) < self.plan.prefill_tp and time.monotonic() < deadline:
            self.poll(0.1)
            if all(self.procs[r].exitcode is not None for r in range(self.plan.prefill_tp)
                   if r not in self.served):
                self.poll(0.05)
                break  # a rank died without a word: nothing more will come
        return dict(self.served)

    def failures(self) -> dict[str, int]:
        """Ranks that ended badly so far, by name: their exit code (an exception, a signal:
        negative; killed by :meth:`close` after not stopping in time: -9)."""
        return {p.name: p.exitcode for p in self.procs
                if p.exitcode is not None and p.exitcode != 0}

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self.poll()


def _stop(procs: list[Any], grace: float = 3.0) -> None:
    """SIGTERM what still runs, SIGKILL what is still there after ``grace`` seconds."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def run_pull(plan: DemoPlan, show_progress: bool | Display = True,
             watch: Callable[[], dict[str, str]] | None = None) -> dict[str, Any]:
    """Decode ranks in child processes: each pulls every request and verifies it.

    Ends as soon as every rank reported, or at once when a rank fails or dies (the others
    are stopped), or when ``watch`` (the prefill side, in ``kvlink demo``) names a dead rank.
    The result's ``rank_failures`` says who failed and why. ``show_progress``: a
    :class:`Display` to report to (left open), or whether to show one on stderr."""
    own = not isinstance(show_progress, Display)
    display = Display(bool(show_progress), total=plan.requests * plan.decode_tp) if own \
        else show_progress
    assert isinstance(display, Display)
    try:
        result = _run_pull(plan, display, watch)
    finally:
        if own:
            display.close()
    return result


def _run_pull(plan: DemoPlan, display: Display,
              watch: Callable[[], dict[str, str]] | None) -> dict[str, Any]:
    results = RankEvents(_mp, plan.decode_tp)
    procs = [
        _mp.Process(target=child_main,
                    args=(pull_rank, _level(), os.getpid(), results.of(r), r, plan, r,
                          results.of(r), display.enabled),
                    name=f"kvlink-decode-{r}")
        for r in range(plan.decode_tp)
    ]
    n = plan.decode_tp
    display.phase(f"starting {n} decode rank{'s' if n > 1 else ''} "
                  f"({plan.device_of('decode')}, {plan.transport})")
    for p in procs:
        p.start()
    ranks: dict[int, dict[str, Any]] = {}
    failures: dict[str, str] = {}

    def take(timeout: float) -> None:
        while True:
            try:
                msg = results.get(timeout)
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(msg, dict):
                ranks[int(msg["rank"])] = msg
            elif msg[0] == "phase":
                display.rank_phase("decode", msg[1], n, msg[2])
            elif msg[0] == "landed":
                display.landed(*msg[1:])
            else:
                failures[procs[msg[1]].name] = msg[2]

    # the ranks' own bound (timeout per request) plus start-up and close
    budget = plan.timeout * max(1, plan.requests) + 120
    deadline = time.monotonic() + budget
    while len(ranks) < len(procs) and not failures and time.monotonic() < deadline:
        take(0.1)
        for r, p in enumerate(procs):
            if r not in ranks and p.exitcode is not None and p.name not in failures:
                take(0.05)  # its report may still be in the pipe
                if r not in ranks and p.name not in failures:
                    failures[p.name] = exit_reason(p.exitcode)
        if watch is not None and not failures:
            failures.update(watch())
    else:
        if len(ranks) < len(procs) and not failures:
            failures.update({p.name: f"no report within {budget:.0f}s"
                             for r, p in enumerate(procs) if r not in ranks})
    _stop([p for r, p in enumerate(procs) if r not in ranks], grace=3.0)
    for p in procs:
        p.join(timeout=10)
    result = summarize(plan, list(ranks.values()))
    result["rank_failures"] = failures
    result["verified"] = bool(result["verified"] and not failures)
    return result


def summarize(plan: DemoPlan, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode ranks' figures, summed over the ranks that reported (``decode_reported``
    says how many of ``decode_tp`` did)."""
    ranks.sort(key=lambda r: r["rank"])
    total = sum(r["bytes"] for r in ranks)
    seconds = max((r["seconds"] for r in ranks), default=0.0)
    failed = {k: v for r in ranks for k, v in r["failed"].items()}
    used = sorted({t for r in ranks for t in r.get("transports_used", [])},
                  key=lambda t: plan.transports.index(t) if t in plan.transports else 99)
    verified = (len(ranks) == plan.decode_tp and not failed
                and all(r["mismatches"] == 0 and r["requests"] == plan.requests for r in ranks))
    return {
        "verified": verified, "transport": ",".join(used) or plan.transport,
        "transports": plan.transports, "device": plan.device,
        "decode_device": plan.device_of("decode"), "mode": plan.mode,
        "requests": plan.requests, "tokens": plan.tokens, "bytes": total,
        "seconds": seconds, "gbps": total / seconds / 1e9 if seconds else 0.0,
        "raw_descriptors": sum(r["raw_descriptors"] for r in ranks),
        "descriptors": sum(r["descriptors"] for r in ranks),
        "prefill_tp": plan.prefill_tp, "decode_tp": plan.decode_tp,
        "decode_reported": len(ranks),
        "requests_verified": sum(r["requests"] for r in ranks),
        "integrity": plan.integrity,
        "integrity_checked_blocks": sum(r.get("integrity_checked_blocks", 0) for r in ranks),
        "geometry": plan.geo.__dict__, "ranks": ranks, "failed": failed,
    }


def run_demo(plan: DemoPlan, show_progress: bool = True,
             startup_timeout: float = 300.0) -> dict[str, Any]:
    """Prefill and decode ranks on this machine. A rank that fails at start-up raises
    :class:`KVLinkError` naming it and why; one that dies later ends the run at once (its
    reason in ``rank_failures``). ``leaks`` is None when a prefill rank did not report."""
    if plan.mode == "push" and not plan.decode_port:
        plan = dataclasses.replace(plan, decode_port=free_port_range(plan.decode_tp, plan.host))
    display = Display(show_progress, total=plan.requests * plan.decode_tp)
    try:
        serving = Serving(plan, display)
        try:
            serving.wait_ready(timeout=startup_timeout)
            result = run_pull(plan, display, watch=serving.dead)
            if not result["verified"]:
                serving.stop.set()  # nothing more will be read: the ranks report what they hold
            display.phase("collecting the prefill ranks' lease accounting")
            # returns as soon as every rank reported; the bound only matters on a loaded machine
            leases = serving.wait_served(timeout=120 if result["verified"] else 10)
        finally:
            serving.close()
    finally:
        display.close()
    result["rank_failures"].update(serving.dead())
    result["prefill_leases"] = leases
    result["prefill_failures"] = serving.failures()  # a rank that died verifies nothing
    complete = len(leases) == plan.prefill_tp
    result["prefill_reported"] = len(leases)
    result["leaks"] = sum(s.get("held_blocks", 0) for s in leases.values()) if complete else None
    if plan.mode == "push":  # the prefill side planned and posted the writes
        used = {t for s in leases.values() for t in s.get("transports_used", [])}
        if used:
            result["transport"] = ",".join(t for t in plan.transports if t in used)
        result["raw_descriptors"] = sum(s.get("raw_descriptors", 0) for s in leases.values())
        result["descriptors"] = sum(s.get("descriptors", 0) for s in leases.values())
        result["verified"] = result["verified"] and all(
            s.get("push_failed", 1) == 0 for s in leases.values())
    result["verified"] = bool(result["verified"] and complete and result["leaks"] == 0
                              and not result["prefill_failures"] and not result["rank_failures"])
    return result
