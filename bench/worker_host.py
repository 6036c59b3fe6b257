"""The worker's own host time for a READ on a route, cold and hot, on CPU: what it adds to a
transport's, with the transport taken out.

    .venv/bin/python bench/worker_host.py [--requests 200] [--out bench/results/worker_host.json]

Why: a cuda_ipc READ through the public API is ~50 Python steps and four driver calls around
a 0.09 ms copy (docs/history/e2e.md, "Launch first"), and only the GPU machine can time it there —
thirty minutes a session. The worker's share of those steps is plain Python, and it runs the
same here. So this bench measures it on CPU, through the public API (a producer holding, a
consumer's ``read(..., generation)`` and the ``poll()`` that reports it). Two workers in one
process, with a real side channel and a real hold board; the READ is validated on the board.

The transport is a stand-in: tcp's handshake with a lane whose posts move nothing and are
DONE at once. It is not a fault injection; it takes the transport's own time out, so what is
left is the worker's. Its figures explain the GPU's; they are not a user's. Per phase:
- ``read()`` up to the lane's post (the route's checks, the ids);
- the rest of ``read()`` (the records, the fingerprint, the after-check's binding);
- the ``poll()`` that reports the request.

Each phase is timed cold (right after a sweep of the caches, as a request meets it after the
serving process's other work, like ``bench/host_steps.py``) and hot (back to back, the
same-run baseline). The Python calls each phase makes are counted too (``sys.setprofile``,
one request, right after a whole poll so its reporting poll returns at once): a figure that
does not depend on the machine's state. Writes bench/results/worker_host.json
(command, machine, date).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import sweep, write_result

from kvlink.demo import data
from kvlink.transport import (
    DONE,
    PENDING,
    Capabilities,
    Op,
    make_extents,
    register_transport,
)
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig
from kvlink_transports.tcp import TcpTransport
from kvlink_transports.tcp.client import _Xfer

#: a 70B TP8-rank request's shape: 80 layers, one KV head, 256 blocks (pages kept tiny: no
#: byte moves, and the worker's host work does not depend on a page's size)
GEO = data.Geometry(layers=80, kv_heads=1, head_dim=8, block_size=4)
BLOCKS, CACHE = 256, 600
class _NullLane:
    """A lane whose posts move nothing and are DONE at once (see the module docstring)."""

    def __init__(self, owner: NullLaneTcp) -> None:
        self.owner = owner
        self.at: float = 0.0  # perf_counter of the last post: where read() reached the lane
        self._empty = make_extents(np.zeros(0, np.uint64), 0)

    def post(self, local_ids: Any, remote_ids: Any, generation: int = 0,
             sample: bool = False) -> int | None:
        self.at = time.perf_counter()
        handle = next(self.owner._handles)  # (a few steps of its own: a handle, DONE)
        self.owner._xfers[handle] = _Xfer(Op.READ, self._empty, self._empty, None, 0,
                                          self.at, state=DONE)
        return handle


class NullLaneTcp(TcpTransport):
    """tcp's handshake and bookkeeping, with a lane that moves nothing; as cuda_ipc: no
    Python threads move its transfers, no ticket checks, no native notifications, and an
    ``end_probe`` (kvlink.transport, rule 7). A handle in ``held`` reads as moving (to time
    the poll that reports a READ whose records an earlier poll made, as on a GPU)."""

    held: set[int]

    def poll(self, handle: int) -> Any:
        return PENDING if handle in self.held else super().poll(handle)

    def end_probe(self, handle: int) -> Any:
        def probe() -> int | None:
            return None if handle in self.held else 0
        return probe

    name = "null_lane"
    capabilities = Capabilities(ops=frozenset({Op.READ}), memory_kinds=frozenset({"cpu"}),
                                native_notifications=False)
    coalesce_runs = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.null = _NullLane(self)
        self.held = set()

    def lane(self, op: Op, peer: str, local_base: Any, remote_base: Any, unit: int,
             blocks: tuple[int, int], digests: Any = None) -> _NullLane | None:
        if digests is not None:  # (no digest lane: integrity is off here)
            return None
        return self.null


register_transport("null_lane", NullLaneTcp)


def _worker(engine: str) -> tuple[KVWorker, Any]:
    buf, layers = data.allocate(GEO, CACHE, 1, 0)
    w = KVWorker(WorkerConfig(engine_id=engine, transports=["null_lane"], grants=False))
    w.register(data.spec_of(GEO, layers, 1, 0))
    return w, (buf, layers)


class _Calls:
    """Python calls made while enabled (sys.setprofile), C calls included."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.n += 1


