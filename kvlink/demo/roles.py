"""Prefill ("serve") and decode ("pull") ranks of the demo, one process each.

Request i lives in prefill blocks ``[slot*n, slot*n + n)``; the decode side allocates its blocks as
shuffled runs of 1-8 contiguous ids — like a real, fragmented allocator — so the numbers show
what coalescing buys. Both sides derive the block ids from the request index alone, standing in
for the ids vLLM's kv_transfer_params carry.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.demo import data
from kvlink.errors import KVLinkError, TransferRefused
from kvlink.headmap import push_targets
from kvlink.leases import new_generation
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

log = logging.getLogger("kvlink.demo")


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    geo: data.Geometry
    requests: int = 8
    tokens: int = 1024
    prefill_tp: int = 1
    decode_tp: int = 1
    #: a transport, or a comma-separated list the worker tries in order per peer (the first
    #: that reaches the pair of memories is used)
    transport: str = "tcp"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 5600
    cache_bytes: int = 1 << 30  # per instance, split over its ranks
    lease_seconds: float = 120.0
    timeout: float = 60.0
    mode: str = "pull"  # "push": decode asks, prefill batch-WRITEs (Mooncake style)
    decode_port: int = 0  # push mode: decode side channel base port
    integrity: str = "off"  # WorkerConfig.integrity of both sides (pull mode)
    #: WorkerConfig.handshake_timeout of both sides: how long to try reaching a peer
    handshake_timeout: float = 10.0
    #: the holds' generations derive from it, as the block ids derive from the request index
    #: (both standing in for what a router passes along in kv_transfer_params)
    run_id: int = dataclasses.field(default_factory=new_generation)
    #: whether the decode is told each hold's generation (so it READs at once): true where one
    #: plan drives both sides (``kvlink demo``); a ``kvlink pull`` is a process of its own,
    #: which cannot know the generations its ``kvlink serve`` minted, so it announces each
    #: READ and is told the generation (kvlink.worker's read intent)
    told_generations: bool = True
    #: where the prefill's KV cache lives: "cpu" (numpy) or "cuda:N" (a torch tensor there)
    device: str = "cpu"
    #: where the decode's lives (None: ``device``)
    decode_device: str | None = None

    @property
    def transports(self) -> list[str]:
        return [t.strip() for t in self.transport.split(",") if t.strip()]

    def device_of(self, side: str) -> str:
        return self.device if side == "prefill" or self.decode_device is None \
            else self.decode_device

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.geo.block_size)

    def slots(self, tp: int) -> int:
        per_req = self.blocks_per_request * self.geo.block_bytes(tp)
        return max(1, min(self.requests, self.cache_bytes // tp // per_req))

    def prefill_blocks(self, i: int) -> npt.NDArray[np.int64]:
        n = self.blocks_per_request
        return np.arange(n, dtype=np.int64) + (i % self.slots(self.prefill_tp)) * n

    def generation(self, i: int) -> int:
        """Request i's hold generation: minted by the parent, so the decode READs at once."""
        return (self.run_id + i) % (2**62) + 1

    def decode_blocks(self, i: int) -> npt.NDArray[np.int64]:
        n = self.blocks_per_request
        rng = np.random.default_rng(1000 + i)
        cuts = np.cumsum(rng.integers(1, 9, size=n))
        runs = np.split(np.arange(n, dtype=np.int64), cuts[cuts < n])
        order = rng.permutation(len(runs))
        ids: npt.NDArray[np.int64] = np.concatenate([runs[k] for k in order])
        return ids + (i % self.slots(self.decode_tp)) * n


