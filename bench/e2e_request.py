"""A request end to end through the public API (KVWorker.hold -> read -> poll), with baselines
measured in the same run on the same bytes.

    .venv/bin/python bench/e2e_request.py                          # CPU, tcp
    .venv/bin/python bench/e2e_request.py --transport nixl         # CPU, nixl (if importable)
    python bench/e2e_request.py --device cuda                      # GPU, cuda_ipc (docs/e2e.md)

Two processes (spawn). The producer (prefill) owns a vLLM FlashAttention-shaped bf16 cache,
``(2, num_blocks, 16, heads, 128)`` per layer, fills a request's blocks with a pattern unique to
(request, layer, K|V, block, element) *before* anything is timed, holds them
(``KVWorker.hold``) and sends the block ids and the hold's generation back through a Queue, as a
serving router passes ``kv_transfer_params``. The consumer (decode, this process) fills its
destination blocks with a sentinel, then times ``read(..., generation=gen)`` -> the ``poll()``
that reports the request finished, then (outside the timed window) checks every element of
every request against the recomputed pattern.

Block ids: prefill side contiguous (request slot ``k`` holds blocks ``[k*n, (k+1)*n)``); decode
side shuffled runs of 1-8 consecutive blocks (seeded), disjoint between requests in flight.

Modes: ``sleep`` (0.2 ms sleep between polls, a serving loop), ``spin`` (tight poll loop, a busy
worker), one request at a time and interleaved request by request; ``inflight8`` (``--inflight``
requests posted at once, timed to the last finished), the caller sleeping between polls, and
``inflight8_spin``, polling in a tight loop. ``--op write`` times ``write()`` (the
decode pushes into the producer's blocks) instead; ``--op both`` runs a READ round and a
WRITE round of the same shape, in a fresh random order each time (modes ``<mode>_write``), so
the two are compared on the same stretch of the machine's noise; each mode's ``read_vs_write``
is READ's median time against WRITE's (negative: READ faster) with a 90 % bootstrap
interval, through kvlink and for the transport alone.

Baselines, same run, same extents/bytes: the transport alone (under a standing hold of the
whole prefill cache, as a least-privilege owner serves no READ without a grant; the worker's
own connected transport and peer agent, ``plan_transfer`` once outside the timed window, post
-> poll DONE, same poll mode, run right after each kvlink request); CPU: a plain-socket
transfer of the same bytes right after each request and its transport-alone run
(bench/tcp_vs_socket.SocketPeer, one peer process for the run); GPU: one contiguous device copy
of the same bytes (CUDA events) and torch's in-process gather of the same block ids
(index_select + index_copy_ per layer, CUDA events).
Writes bench/results/e2e_request_<device>_<transport>[_write|_both].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import change_interval, write_result
from e2e_producer import (  # noqa: F401  (integrity_overhead.py uses them through this module)
    ALONE,
    BS,
    CASES,
    CPU_CASES,
    DIM,
    GPU_CASES,
    POLL_SLEEP,
    Cache,
    Case,
    MiB,
    Producer,
    _stats,
    _sync,
    _torch,
    add_idle_poll_arg,
    add_layer_gap_arg,
    add_omp_arg,
    pattern,
    phase_medians,
    quiet_omp,
    regions_label,
    run_shuffled,
    use_layer_gap,
    worker_stats,
)
from e2e_report import (
    GOALS_TEXT,
    _git_commit,
    _gpu_name,
    _loadavg,
    _sleep_measured,
    goals,
    print_table,
)

#: the modes of --inflight requests posted at once: the caller sleeping 0.2 ms between polls
#: (a serving loop), and polling in a tight loop. In the first the last request is seen only
#: at the poll after a sleep: half the sleep's 0.27 ms grain on average, a sixth of the 70B
#: TP8-rank batch's 0.8 ms (docs/history/e2e.md, "8 in flight")
INFLIGHT_MODES = ("inflight8", "inflight8_spin")


class Consumer:
    """The decode side of one case: its worker, cache, and the timed loops."""

    def __init__(self, args: argparse.Namespace, name: str, prod: Producer) -> None:
        from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

        torch = _torch()
        self.torch, self.args, self.name, self.prod = torch, args, name, prod
        self.case = c = CASES[name]
        self.device = args.device_name
        self.inflight = args.inflight
        self.prefill_blocks = self.inflight * c.blocks
        self.nblocks = self.inflight * c.blocks + max(64, c.blocks // 2)
        port, self.alone_gen = prod.ask(("case", name, self.prefill_blocks), "ready",
                                        timeout=300)
        self.cache = Cache(c, self.nblocks, self.device)
        self.w = KVWorker(WorkerConfig(engine_id=f"e2e-d-{name}", transports=[args.transport],
                                       transport_options={args.transport: dict(args.options)},
                                       serve=False,
                                       integrity=getattr(args, "integrity", "off")))
        self.w.register(self.cache.spec())
        self.remote = RemoteEngine(f"e2e-p-{name}", "127.0.0.1", port)
        self.rng = np.random.default_rng(args.seed)
        self.req_no = 0
        self.mismatches: dict[str, int] = {}
        self.verified: dict[str, int] = {}
        self.xfer: dict[str, list[float]] = {}
        self.peer: Any = None  # the handshake's Peer, after the first request
        #: CPU, in run(): the plain-socket peer whose round follows each request (baselines)
        self.socket_peer: Any = None
        #: --profile: cProfile of the timed windows of one-at-a-time spin requests
        self.profile: Any = None
        if getattr(args, "profile", None):
            import cProfile

            self.profile = cProfile.Profile()

    # ---------------------------------------------------------------- helpers
    def _hold(self, tag: str, count: int) -> list[tuple[str, int, list[int], int]]:
        """Ask the producer to fill and hold ``count`` requests (slots 0..count-1)."""
        reqs = []
        for slot in range(count):
            self.req_no += 1
            reqs.append((f"{self.name}-{tag}-{self.req_no}", self.req_no, slot))
        held = self.prod.ask(("hold", reqs), "held")
        return [(rid, no, ids, gen) for (rid, no, _), (_, ids, gen) in zip(reqs, held)]

    def _local_ids(self, count: int) -> list[np.ndarray]:
        order = run_shuffled(self.rng, self.nblocks)
        n = self.case.blocks
        return [order[i * n:(i + 1) * n] for i in range(count)]

    def _expected(self, req_no: int, rids: list[int]) -> Any:
        torch, c = self.torch, self.case
        ids = torch.tensor(rids, dtype=torch.int64)
        exp = torch.empty((c.layers, 2, len(rids), c.page_elems), dtype=torch.int16,
                          device=self.device)
        for li in range(c.layers):
            exp[li] = pattern(c, req_no, li, ids, self.device)
        return exp

    def _sentinel(self, lids: list[np.ndarray]) -> None:
        idx = self.torch.from_numpy(np.concatenate(lids)).to(self.device)
        self.cache.i16.index_fill_(2, idx, -1)
        _sync(self.device)

    def _check(self, key: str, lids: np.ndarray, exp: Any) -> int:
        idx = self.torch.from_numpy(lids).to(self.device)
        got = self.cache.i16.index_select(2, idx).reshape(exp.shape)
        bad = int((got != exp).sum().item())
        self.verified[key] = self.verified.get(key, 0) + 1
        self.mismatches[key] = self.mismatches.get(key, 0) + bad
        if bad:
            print(f"  MISMATCH {key}: {bad} of {exp.numel()} elements wrong", flush=True)
        return bad

    def _wait_all(self, pending: set[str], spin: bool, t0: float) -> float:
        timeout = self.args.timeout
        while pending:
            done, failed = self.w.poll()
            bad = pending & set(failed)
            if bad:
                raise RuntimeError(f"requests failed: { {r: failed[r] for r in bad} }")
            pending -= done
            if not pending:
                break
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{sorted(pending)} not finished within {timeout} s")
            if not spin:
                time.sleep(POLL_SLEEP)
        return time.perf_counter() - t0

    def kvlink(self, held: list[tuple[str, int, list[int], int]], lids: list[np.ndarray],
               spin: bool, tag: str | None) -> float:
        """read(..., generation=gen) of every request at once -> the poll that reports the
        last one finished."""
        w, remote = self.w, self.remote
        pending = {rid for rid, *_ in held}
        prof = self.profile if spin and tag == "spin" else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        for (rid, _, rids, gen), li in zip(held, lids):
            w.read(rid, remote, li, rids, generation=gen)
        dt = self._wait_all(pending, spin, t0)
        if prof is not None:
            prof.disable()
        self._idle_poll()
        for rid, *_ in held:
            x = w.xfer_seconds.pop(rid, None)
            if x is not None and tag is not None:
                self.xfer.setdefault(tag, []).append(x)
        return dt

    def _idle_poll(self) -> None:
        """Untimed, after a window: one poll with nothing in flight, as a serving loop's next
        step makes (vLLM asks ``get_finished`` every step). The worker sends there what it
        owes peers once a request is reported (the READ's report that lets the producer
        release: ``kvlink.worker.peering._tell_later``); with no such poll between windows
        those reports waited until they were overdue (50 ms) and left inside a later request's
        window — a whole poll in about a third of the 70B requests on one H200
        (bench/results/gpu_checks_quiet_polls/). ``--no-idle-poll``: as before."""
        if not getattr(self.args, "no_idle_poll", False):
            self.w.poll()

    def alone(self, plans: list[Any], spin: bool, op: Any = None) -> float:
        """The worker's connected transport alone: post every plan, poll until all DONE."""
        from kvlink.grants import read_ticket
        from kvlink.transport import Op, XferStatus

        t, agent = self.peer.transport, self.peer.agent
        op = Op.READ if op is None else op
        ticket = read_ticket(ALONE, self.alone_gen) if op is Op.READ else b""
        t0 = time.perf_counter()
        hs = [t.post(op, agent, p.local, p.remote, ticket=ticket) for p in plans]
        left = set(hs)
        while left:
            for h in list(left):
                st = t.poll(h)
                if st.status is XferStatus.PENDING:
                    continue
                if st.status is not XferStatus.DONE:
                    raise RuntimeError(f"transport-alone {op.value} failed: {st.reason}")
                left.discard(h)
            if not left:
                break
            if time.perf_counter() - t0 > self.args.timeout:
                raise TimeoutError(f"transport-alone {op.value} not done in time")
            if not spin:
                time.sleep(POLL_SLEEP)
            elif t.capabilities.python_threads:  # yield as KVWorker.poll does: tcp's own
                time.sleep(0)  # threads move these bytes (a loop that never yields starves them)
        dt = time.perf_counter() - t0
        for h in hs:
            t.release(h)
        return dt

    def plan(self, lids: np.ndarray, rids: list[int]) -> Any:
        from kvlink.plan import plan_transfer

        assert self.w.spec is not None
        return plan_transfer(self.w.spec, self.peer.spec, lids, rids, None,
                             self.peer.transport.extents)

    # ---------------------------------------------------------------- the run
    def one_round(self, tag: str, count: int, spin: bool, out: dict[str, list[float]],
                  count_it: bool = True, op: str | None = None) -> None:
        """``count`` requests at once through kvlink, verified; then the transport alone on
        the same extents, verified. ``op``: read or write (default: --op's)."""
        op = op or self.args.op
        if op == "both":
            op = "read"
        if op == "write":
            self.write_round(tag, count, spin, out, count_it)
            return
        held = self._hold(tag, count)
        lids = self._local_ids(count)
        exps = [self._expected(no, rids) for _, no, rids, _ in held]
        self._sentinel(lids)
        dt = self.kvlink(held, lids, spin, tag if count_it else None)
        for li, exp in zip(lids, exps):
            self._check(tag if count_it else "warmup", li, exp)
        if self.peer is None:  # after the first request: the handshake's peer
            self.peer = self.w.peers.get(self.remote, 0).result(timeout=self.args.timeout)
        a = time.perf_counter()
        plans = [self.plan(li, rids) for li, (_, _, rids, _) in zip(lids, held)]
        plan_s = time.perf_counter() - a
        self._sentinel(lids)
        da = self.alone(plans, spin)
        for li, exp in zip(lids, exps):
            self._check(f"{tag}/transport_alone" if count_it else "warmup", li, exp)
        self._socket_round(count, out, count_it)
        if count_it:
            out.setdefault("kvlink", []).append(dt)
            out.setdefault("transport_alone", []).append(da)
            out.setdefault("plan", []).append(plan_s)
            out.setdefault("descriptors", []).append(sum(p.descriptors for p in plans))

    def _socket_round(self, count: int, out: dict[str, list[float]], count_it: bool) -> None:
        """CPU: the same bytes through a plain socket, right after the request and its
        transport-alone run (``socket_peer``; a warm-up's round allocates its buffers)."""
        if self.socket_peer is not None:
            took = self.socket_peer.round(self.case.nbytes * count)
            if count_it:
                out.setdefault("plain_socket", []).append(took)

    def write_round(self, tag: str, count: int, spin: bool, out: dict[str, list[float]],
                    count_it: bool) -> None:
        """--op write: ``count`` requests WRITTEN from our blocks into the producer's (sentinel-
        filled first), ``write()`` to the poll that reports them finished, checked there
        element by element; then the transport alone (``post(WRITE)``) on the same extents,
        checked the same way."""
        from kvlink.transport import Op

        torch, c = self.torch, self.case
        self.req_no += count
        nos = list(range(self.req_no - count + 1, self.req_no + 1))
        lids = self._local_ids(count)
        rids = self.prod.ask(("blank", list(range(count))), "blanked")
        for no, li, ri in zip(nos, lids, rids):  # our blocks hold what the producer checks
            exp = self._expected(no, ri).view(c.layers, 2, len(ri), BS, c.heads, DIM)
            self.cache.i16.index_copy_(2, torch.from_numpy(li).to(self.device), exp)
        _sync(self.device)
        w, pending = self.w, set()
        t0 = time.perf_counter()
        for no, li, ri in zip(nos, lids, rids):
            rid = f"{self.name}-{tag}-w{no}"
            w.write(rid, self.remote, li, ri)
            pending.add(rid)
        dt = self._wait_all(pending, spin, t0)
        self._idle_poll()
        key = tag if count_it else "warmup"
        self._count(key, self.prod.ask(("check", list(zip(nos, range(count)))), "checked"))
        if self.peer is None:
            self.peer = self.w.peers.get(self.remote, 0).result(timeout=self.args.timeout)
        a = time.perf_counter()
        plans = [self.plan(li, ri) for li, ri in zip(lids, rids)]
        plan_s = time.perf_counter() - a
        self.prod.ask(("blank", list(range(count))), "blanked")
        da = self.alone(plans, spin, Op.WRITE)
        self._count(f"{tag}/transport_alone" if count_it else "warmup",
                    self.prod.ask(("check", list(zip(nos, range(count)))), "checked"))
        self._socket_round(count, out, count_it)
        if count_it:
            out.setdefault("kvlink", []).append(dt)
            out.setdefault("transport_alone", []).append(da)
            out.setdefault("plan", []).append(plan_s)
            out.setdefault("descriptors", []).append(sum(p.descriptors for p in plans))

    def _count(self, key: str, bad: list[int]) -> None:
        self.verified[key] = self.verified.get(key, 0) + len(bad)
        self.mismatches[key] = self.mismatches.get(key, 0) + sum(bad)
        if any(bad):
            print(f"  MISMATCH {key}: {sum(bad)} elements wrong", flush=True)

    def run(self) -> dict[str, Any]:
        c, n_req = self.case, self.args.requests_for(self.name)
        print(f"[{self.name}] {c.layers} layers x {c.heads} KV heads x {c.blocks} blocks = "
              f"{c.nbytes / MiB:.1f} MiB/request, {n_req} requests per mode", flush=True)
        # --op both: a READ and a WRITE round of each shape (modes "<mode>_write"), so the
        # two ops are compared on the same stretch of the machine
        ops = ("read", "write") if self.args.op == "both" else (self.args.op,)
        if not self.device.startswith("cuda"):
            from tcp_vs_socket import SocketPeer

            self.socket_peer = SocketPeer(MiB)
        for op in ops:
            self.one_round("warmup", 1, False, {}, count_it=False, op=op)  # handshake: not
            self.one_round("warmup", self.inflight, False, {}, count_it=False, op=op)  # timed
        raw: dict[str, dict[str, list[float]]] = {
            f"{m}{'_write' if op == 'write' and len(ops) > 1 else ''}": {}
            for m in ("sleep", "spin", *INFLIGHT_MODES) for op in ops}

        order_rng = np.random.default_rng(self.args.seed + 1)

        def rounds(mode: str, count: int, spin: bool) -> None:
            # --op both: READ and WRITE in a fresh random order every round (a fixed order
            # biased the integrity bench's identical series by 8-12 %: docs/integrity.md)
            for op in (ops if len(ops) == 1 else order_rng.permutation(ops).tolist()):
                tag = f"{mode}_write" if op == "write" and len(ops) > 1 else mode
                self.one_round(tag, count, spin, raw[tag], op=op)

        for i in range(n_req):  # sleep and spin interleaved: they share the machine's noise,
            # in a fresh order each round: a fixed one gives each mode the same predecessor,
            # and anything with a period of two polls showed up as a mode difference (the
            # worker's poll rule at 9f1d728: docs/history/e2e.md, "Launch first")
            for mode in order_rng.permutation(["sleep", "spin"]).tolist():
                rounds(mode, 1, mode == "spin")
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{n_req}", flush=True)
        for _ in range(self.args.inflight_rounds_for(n_req)):  # both pollers, fresh order
            for mode in order_rng.permutation(INFLIGHT_MODES).tolist():
                rounds(mode, self.inflight, mode == "inflight8_spin")
        stats = worker_stats(self.w)
        phases = phase_medians(self.w, self.name)
        stats_prefill = self.prod.ask(("stats",), "stats")
        if self.socket_peer is not None:
            self.socket_peer.close()
        bases = self.baselines()
        modes = {}
        for mode, r in raw.items():
            base_mode = mode.removesuffix("_write")
            count = self.inflight if base_mode in INFLIGHT_MODES else 1
            nbytes = c.nbytes * count
            row: dict[str, Any] = {
                "requests_at_once": count, "bytes": nbytes,
                "kvlink": _stats(r["kvlink"]), "transport_alone": _stats(r["transport_alone"]),
                "plan_once_median_s": statistics.median(r["plan"]),
                "descriptors": int(statistics.median(r["descriptors"])),
                "verified": self.verified.get(mode, 0),
                "mismatches": self.mismatches.get(mode, 0),
                "transport_alone_verified": self.verified.get(f"{mode}/transport_alone", 0),
                "transport_alone_mismatches": self.mismatches.get(f"{mode}/transport_alone", 0),
                "raw_s": {k: r[k] for k in ("kvlink", "transport_alone")},
            }
            k = row["kvlink"]["median_s"]
            row["kvlink_gbps"] = nbytes / k / 1e9
            row["ratio_kvlink_over_transport_alone"] = k / row["transport_alone"]["median_s"]
            xf = self.xfer.get(mode)
            if xf:
                row["worker_xfer_seconds_median_s"] = statistics.median(xf)
            if mode in phases:
                row["worker_phases_median_s"] = phases[mode]
            b = bases.get(base_mode, {})
            if "plain_socket" in r:  # CPU: the rounds right after each request of the modes
                # that move these bytes (the poll mode is the caller's, a socket has none)
                sock = [x for m, rr in raw.items() if m.removesuffix("_write") in (
                    INFLIGHT_MODES if count > 1 else ("sleep", "spin"))
                        for x in rr.get("plain_socket", ())]
                b = {"plain_socket": {**_stats(sock), "raw_s": sock, "chunk_bytes": MiB,
                                      "rounds": "one after each request of these bytes"}}
            row["baselines"] = b
            for base, key in (("device_copy", "ratio_device_copy_over_kvlink"),
                              ("gather", "ratio_gather_over_kvlink")):
                if base in b:
                    row[key] = b[base]["median_s"] / k
            if "plain_socket" in b:
                row["ratio_kvlink_over_plain_socket"] = k / b["plain_socket"]["median_s"]
            modes[mode] = row
        if len(ops) > 1:  # READ's time against WRITE's, mode by mode (negative: READ faster)
            for mode in ("sleep", "spin", *INFLIGHT_MODES):
                r, w = raw[mode]["kvlink"], raw[f"{mode}_write"]["kvlink"]
                ra, wa = raw[mode]["transport_alone"], raw[f"{mode}_write"]["transport_alone"]
                modes[mode]["read_vs_write"] = {
                    "kvlink": statistics.median(r) / statistics.median(w) - 1,
                    "kvlink_90pct": change_interval(w, r),
                    "transport_alone": statistics.median(ra) / statistics.median(wa) - 1,
                    "transport_alone_90pct": change_interval(wa, ra)}
        # what the transport expects its copies to run at (cuda_ipc: what a poll's grace
        # waits on), next to the device copy's rate in the same run
        rate = getattr(self.peer.transport, "copy_rate", None) if self.peer else None
        return {"layers": c.layers, "kv_heads": c.heads, "blocks": c.blocks,
                "copy_rate_estimate_gbps": None if rate is None else rate / 1e9,
                "bytes_per_request": c.nbytes, "requests_per_mode": n_req,
                "prefill_cache_blocks": self.prefill_blocks, "decode_cache_blocks": self.nblocks,
                "modes": modes, "worker_stats_decode": stats,
                "worker_stats_prefill": stats_prefill}

    def baselines(self) -> dict[str, dict[str, Any]]:
        """GPU, per mode: what the same bytes cost without kvlink (see the module docstring;
        the CPU's plain socket is measured request by request, in the rounds)."""
        out: dict[str, dict[str, Any]] = {}
        if not self.device.startswith("cuda"):
            return out
        one = {"device_copy": self._device_copy(self.case.nbytes), "gather": self._gather(1)}
        many = {"device_copy": self._device_copy(self.case.nbytes * self.inflight),
                "gather": self._gather(self.inflight)}
        out["sleep"] = out["spin"] = one
        out["inflight8"] = out["inflight8_spin"] = many
        return out

    def _events(self, fn: Callable[[], None], reps: int) -> dict[str, Any]:
        """CUDA-event time of ``fn`` (one call per pair of events, after one untimed call),
        and its host time between two synchronizes."""
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        dev, host = [], []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            host.append(time.perf_counter() - h0)
            dev.append(e0.elapsed_time(e1) / 1e3)
        return {**_stats(dev), "host_sync_median_s": statistics.median(host),
                "timing": "cuda events"}

    def _device_copy(self, nbytes: int) -> dict[str, Any]:
        torch = self.torch
        src = torch.ones(nbytes // 2, dtype=torch.int16, device=self.device)
        dst = torch.zeros_like(src)
        r = self._events(lambda: dst.copy_(src), 30)
        return {**r, "bytes": nbytes}

    def _gather(self, count: int) -> dict[str, Any]:
        """torch in one process: a prefill-shaped source cache, the same block ids (prefill
        slots contiguous, decode ids run-shuffled), index_select + index_copy_ per layer."""
        torch = self.torch
        src = Cache(self.case, self.prefill_blocks, self.device)
        rid = torch.arange(count * self.case.blocks, dtype=torch.int64, device=self.device)
        lid = torch.from_numpy(np.concatenate(self._local_ids(count))).to(self.device)
        dl, sl = self.cache.layers, src.layers

        def gather() -> None:
            for d, s in zip(dl, sl):
                d.index_copy_(1, lid, s.index_select(1, rid))

        r = self._events(gather, 30)
        return {**r, "bytes": self.case.nbytes * count}

    def write_profile(self) -> None:
        """--profile: the spin windows' hottest functions, to ``<profile>.<case>.txt``."""
        if self.profile is None:
            return
        import io
        import pstats

        buf = io.StringIO()
        st = pstats.Stats(self.profile, stream=buf)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(45)
        path = f"{self.args.profile}.{self.name}.txt"
        with open(path, "w") as f:
            f.write(buf.getvalue())
        print(f"  profile of the spin windows: {path}", flush=True)

    def close(self) -> None:
        self.w.close()


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu", type=int, default=0, help="CUDA device of both processes")
    ap.add_argument("--transport", choices=("tcp", "nixl", "cuda_ipc"), default=None,
                    help="default: tcp on cpu, cuda_ipc on cuda")
    ap.add_argument("--cases", default=None,
                    help=f"comma list of {', '.join(CASES)} (default cpu: {','.join(CPU_CASES)}; "
                         f"cuda: {','.join(GPU_CASES)})")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per one-at-a-time mode (default 50; on cpu per case: "
                         + ", ".join(f"{k} {v.cpu_requests}" for k, v in CASES.items()) + ")")
    ap.add_argument("--op", choices=("read", "write", "both"), default="read",
                    help="read: the decode pulls (read()); write: it pushes its blocks into "
                         "the producer's (write(); transports that enforce grants, tcp, take "
                         "no WRITE nobody asked for); both: a WRITE round after each READ "
                         "round, modes <mode>_write (the two compared in the same run)")
    ap.add_argument("--inflight", type=int, default=8, help="requests posted at once")
    ap.add_argument("--inflight-rounds", type=int, default=None,
                    help="rounds of --inflight requests (default max(3, requests // 4))")
    ap.add_argument("--timeout", type=float, default=60.0, help="per wait, seconds")
    ap.add_argument("--seed", type=int, default=1)
    add_layer_gap_arg(ap)
    add_idle_poll_arg(ap)
    add_omp_arg(ap)
    ap.add_argument("--out", default=None)
    ap.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the transport (VALUE as JSON, e.g. coalesce_runs=false); "
                         "repeatable")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="cProfile the spin-mode timed windows; top functions to "
                         "PREFIX.<case>.txt (the figures then include the profiler's cost)")
    args = ap.parse_args()
    use_layer_gap(args.layer_gap)
    omp = quiet_omp(args.omp_spin)  # (torch is imported later)
    args.transport = args.transport or ("cuda_ipc" if args.device == "cuda" else "tcp")
    args.device_name = f"cuda:{args.gpu}" if args.device == "cuda" else "cpu"
    args.options = {"ucx_probe": False} if args.transport == "nixl" else {}
    for kv in args.transport_option:
        key, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"--transport-option {kv!r}: expected KEY=VALUE")
        try:
            args.options[key] = json.loads(value)
        except json.JSONDecodeError:
            args.options[key] = value
    names = (args.cases.split(",") if args.cases else
             GPU_CASES if args.device == "cuda" else CPU_CASES)
    for n in names:
        if n not in CASES:
            ap.error(f"unknown case {n!r}; known: {', '.join(CASES)}")
    args.requests_for = lambda n: (args.requests if args.requests is not None else
                                   50 if args.device == "cuda" else CASES[n].cpu_requests)
    args.inflight_rounds_for = lambda n_req: (args.inflight_rounds if args.inflight_rounds
                                              is not None else max(3, n_req // 4))
    if args.op in ("write", "both") and args.transport == "tcp":
        ap.error("--op write: the tcp transport enforces grants (an owner takes no WRITE it "
                 "did not ask for: push mode does that); use --transport nixl or cuda_ipc")
    suffix = "" if args.op == "read" else f"_{args.op}"
    out = args.out or f"bench/results/e2e_request_{args.device}_{args.transport}{suffix}.json"
    name = f"e2e_request_{args.device}_{args.transport}{suffix}"

    if args.transport == "nixl":
        try:
            import nixl  # noqa: F401
        except ImportError as exc:
            print(f"skipping: transport nixl needs `import nixl` ({exc}); pip install "
                  "'kvlink[nixl]'")
            return
    if args.device == "cuda":
        torch = _torch()
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device visible (torch.cuda.is_available() is False)")
            sys.exit(2)
        torch.cuda.set_device(args.gpu)
    elif args.transport == "cuda_ipc":
        ap.error("cuda_ipc moves GPU memory: use --device cuda")

    load0, commit = _loadavg(), _git_commit()
    prod = Producer(args.device_name, args.transport, args.options, args.timeout)
    cases: dict[str, Any] = {}
    try:
        for n in names:
            cons = Consumer(args, n, prod)
            try:
                cases[n] = cons.run()
                cons.write_profile()
            finally:
                cons.close()
            del cons
            if args.device == "cuda":
                _torch().cuda.empty_cache()
        bad = _report(args, name, out, omp, load0, commit, cases)  # (before the producer's
        # stop: a slow teardown, or a run cut off during it, loses no result)
    finally:
        prod.stop()
    if bad:
        print(f"FAILED: {bad} elements did not match what the producer wrote")
        sys.exit(1)


def _report(args: argparse.Namespace, name: str, out: str | None, omp: str,
            load0: list[float] | None, commit: str | None, cases: dict[str, Any]) -> int:
    """Print the table and the goals, write the run's JSON; returns the elements that did not
    match what the producer wrote."""
    print_table(args.device, cases)
    gl = goals(args.device, args.transport, cases)
    print("goals (from the issue):")
    for g in gl:
        mark = "n/a" if g["met"] is None else "MET" if g["met"] else "NOT MET"
        v = "-" if g["value"] is None else f"{g['value']:.3f}"
        print(f"  [{mark:7s}] {g['goal']}: {v}")
    grain = _sleep_measured()
    print(f"sleep mode: time.sleep({POLL_SLEEP * 1e3:.1f} ms) sleeps {grain * 1e3:.3f} ms here "
          "(median): the grain of its post->done")
    bad = sum(m["mismatches"] + m["transport_alone_mismatches"]
              for cr in cases.values() for m in cr["modes"].values())
    payload = {
        "device": args.device, "transport": args.transport,
        "device_name": _gpu_name(args) if args.device == "cuda" else "cpu",
        "registered_regions": regions_label(),
        "geometry": {"block_size": BS, "head_dim": DIM, "dtype": "bfloat16",
                     "per_layer_shape": "(2, num_blocks, 16, kv_heads, 128)"},
        "block_ids": {"prefill": "contiguous per request slot",
                      "decode": "shuffled runs of 1-8 consecutive blocks (seeded), disjoint "
                                "between requests in flight"},
        "poll_sleep_s": POLL_SLEEP, "poll_sleep_measured_median_s": grain,
        "mode_order": "sleep and spin alternate, in a seeded random order each round",
        "idle_poll_after_each_window": not args.no_idle_poll,
        "omp_wait_policy": omp,
        "inflight": args.inflight, "transport_options": args.options,
        "op": args.op,
        "timed_window": (f"KVWorker.{'read/write' if args.op == 'both' else args.op}() call "
                         "to the poll() that reports the request "
                         "finished (fill before, verification after, both untimed)"),
        "ratios": "ratio_device_copy_over_kvlink / ratio_gather_over_kvlink: baseline time / "
                  "kvlink time (fraction of the baseline's speed); ratio_kvlink_over_*: kvlink "
                  "time / baseline time",
        "goals_text": GOALS_TEXT["cuda" if args.device == "cuda" else "cpu"],
        "kvlink_commit": commit, "loadavg_1_5_15_start": load0, "loadavg_1_5_15_end": _loadavg(),
        "goals": gl, "total_mismatches": bad, "cases": cases,
    }
    write_result(name, payload, out)
    return int(bad)



if __name__ == "__main__":
    main()