def _held(prefill: KVWorker, rid: str, rng: np.random.Generator
          ) -> tuple[list[int], npt.NDArray[np.int64], int, Callable[[], bool]]:
    """A request of the 70B shape held by the producer: (its ids, ours for it, the hold's
    generation, whether its board slot was taken by then — its READ is then validated by
    asking, not on the board, and not what the bench times)."""
    theirs = list(range(BLOCKS))
    ours = rng.permutation(CACHE)[:BLOCKS].astype(np.int64)
    board = prefill.board
    assert board is not None
    collisions = board.collisions
    gen = prefill.hold(rid, theirs)
    return theirs, ours, gen, lambda: board.collisions != collisions


def one(prefill: KVWorker, decode: KVWorker, remote: RemoteEngine, rid: str,
        rng: np.random.Generator, cold: bool, calls: _Calls | None = None
        ) -> dict[str, float] | None:
    """One READ on the route: (phase -> seconds), or with ``calls`` (phase -> calls); None
    where its hold's board slot was taken (then it is not on the route's path: not timed)."""
    theirs, ours, gen, slot_taken = _held(prefill, rid, rng)
    if slot_taken():  # its generation's slot was taken (about one hold in
        # a few thousand here): this READ is validated by asking, not on the board. Not
        # timed: finished off the record
        decode.read(rid, remote, ours, theirs, generation=gen)
        deadline = time.monotonic() + 10
        while rid not in decode.poll()[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rid} (validated by asking) did not finish")
            prefill.poll()
            time.sleep(0.0005)
        prefill.poll()
        return None
    lane = decode.transports["null_lane"].null  # type: ignore[attr-defined]
    if cold:
        sweep()
    if calls is not None:  # counted after a whole poll: the reporting one then returns at once
        decode.poll()  # (else it runs whole or not by the clock: calls that vary run to run)
        sys.setprofile(calls)
    t0 = time.perf_counter()
    decode.read(rid, remote, ours, theirs, generation=gen)
    t1 = time.perf_counter()
    n_read = calls.n if calls is not None else 0
    done, failed = decode.poll()
    t2 = time.perf_counter()
    if calls is not None:
        sys.setprofile(None)
    if rid not in done:
        req = decode._requests.get(rid)
        parts = [] if req is None else [
            {"after_check_shown": p.check() if p.check is not None else None,
             "verdict_asked": p.verdict is not None, "handle": p.handle, "error": p.error}
            for p in req.parts]
        raise RuntimeError(f"{rid} not reported by its first poll: {done} {failed}; its parts "
                           f"now: {parts}; reports owed: {decode.reports_owed}")
    prefill.poll()  # the producer takes the read report, releases
    if calls is not None:
        return {"read": n_read, "poll": calls.n - n_read}
    return {"read_to_lane": lane.at - t0, "read_after_lane": t1 - lane.at, "poll": t2 - t1,
            "total": t2 - t0}