def use_device(device: str) -> None:
    """Make ``device`` ("cuda:N") this process's current CUDA device; nothing for "cpu"."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def used_transports(worker: KVWorker) -> list[str]:
    """The transports that moved bytes of this worker (posted by it: the reader's side)."""
    return [n for n, st in worker.stats().items() if st.transfers or st.bytes]


def _allocate(plan: DemoPlan, side: str, tp: int, rank: int, nblocks: int,
              say: Any) -> tuple[Any, list[Any]]:
    device = plan.device_of(side)
    use_device(device)
    size = nblocks * plan.geo.block_bytes(tp) / 2**20
    say(f"allocating the KV cache ({size:,.1f} MiB on {device})")
    return data.allocate(plan.geo, nblocks, tp, rank, device)


def _register(worker: KVWorker, spec: Any, plan: DemoPlan, say: Any) -> None:
    say(f"registering the cache with {', '.join(plan.transports)}")
    worker.register(spec)


def serve_rank(plan: DemoPlan, rank: int, ready: Any, stop: Any) -> None:
    """A prefill rank: fill, register, answer handshakes, free blocks as readers finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    geo, tp = plan.geo, plan.prefill_tp

    def say(text: str) -> None:
        ready.put(("phase", rank, text))

    nblocks = plan.slots(tp) * plan.blocks_per_request
    _buf, layers = _allocate(plan, "prefill", tp, rank, nblocks, say)
    say("filling the KV cache with test data")
    data.fill(geo, layers, tp, rank)
    worker = KVWorker(WorkerConfig(
        engine_id="prefill", tp_rank=rank, tp_size=tp, transports=plan.transports,
        host=plan.host, advertise_host=plan.advertise_host, side_port=plan.port,
        lease_seconds=plan.lease_seconds, serve_pushes=plan.mode == "push",
        integrity=plan.integrity, handshake_timeout=plan.handshake_timeout))
    spec = data.spec_of(geo, layers, tp, rank)
    _register(worker, spec, plan, say)
    if plan.mode == "push":
        _serve_push(plan, rank, worker, ready, stop)
        return
    for i in range(plan.requests):
        worker.hold(f"req-{i}", plan.prefill_blocks(i), generation=plan.generation(i))
    ready.put(("ready", rank, worker.side_port))
    read = 0
    try:
        # until every request was read; an expired one keeps us up until the parent stops us
        # (a late reader is refused, and a READ the lease expired under is told so)
        while not stop.is_set() and read < plan.requests:
            read += sum(r.why == "read" for r in worker.released())
            time.sleep(0.002)
    finally:
        ready.put(("served", rank, dataclasses.asdict(worker.leases.stats)))
        worker.close()


def request_index(plan: DemoPlan, req_id: str) -> int | None:
    """Request i of the plan is called ``req-<i>``; None for any other id (not ours)."""
    num = req_id.removeprefix("req-")
    if num == req_id or not (num.isascii() and num.isdecimal()) or len(num) > 12:
        return None
    i = int(num)
    return i if f"req-{i}" == req_id and i < plan.requests else None


def _take_push(plan: DemoPlan, worker: KVWorker, msg: wire.PushRequest,
               stats: dict[str, int]) -> None:
    """Start one push, or refuse it (the decode is told at once, and this rank goes on): a
    request this prefill does not have, a push the worker will not write, or a bug on a
    peer's input — a message never takes the rank down."""
    i = request_index(plan, msg.req_id)
    try:
        if i is None:
            raise TransferRefused(f"no request {msg.req_id[:80]!r} here (this prefill serves "
                                  f"req-0..req-{plan.requests - 1})")
        worker.push(msg, plan.prefill_blocks(i))
        return
    except KVLinkError as exc:
        why = str(exc)
        log.warning("push of %.80r to %.80s rank %d refused: %s", msg.req_id, msg.engine_id,
                    msg.tp_rank, why)
    except Exception as exc:  # a peer's message found a bug: refuse it, go on
        why = f"{type(exc).__name__}: {exc}"
        log.exception("push of %.80r to %.80s rank %d failed", msg.req_id, msg.engine_id,
                      msg.tp_rank)
    stats["push_failed" if i is not None else "push_refused"] += 1
    try:
        worker.refuse_push(msg, why)
    except Exception:  # its address may be anything: logged, not fatal
        log.exception("could not tell %.80s rank %d that its push is refused", msg.engine_id,
                      msg.tp_rank)


def _serve_push(plan: DemoPlan, rank: int, worker: KVWorker, ready: Any, stop: Any) -> None:
    """Push mode: WRITE each request into the decode ranks that ask, as soon as they ask.

    The prefill holds nothing for a reader; a failed write is reported and forgotten. A push
    of a request this prefill does not have is refused (``push_refused``) and not counted
    towards the end of serving.
    """
    spec = worker._require_spec()
    targets = sum(bool(push_targets(plan.prefill_tp, rank, plan.decode_tp, d, spec.total_kv_heads,
                                    spec.mla)) for d in range(plan.decode_tp))
    stats: dict[str, Any] = {"pushed": 0, "push_failed": 0, "push_refused": 0,
                             "held_blocks": 0}
    ready.put(("ready", rank, worker.side_port))
    try:
        while (not stop.is_set()
               and stats["pushed"] + stats["push_failed"] < plan.requests * targets):
            for msg in worker.push_requests():
                _take_push(plan, worker, msg, stats)
            done, failed = worker.poll()
            stats["pushed"] += len(done)
            stats["push_failed"] += len(failed)
            if not done and not failed:
                time.sleep(0.0005)
        stats["raw_descriptors"], stats["descriptors"] = worker.descriptor_counts()
        stats["transports_used"] = used_transports(worker)
    finally:
        ready.put(("served", rank, stats))
        worker.close()


class _Landed:
    """A decode rank's "landed" events for the parent's progress bar: its totals, at most 20
    a second (and at the end of every wave)."""

    def __init__(self, results: Any, rank: int, enabled: bool) -> None:
        self.results, self.rank, self.enabled = results, rank, enabled
        self.done, self.last = 0, 0.0

    def __call__(self, done: int, nbytes: int, seconds: float, force: bool = False) -> None:
        self.done += done
        now = time.monotonic()
        if self.enabled and (force or now - self.last >= 0.05):
            self.last = now
            self.results.put(("landed", self.rank, self.done, nbytes, seconds))


def pull_rank(plan: DemoPlan, rank: int, results: Any, report_progress: bool = True) -> None:
    """A decode rank: pull every request, verify every byte, report numbers.

    ``report_progress``: also put its phases and landed requests on ``results`` (tuples
    ``("phase", rank, text)``, ``("landed", rank, requests, bytes, seconds)``) for the
    parent's display; the final report is a dict."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    geo, tp = plan.geo, plan.decode_tp

    def say(text: str) -> None:
        if report_progress:
            results.put(("phase", rank, text))

    slots = plan.slots(tp)
    _buf, layers = _allocate(plan, "decode", tp, rank, slots * plan.blocks_per_request, say)
    push = plan.mode == "push"
    worker = KVWorker(WorkerConfig(engine_id="decode", tp_rank=rank, tp_size=tp,
                                   transports=plan.transports, host=plan.host, serve=push,
                                   side_port=plan.decode_port, integrity=plan.integrity,
                                   handshake_timeout=plan.handshake_timeout))
    spec = data.spec_of(geo, layers, tp, rank)
    _register(worker, spec, plan, say)
    remote = RemoteEngine("prefill", plan.advertise_host or plan.host, plan.port, plan.prefill_tp)
    say(f"handshake with the prefill at {remote.host}:{remote.port}"
        + (f"..{remote.port + plan.prefill_tp - 1}" if plan.prefill_tp > 1 else "")
        + (", then its pushes" if push else ", then READs"))
    landed = _Landed(results, rank, report_progress)
    out: dict[str, Any] = {"rank": rank, "requests": 0, "bytes": 0, "raw_descriptors": 0,
                           "descriptors": 0, "mismatches": 0, "failed": {}}
    nxt, busy = 0, 0.0
    deadline = time.monotonic() + plan.timeout * max(1, plan.requests)
    try:
        # Waves of up to `slots` requests: transfer a wave (timed), then verify it (not timed),
        # so verification never competes with the transfer it would be credited to.
        while nxt < plan.requests and time.monotonic() < deadline:
            wave = {f"req-{i}": i for i in range(nxt, min(plan.requests, nxt + slots))}
            nxt += len(wave)
            t0 = time.perf_counter()
            for req_id, i in wave.items():
                if push:
                    worker.expect_push(req_id, remote, plan.decode_blocks(i), plan.timeout)
                else:
                    worker.read(req_id, remote, plan.decode_blocks(i), plan.prefill_blocks(i),
                                generation=(plan.generation(i) if plan.told_generations
                                            else None))
            before = worker.finished_bytes
            done_ids: list[str] = []
            waiting = set(wave)
            while waiting and time.monotonic() < deadline:
                done, failed = worker.poll()
                for req_id, reason in failed.items():
                    out["failed"][req_id] = reason
                done_ids += sorted(done)
                if push:
                    out["bytes"] += len(done) * plan.blocks_per_request * spec.block_bytes
                waiting -= done | set(failed)
                if done:  # the bar advances as requests land (verification comes after)
                    landed(len(done), out["bytes"] + worker.finished_bytes - before,
                           busy + time.perf_counter() - t0)
                if waiting and not done and not failed:
                    time.sleep(0.0002)
            busy += time.perf_counter() - t0
            out["bytes"] += worker.finished_bytes - before
            landed(0, out["bytes"], busy, force=True)
            for req_id in waiting:
                out["failed"][req_id] = f"not finished within {plan.timeout:.0f}s per request"
            if done_ids:
                say(f"verifying every byte of {len(done_ids)} request(s) on "
                    f"{plan.device_of('decode')}")
            for req_id in done_ids:
                i = wave[req_id]
                out["mismatches"] += data.verify(geo, layers, tp, rank, plan.decode_blocks(i),
                                                 plan.prefill_blocks(i))
                out["requests"] += 1
            if waiting:
                break
            if not done_ids:  # the whole wave failed: the peer is gone; give up on it once
                for i in range(nxt, plan.requests):
                    out["failed"][f"req-{i}"] = ("not tried: gave up on the prefill after "
                                                 "every request of a wave failed")
                break
        out["raw_descriptors"], out["descriptors"] = worker.descriptor_counts()
        out["integrity_checked_blocks"] = worker.integrity.checked_blocks
        out["transports_used"] = used_transports(worker)
    finally:
        worker.close()
    out["seconds"] = busy
    results.put(out)
