"""A randomized lifecycle schedule over real processes: block ownership under stalls, expiries,
cancels, kills and restarts.

One producer process at a time (engine ``chaos-p`` on a fixed port; killed and restarted under
the same engine id, i.e. a new incarnation) holds requests under short leases and, the moment
the core releases one, overwrites its blocks with other bytes (the blocks are reused). The
consumer (the calling process) takes every request it is told about over the schedule's
transport (tcp by default; nixl and mooncake too: a peer killed under their engines'
connections and restarted at the same address; cuda_ipc with both caches on one GPU: a peer
killed with the consumer's mappings of its cache open, its copies maybe in flight), pulling
some and having the others pushed; it stalls its step loop at random (sometimes past the
lease), and the producer's step reaches a push request up to 1.5x the decode's push timeout
late, so pushes are cancelled, refused and killed mid-flight. A schedule passes when:

- every finished receive holds that request's own bytes, and none was asked after its
  producer was killed (nobody is left to confirm it);
- every receive resolves before its deadline;
- no byte lands in a failed push's blocks after the decode was told it failed (they are
  stamped at that moment and checked once every producer is gone);
- the producer that ran to the end released each hold exactly once, with no block left held.

``bench/lifecycle_soak.py`` runs many schedules; the test suite runs a few. (A mutation that
posts cancelled pushes anyway is caught: "a WRITE of ... landed after its push failed".)
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import random
import signal
import time
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.demo import data
from kvlink.demo.proc import StopFlag
from kvlink.errors import KVLinkError, SideChannelError
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=2, kv_heads=2, head_dim=16, block_size=4)
PRODUCER_BLOCKS = 24
CONSUMER_BLOCKS = 256
_mp = mp.get_context("spawn")


def _stamp(layers: list[Any], ids: list[int], tag: str) -> None:
    """Fill block ``ids[k]`` of every layer with bytes only ``(tag, k)`` produces. A cache on
    a GPU (torch) is written on the current stream and waited for: what a hold or a failed
    push's quarantine then holds is on the device, as a prefill's KV is once its forward's
    step has ended."""
    for li, lv in enumerate(layers):
        for k, b in enumerate(ids):
            h = zlib.crc32(f"{tag}/{k}/{li}".encode())
            shape = tuple(lv[:, b].shape)
            words = ((np.arange(int(np.prod(shape)), dtype=np.uint32) * 7 + h) % 65521
                     ).astype(np.uint16).reshape(shape)
            if data.is_torch(lv):
                import torch

                lv[:, b] = torch.from_numpy(words.view(np.int16)).to(lv.device)
            else:
                np.asarray(lv)[:, b] = words
    if layers and data.is_torch(layers[0]) and layers[0].is_cuda:
        import torch

        torch.cuda.synchronize(layers[0].device)


def _host(block: Any) -> npt.NDArray[np.uint16]:
    """A block's words on the host (a torch cache's copied there), as 16-bit words."""
    if data.is_torch(block):
        return block.cpu().numpy().view(np.uint16)  # type: ignore[no-any-return]
    return np.asarray(block)


def _matches(layers: list[Any], ids: list[int], tag: str) -> bool:
    _want_buf, want = data.allocate(GEO, len(ids), 1, 0)
    _stamp(want, list(range(len(ids))), tag)
    return all(np.array_equal(_host(lv[:, ids]), np.asarray(w))
               for lv, w in zip(layers, want))


@dataclasses.dataclass(frozen=True)
class Schedule:
    seed: int
    requests: int = 24  # holds over all producer incarnations
    lease: float = 0.5  # producer lease (seconds)
    kills: int = 1  # producer kills (each followed by a restart under the same engine id)
    deadline: float = 10.0  # every read must resolve within this
    push_share: float = 0.5  # requests the consumer has pushed (the rest it pulls)
    push_timeout: float = 0.3  # decode side; the producer's step reaches a push 0-1.5x this late
    transport: str = "tcp"  # both sides' one transport (tcp, nixl, mooncake, cuda_ipc)
    integrity: str = "off"  # both sides' integrity level (kvlink.integrity)

    @property
    def device(self) -> str:
        """Where both caches live: cuda_ipc's on one GPU (its peers share a host and a
        device here), every other transport's in host memory."""
        return "cuda:0" if self.transport == "cuda_ipc" else "cpu"