def after_records(prefill: KVWorker, decode: KVWorker, remote: RemoteEngine, rid: str,
                  rng: np.random.Generator, cold: bool) -> float | None:
    """The poll that reports a READ on the route whose records an earlier poll made, as on a
    GPU (the first poll finds its copy moving: here the lane's end is held for it): seconds,
    or None where its hold's board slot was taken. Its end is read through the lane's
    ``end_probe`` where the worker takes one."""
    theirs, ours, gen, slot_taken = _held(prefill, rid, rng)
    t: NullLaneTcp = decode.transports["null_lane"]  # type: ignore[assignment]
    decode.read(rid, remote, ours, theirs, generation=gen)
    handle = decode._requests[rid].parts[0].handle
    assert handle is not None
    t.held.add(handle)
    first = decode.poll()
    t.held.clear()
    if rid in first[0] or rid in first[1]:
        raise RuntimeError(f"{rid} ended while held: {first}")
    if cold:
        sweep()
    t0 = time.perf_counter()
    done, failed = decode.poll()
    seconds = time.perf_counter() - t0
    deadline = time.monotonic() + 10
    while rid not in done:  # (validated by asking where its slot was taken: not timed)
        if rid in failed or time.monotonic() > deadline:
            raise RuntimeError(f"{rid} did not finish: {failed.get(rid)}")
        prefill.poll()
        time.sleep(0.0005)
        done, failed = decode.poll()
    decode.poll()
    prefill.poll()
    return None if slot_taken() else seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prefill, keep_p = _worker("p")
    decode, keep_d = _worker("d")
    remote = RemoteEngine("p", "127.0.0.1", prefill.side_port)
    rng = np.random.default_rng(1)
    try:
        for i in range(3):  # the handshake, then the READ that binds the route
            gen = prefill.hold(f"warm{i}", list(range(BLOCKS)))
            decode.read(f"warm{i}", remote, rng.permutation(CACHE)[:BLOCKS], list(range(BLOCKS)),
                        generation=gen)
            deadline = time.monotonic() + 10
            while f"warm{i}" not in decode.poll()[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the warm-up READ did not finish")
                time.sleep(0.001)
            prefill.poll()
        assert decode._routes, "no route was bound: the bench would time the general path"
        counted = _Calls()
        calls = None
        tries = 0
        while calls is None:  # (again where the hold's board slot was taken)
            counted.n, tries = 0, tries + 1
            calls = one(prefill, decode, remote, f"counted{tries}", rng, False, counted)
        series: dict[str, dict[str, list[float]]] = {"cold": {}, "hot": {}}
        for i in range(args.requests):  # cold and hot interleaved: they share the noise
            for mode in ("cold", "hot"):
                got = one(prefill, decode, remote, f"{mode}{i}", rng, mode == "cold")
                for k, v in (got or {}).items():
                    series[mode].setdefault(k, []).append(v)
                late = after_records(prefill, decode, remote, f"{mode}late{i}", rng,
                                     mode == "cold")
                if late is not None:
                    series[mode].setdefault("poll_after_records", []).append(late)
    finally:
        decode.close()
        prefill.close()
    del keep_p, keep_d
    med = {mode: {k: round(statistics.median(v) * 1e6, 1) for k, v in s.items()}
           for mode, s in series.items()}
    for mode in ("cold", "hot"):
        m = med[mode]
        print(f"  {mode}: read() to the lane {m['read_to_lane']:6.1f} us, rest of read() "
              f"{m['read_after_lane']:6.1f} us, reporting poll {m['poll']:6.1f} us, "
              f"total {m['total']:6.1f} us; reporting poll after an earlier one made the "
              f"records {m['poll_after_records']:6.1f} us")
    print(f"  Python calls (C calls included): read() {calls['read']}, reporting poll "
          f"{calls['poll']}")
    write_result("worker_host", {
        "what": "the worker's own host time for a READ on a route (a lane that moves nothing), "
                "median us per phase, cold (after a 32 MiB + Python sweep) and hot; "
                "poll_after_records: the poll that reports a READ whose records an earlier "
                "poll made (its lane's end held for that one), as on a GPU",
        "request": "80 layers, 1 KV head, 256 blocks (70B TP8 rank's shape)",
        "requests": args.requests, "median_us": med, "python_calls": calls,
    }, args.out)


if __name__ == "__main__":
    main()