def _produce(port: int, seed: int, tag: str, sched: Schedule, budget: int, events: Any,
             stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rng = random.Random(seed)
    lease, push_delay = sched.lease, 1.5 * sched.push_timeout
    _buf, layers = data.allocate(GEO, PRODUCER_BLOCKS, 1, 0, sched.device)
    for attempt in range(50):  # as a supervisor would: the port may be briefly taken
        w = KVWorker(WorkerConfig(engine_id="chaos-p", side_port=port, lease_seconds=lease,
                                  read_seconds=lease / 2, handshake_timeout=1.0,
                                  serve_pushes=True, transports=[sched.transport],
                                  integrity=sched.integrity))
        try:
            w.register(data.spec_of(GEO, layers, 1, 0))
            break
        except SideChannelError:
            w.close()
            if attempt == 49:
                raise
            time.sleep(0.1)
    free = list(range(PRODUCER_BLOCKS))
    holds: dict[str, list[int]] = {}
    pushes: list[tuple[float, wire.PushRequest]] = []
    issued, doubles = 0, 0
    events.put(("ready", tag))
    try:
        # serve until the consumer is done (or we are killed), then until every hold has
        # ended: read, cancelled, or expired (a lease and a late push step at most)
        end = float("inf")
        while time.monotonic() < end and (end == float("inf") or holds):
            if end == float("inf") and stop.is_set():
                end = time.monotonic() + lease + push_delay + 1.0
            for rel in w.released():
                ids = holds.pop(rel.req_id, None)
                if ids is None:
                    doubles += 1
                    continue
                _stamp(layers, ids, f"reused-{rng.random()}")  # another request's bytes now
                free.extend(ids)
                events.put(("released", rel.req_id, rel.why))
            if issued < budget and len(free) >= 4 and rng.random() < 0.3 and not stop.is_set():
                rng.shuffle(free)
                n = rng.randint(1, 4)
                ids, free = free[:n], free[n:]
                req = f"{tag}-{issued}"
                issued += 1
                _stamp(layers, ids, req)
                holds[req] = ids
                events.put(("held", req, ids, w.hold(req, ids)))
            _serve_pushes(w, rng, holds, pushes, push_delay)
            time.sleep(rng.random() * 0.004)
        s = w.leases.stats
        events.put(("done", tag, {"doubles": doubles, "held": s.held, "held_blocks":
                                  s.held_blocks, "free": len(free), "issued": issued,
                                  "not_intact": s.reads_not_intact}))
    finally:
        w.close()


def _serve_pushes(w: KVWorker, rng: random.Random, holds: dict[str, list[int]],
                  pushes: list[tuple[float, wire.PushRequest]], delay: float) -> None:
    """The prefill's step reaches each push request 0-``delay`` s late (sometimes after the
    decode gave up on it), writes it from the held blocks, and advances its WRITEs."""
    now = time.monotonic()
    pushes += [(now + rng.random() * delay, m) for m in w.push_requests()]
    for item in [p for p in pushes if p[0] <= now]:
        pushes.remove(item)
        msg = item[1]
        try:
            ids = holds.get(msg.req_id)
            if ids is None:
                raise KVLinkError(f"{msg.req_id} is not held")
            w.push(msg, ids, lease=msg.req_id)
        except KVLinkError as exc:
            w.refuse_push(msg, str(exc))
    w.poll()


@dataclasses.dataclass
class _Read:
    req: str
    local: list[int]
    t0: float
    push: bool = False
    orphan: bool = False  # asked after its producer was killed: it must fail


def run_schedules(seeds: range, **kw: Any) -> dict[str, Any]:
    """Run one schedule per seed; totals, plus every violation found (must be empty)."""
    from kvlink.demo.run import free_port_range

    total: dict[str, Any] = {"schedules": 0, "finished": 0, "verified": 0, "failed": 0,
                             "kills": 0, "pushed": 0, "after_kill": 0, "reasons": {},
                             "violations": []}
    for seed in seeds:
        c = run_schedule(Schedule(seed=seed, **kw), free_port_range(1))
        total["schedules"] += 1
        for k in ("finished", "verified", "failed", "kills", "pushed", "after_kill"):
            total[k] += c[k]
        for k, n in c["reasons"].items():
            total["reasons"][k] = total["reasons"].get(k, 0) + n
        total["violations"] += c["violations"]
    return total


def run_schedule(sched: Schedule, port: int) -> dict[str, Any]:
    """Run one schedule; returns its counts (``violations`` must be empty)."""
    rng = random.Random(sched.seed)
    stop: Any = None
    _consumer_buf, clayers = data.allocate(GEO, CONSUMER_BLOCKS, 1, 0, sched.device)
    w = KVWorker(WorkerConfig(engine_id="chaos-d", handshake_timeout=1.0, intent_timeout=1.0,
                              transports=[sched.transport], integrity=sched.integrity))
    w.register(data.spec_of(GEO, clayers, 1, 0))
    remote = RemoteEngine("chaos-p", "127.0.0.1", port)
    counts: dict[str, Any] = {"finished": 0, "failed": 0, "verified": 0, "kills": 0,
                              "pushed": 0, "after_kill": 0, "violations": [], "producers": [],
                              "reasons": {}, "quarantine": []}
    incarnations = sched.kills + 1
    budgets = [sched.requests // incarnations] * incarnations
    budgets[-1] += sched.requests - sum(budgets)
    kill_after = [rng.randint(1, max(1, b - 1)) for b in budgets[:-1]]
    free = list(range(CONSUMER_BLOCKS))
    pending: list[tuple[float, str, list[int], int]] = []  # (start at, req, remote ids, gen)
    reading: dict[str, _Read] = {}
    proc = None
    try:
        for inc, budget in enumerate(budgets):
            tag = f"s{sched.seed}i{inc}"
            # a queue per producer: one killed inside a put holds the queue's lock for ever
            events: Any = _mp.Queue()
            stop = StopFlag(_mp)
            proc = _mp.Process(target=_produce, args=(
                port, sched.seed * 100 + inc, tag, sched, budget, events, stop))
            proc.start()
            held_here, last = 0, inc == len(budgets) - 1
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    ev = events.get(timeout=0.001)
                except queue.Empty:
                    ev = None
                if ev is not None and ev[0] == "held":
                    held_here += 1
                    pending.append((time.monotonic() + rng.random() * 0.6 * sched.lease,
                                    ev[1], ev[2], ev[3]))
                now = time.monotonic()
                for item in [p for p in pending if p[0] <= now]:
                    if len(free) < len(item[2]):
                        break
                    pending.remove(item)
                    local = [free.pop(rng.randrange(len(free))) for _ in item[2]]
                    push = rng.random() < sched.push_share
                    # held by an incarnation killed since: asked of a dead producer, which
                    # nobody can confirm (a pull told its generation may still launch, over
                    # cuda_ipc on the mapping of the dead producer's cache the consumer holds)
                    orphan = not item[1].startswith(tag + "-")
                    counts["after_kill"] += orphan
                    reading[item[1]] = _Read(item[1], local, now, push, orphan)
                    if push:
                        w.expect_push(item[1], remote, local, timeout=sched.push_timeout)
                    else:
                        # most READs are told the generation (posted at once, validated
                        # after), some ask for it first (read intent): both under the kills
                        w.read(item[1], remote, local, item[2],
                               generation=item[3] if rng.random() < 0.7 else None)
                if rng.random() < 0.01:  # the decode's step stalls, sometimes past the lease
                    time.sleep(rng.random() * 1.5 * sched.lease)
                _settle(w, clayers, reading, free, counts, sched.deadline)
                if not last and held_here >= kill_after[inc]:
                    proc.kill()  # mid-flight: holds, grants and READs of this incarnation die
                    proc.join(10)
                    counts["kills"] += 1
                    break
                if last and held_here >= budget and not pending and not reading:
                    stop.set()  # the producer reports its books and exits
                    _wait_done(events, counts, 10)
                    break
            else:
                counts["violations"].append(
                    f"schedule {sched.seed} incarnation {inc} did not finish within 60 s "
                    f"({held_here}/{budget} held, {len(pending)} pending, {len(reading)} "
                    f"reading, producer {'alive' if proc.is_alive() else proc.exitcode})")
        for _ in range(int(sched.deadline * 1000)):
            if not reading:
                break
            _settle(w, clayers, reading, free, counts, sched.deadline)
            time.sleep(0.001)
        if reading:
            counts["violations"].append(f"reads never resolved: {sorted(reading)}")
    finally:
        if stop is not None:
            stop.set()
        if proc is not None:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        w.close()
    # every producer is gone: a failed push's blocks must still hold what the decode wrote
    # into them when it was told the push failed (no WRITE landed after the failure)
    for req, ids in counts.pop("quarantine"):
        if not _matches(clayers, ids, f"given-back-{req}"):
            counts["violations"].append(f"a WRITE of {req} landed after its push failed")
    return counts


def _wait_done(events: Any, counts: dict[str, Any], timeout: float) -> None:
    """The last producer's books: every hold released once, no block left held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            ev = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if ev[0] == "done":
            counts["producers"].append(ev[2])
            if ev[2]["doubles"] or ev[2]["held"] or ev[2]["free"] != PRODUCER_BLOCKS:
                counts["violations"].append(f"producer {ev[1]}: {ev[2]}")
            return
    counts["violations"].append("the last producer never reported its books")


def _settle(w: KVWorker, layers: list[Any], reading: dict[str, _Read], free: list[int],
            counts: dict[str, Any], deadline: float) -> None:
    done, failed = w.poll()
    for req in done:
        r = reading.pop(req)
        counts["finished"] += 1
        counts["pushed"] += r.push
        if _matches(layers, r.local, req):
            counts["verified"] += 1
        else:
            counts["violations"].append(f"{req} finished with bytes that are not its own")
        if r.orphan:
            counts["violations"].append(f"{req} finished, asked after its producer was killed")
        free.extend(r.local)
    for req, why in failed.items():
        r = reading.pop(req)
        counts["failed"] += 1
        kind = ("push: not written" if r.push else "not intact" if "not confirmed" in why
                else "refused" if "refused" in why else "deadline" if "deadline passed" in why
                else "unreachable/other")
        counts["reasons"][kind] = counts["reasons"].get(kind, 0) + 1
        if r.push:  # the decode reuses these blocks now: any later WRITE would show
            _stamp(layers, r.local, f"given-back-{req}")
            counts["quarantine"].append((req, r.local))
        else:
            free.extend(r.local)
    now = time.monotonic()
    for r in reading.values():
        if now - r.t0 > deadline:
            counts["violations"].append(f"{r.req} unresolved after {deadline:.0f}s")
            r.t0 = float("inf")
