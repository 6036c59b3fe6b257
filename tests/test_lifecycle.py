"""Block ownership end to end (issue 18): a block is reused only when no peer can still touch it.

Every test runs real KVWorkers over the real tcp transport and the real ZMQ side channel on
127.0.0.1, and is numbered after the item of issue 18 it reproduces; each failed on the code
before the lifecycle rework. Faults are injected by what a real deployment does: a step loop
that does not run (a stalled prefill or decode), a process that closes or restarts, a lease
that runs out. The one fake (item 8) is a transport whose post raises, which no real transport
does on demand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvlink.demo import data
from kvlink.errors import ConfigError, TransferCancelled, TransferError
from kvlink.transport import register_transport
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig
from kvlink_transports.tcp import TcpTransport

GEO = data.Geometry(layers=2, kv_heads=2, head_dim=8, block_size=4)
NBLOCKS = 16


def make(engine: str, seed: int = 0, **cfg: Any) -> tuple[KVWorker, np.ndarray]:
    """A worker over a cache filled with ``seed``'s random bytes; returns (worker, raw buffer)."""
    buf, layers = data.allocate(GEO, NBLOCKS, 1, 0)
    buf[:] = np.random.default_rng(seed).integers(1, 2**16, buf.shape, dtype=np.uint16)
    cfg.setdefault("serve_pushes", True)  # these workers play either side of a push
    w = KVWorker(WorkerConfig(engine_id=engine, **cfg))
    w.register(data.spec_of(GEO, layers, 1, 0))
    w._keep = (buf, layers)  # type: ignore[attr-defined]
    return w, buf


def blocks(w: KVWorker, ids: list[int]) -> np.ndarray:
    """The bytes of ``ids`` in every plane of ``w``'s cache (layers, K/V, blocks)."""
    _buf, layers = w._keep  # type: ignore[attr-defined]
    return np.stack([np.asarray(lv)[:, ids] for lv in layers])


def remote(w: KVWorker, engine: str | None = None) -> RemoteEngine:
    return RemoteEngine(engine or w.config.engine_id, "127.0.0.1", w.side_port)


def outcome(w: KVWorker, req: str, timeout: float = 20.0,
            step: Callable[[], None] | None = None) -> tuple[bool, str]:
    """Poll ``w`` (and ``step``, another side's loop) until ``req`` finishes or fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step is not None:
            step()
        done, failed = w.poll()
        if req in done:
            return True, ""
        if req in failed:
            return False, failed[req]
        time.sleep(0.001)
    raise AssertionError(f"{req} neither finished nor failed within {timeout}s")


def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.001)


def sleep_until(t: float) -> None:
    """Leases are wall-clock: waiting one out is the behaviour under test, not a sync."""
    while (left := t - time.monotonic()) > 0:
        time.sleep(left)


# ---------------------------------------------------------------------------- push
@pytest.mark.fault("push: decode times out while the prefill's step is stalled (item 1)")
def test_push_cancelled_on_timeout_is_never_written(observed: Callable[[str], None]) -> None:
    """The decode times out at 0.3 s and cancels; the prefill's step reaches the push later
    and must not WRITE it. Before: the decode freed the blocks at its timeout and the late
    WRITE landed in them 0.5 s later."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        before = blocks(decode, [3])
        decode.expect_push("r0", remote(prefill), [3], timeout=0.3)
        ok, reason = outcome(decode, "r0", 10)  # the prefill's step loop does not run
        observed(f"decode: {reason}; quarantined {decode.quarantined()}")
        assert not ok and "did not push within the timeout" in reason
        (msg,) = prefill.push_requests()  # the stalled step resumes
        with pytest.raises(TransferCancelled, match="cancelled by the decode"):
            prefill.push(msg, [5])
        assert prefill.pending() == 0
        assert np.array_equal(blocks(decode, [3]), before)  # not a byte landed
    finally:
        prefill.close()
        decode.close()


def _rank(engine: str, tp: int, rank: int, geo: data.Geometry, seed: int = 0,
          **cfg: Any) -> KVWorker:
    """Rank ``rank`` of a ``tp``-way engine over ``geo`` (its share of the heads)."""
    buf, layers = data.allocate(geo, NBLOCKS, tp, rank)
    buf[:] = np.random.default_rng(seed).integers(1, 2**16, buf.shape, dtype=np.uint16)
    cfg.setdefault("serve_pushes", True)
    w = KVWorker(WorkerConfig(engine_id=engine, tp_size=tp, tp_rank=rank, **cfg))
    w.register(data.spec_of(geo, layers, tp, rank))
    w._keep = (buf, layers)  # type: ignore[attr-defined]
    return w


def test_a_push_releases_the_replicas_it_did_not_ask() -> None:
    """A TP2 prefill of one KV head (each rank holds a replica of it) and a TP1 decode: the
    decode asks rank 0 to push, and rank 1 — holding the same blocks for it — is told at the
    end that its hold is released, under the generation the decode was given
    (``expect_push(..., generation=)``; the vLLM connector passes the params'). Before, that
    release named no generation, rank 1 refused it, and its blocks stayed held until its
    lease ended (120 s by default) — in every hetero-TP push through vLLM."""
    geo = data.Geometry(layers=2, kv_heads=1, head_dim=8, block_size=4)
    p0 = _rank("p", 2, 0, geo, seed=1)
    ranks = [p0]
    try:
        p1 = _rank("p", 2, 1, geo, seed=1, side_port=p0.side_port)
        ranks.append(p1)
        decode = _rank("d", 1, 0, geo)
        ranks.append(decode)
        gen = p0.hold("r0", [5])
        assert p1.hold("r0", [5], generation=gen) == gen
        decode.expect_push("r0", RemoteEngine("p", "127.0.0.1", p0.side_port, 2), [3],
                           timeout=10, generation=gen)
        until(lambda: p0.queued_pushes() == 1, 10, "the push request arrived at rank 0")
        assert p1.queued_pushes() == 0  # (the decode reads its one head from rank 0)
        (msg,) = p0.push_requests()
        key = p0.push(msg, [5], lease="r0")
        pushed: set[str] = set()
        assert outcome(decode, "r0", 10, step=lambda: pushed.update(p0.poll()[0])) == (
            True, "")
        until(lambda: key in pushed or bool(pushed.update(p0.poll()[0])), 10,
              "rank 0's push reported")
        until(lambda: (decode.poll(), not p1.leases.is_held("r0"))[1], 10,
              "rank 1's replica released")
        assert [(r.req_id, r.why) for r in p1.released()] == [("r0", "read")]
        assert p1.refusals["release"] == 0
    finally:
        for w in ranks:
            w.close()


@pytest.mark.fault("push: prefill dead when the decode times out")
def test_push_to_a_dead_prefill_fails_after_fencing(observed: Callable[[str], None]) -> None:
    """A cancel nobody answers: the decode reports failure only after fencing the prefill's
    tcp connections off (no byte can land any more), not at the bare timeout."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        decode.expect_push("r0", remote(prefill), [3, 4], timeout=0.5)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()
        key = prefill.push(msg, [1, 2])
        hs = prefill._requests[key].parts[0].peer
        until(hs.done, 10, "the prefill handshook back to the decode")
        prefill.close()  # dead before posting or answering anything else
        t0 = time.monotonic()
        ok, reason = outcome(decode, "r0", 15)
        observed(f"failed {time.monotonic() - t0:.2f}s after the timeout: {reason}")
        assert not ok and decode.quarantined() == 0
    finally:
        prefill.close()
        decode.close()


@pytest.mark.fault("push: the prefill is gone before the decode asks")
def test_a_push_asked_of_a_prefill_that_is_gone_fails_at_once(
        observed: Callable[[str], None]) -> None:
    """A prefill that answered this decode before and now refuses connections (its process is
    gone; a restart there never held the request) cannot push: the ask fails at once, not at
    the handshake timeout (10 s) — a vLLM decode's push from a SIGKILLed prefill took 12 s to
    be recomputed (tests/test_vllm_e2e.py)."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        decode.expect_push("r0", remote(prefill), [3], timeout=10)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()
        prefill.push(msg, [1])
        assert outcome(decode, "r0", 10, step=lambda: prefill.poll()) == (True, "")
        where = remote(prefill)
        prefill.close()  # nothing listens at its side channel port any more
        t0 = time.monotonic()
        decode.expect_push("r1", where, [4], timeout=30)
        ok, reason = outcome(decode, "r1", 20)
        took = time.monotonic() - t0
        observed(f"failed in {took:.2f}s: {reason}")
        assert not ok and "nobody listens" in reason, reason
        assert took < 2.0, f"{took:.1f}s to give up on a prefill that is gone"
        assert decode.quarantined() == 0
    finally:
        prefill.close()
        decode.close()


@pytest.mark.fault("pull: the prefill is gone before the decode's first handshake with it")
def test_a_read_of_a_prefill_that_is_gone_fails_at_once(observed: Callable[[str], None]) -> None:
    """A READ told ``live=True`` (the prefill handed us the request: vLLM's params come from
    its answer) whose prefill then died, from a decode that never talked to it: nobody
    listens at its side channel, so the handshake fails at once — not at
    ``handshake_timeout`` (10 s, the cold READ's wait before)."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        gen = prefill.hold("r1", [1, 2])
        where = remote(prefill)
        prefill.close()
        t0 = time.monotonic()
        decode.read("r1", where, [3, 4], [1, 2], generation=gen, live=True)
        ok, reason = outcome(decode, "r1", 20)
        took = time.monotonic() - t0
        observed(f"failed in {took:.2f}s: {reason}")
        assert not ok and "nobody listens" in reason, reason
        assert took < 2.0, f"{took:.1f}s to give up on a prefill that is gone"
    finally:
        prefill.close()
        decode.close()


def test_request_ids_with_at_signs_complete() -> None:
    """Item 10: request ids are client-controlled; ``@`` in one must not truncate it."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    req = "cmpl-user@example.com-0"
    try:
        decode.expect_push(req, remote(prefill), [3], timeout=10)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()
        key = prefill.push(msg, [5])
        ok, reason = outcome(prefill, key, 10)
        assert ok, reason
        ok, reason = outcome(decode, req, 10)
        assert ok, reason
        assert np.array_equal(blocks(decode, [3]), blocks(prefill, [5]))
    finally:
        prefill.close()
        decode.close()


# ---------------------------------------------------------------------------- pull
@pytest.mark.fault("pull: the lease expires under a READ while the decode's step stalls (item 2)")
def test_read_whose_lease_ended_under_it_is_not_finished(
        observed: Callable[[str], None]) -> None:
    """The READ is posted, the decode's step stalls past the lease, the prefill frees and
    reuses the blocks, then the decode sees DONE: its "done" is answered "not intact" and the
    request fails. Before: DONE was reported finished with whatever the blocks held."""
    prefill, _ = make("p", seed=1, lease_seconds=0.5, read_seconds=0.1)
    decode, _ = make("d", serve=False)
    try:
        prefill.hold("r0", [2, 3])
        decode.read("r0", remote(prefill), [7, 8], [2, 3])
        req = decode._requests["r0"]
        until(lambda: (decode.poll() and False) or req.parts[0].handle is not None, 10,
              "the READ was posted")
        sleep_until(time.monotonic() + 0.6)  # the decode's step stalls past the lease
        assert [r.why for r in prefill.released()] == ["expired"]
        ok, reason = outcome(decode, "r0", 10)
        observed(f"READ done after expiry: {reason}; prefill stats {prefill.leases.stats}")
        assert not ok and "not confirmed" in reason and "expired" in reason
        assert prefill.leases.stats.reads_not_intact == 1
    finally:
        prefill.close()
        decode.close()


def test_read_is_not_posted_past_the_grant_deadline() -> None:
    """A decode that reaches its post after the lease deadline it was given does not READ,
    and releases the prefill at once (item 2, and 11: a failed pull releases)."""
    prefill, _ = make("p", seed=1, lease_seconds=0.3, read_seconds=0.1)
    decode, _ = make("d", serve=False)
    try:
        prefill.hold("r0", [2])
        decode.read("r0", remote(prefill), [7], [2])
        part = decode._requests["r0"].parts[0]
        until(lambda: decode.poll() is None or part.intent is not None, 10, "the intent went out")
        # the grant (0.1 s at least) arrives while the decode does not poll: its clock started
        # when the intent went out, so the post that comes after it must not happen
        sleep_until(time.monotonic() + 0.4)
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "deadline passed" in reason
        assert decode.transports["tcp"].stats.transfers == 0  # never posted
    finally:
        prefill.close()
        decode.close()


@pytest.mark.fault("pull: the decode's request waits in its queue past the prefill's lease")
def test_a_waiting_reader_renews_the_lease_and_reads_after_it(
        observed: Callable[[str], None]) -> None:
    """A decode whose request waits to be scheduled renews the prefill's lease of it
    (``KVWorker.renew``): held past ``lease_seconds`` and read intact after, while a request
    nobody renews expires. Before: no renewal, and a decode queueing past the lease had its
    READ refused ("no longer held: expired") and recomputed."""
    prefill, _ = make("p", seed=1, lease_seconds=1.0, read_seconds=0.1)
    decode, _ = make("d", serve=False)
    try:
        prefill.hold("r0", [2, 3])
        prefill.hold("r1", [4])
        end, sent = time.monotonic() + 2.2, 0
        while time.monotonic() < end:  # r0 waits in the decode's queue, renewed; r1 not
            decode.renew(["r0"], remote(prefill))
            decode.poll()  # (sends the frame)
            sent += 1
            sleep_until(time.monotonic() + 0.25)
        until(lambda: prefill.leases.stats.renewed >= sent, 10, "the renewals arrived")
        assert [(r.req_id, r.why) for r in prefill.released()] == [("r1", "expired")]
        decode.read("r0", remote(prefill), [7, 8], [2, 3])
        ok, reason = outcome(decode, "r0", 10)
        observed(f"{sent} renewals over 2.2 s of a 1.0 s lease: read {ok} {reason}")
        assert ok, reason
        assert np.array_equal(blocks(decode, [7, 8]), blocks(prefill, [2, 3]))
    finally:
        prefill.close()
        decode.close()


def test_failed_pull_releases_the_prefill_at_once() -> None:
    """Item 11: a READ that fails after its grant frees the prefill's blocks now, not after
    the 60 s lease. (The decode's transport is closed under the request: post gives FAILED.)"""
    prefill, _ = make("p", seed=1, lease_seconds=60)
    decode, _ = make("d", serve=False)
    try:
        prefill.hold("r0", [2])
        decode.read("r0", remote(prefill), [7], [2])
        until(decode._requests["r0"].parts[0].peer.done, 10,
              "the grant arrived")
        decode.transports["tcp"].close()
        ok, reason = outcome(decode, "r0", 10)
        assert not ok, reason
        released: list[Any] = []
        until(lambda: bool(released.extend(prefill.released()) or released), 5,
              "the prefill released the failed request")
        assert [(r.req_id, r.why) for r in released] == [("r0", "read")]
        assert prefill.leases.stats.reads_failed == 1
    finally:
        prefill.close()
        decode.close()


def test_read_of_an_unheld_request_fails_closed() -> None:
    """Item 6: a producer holding nothing refuses intents (before: acked when leases unset)."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False, intent_timeout=0.3)
    try:
        decode.read("r0", remote(prefill), [7], [2])
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "not held" in reason
        assert decode.transports["tcp"].stats.transfers == 0
    finally:
        prefill.close()
        decode.close()


def test_read_only_blocks_held_for_that_request() -> None:
    """Item 14: a READ may cover only blocks the producer holds for that request."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    try:
        prefill.hold("r0", [0, 1, 2, 3])
        prefill.hold("r1", [4, 5, 6, 7])
        decode.read("r0", remote(prefill), list(range(8)), list(range(8)))
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "blocks [4, 5, 6, 7] are not among the 4 held for r0" in reason
        assert decode.transports["tcp"].stats.transfers == 0
    finally:
        prefill.close()
        decode.close()


# ---------------------------------------------------------------------------- peers
@pytest.mark.fault("producer restarted under the same engine id and port (item 5)")
@pytest.mark.parametrize("told", [False, True], ids=["intent", "told-generation"])
def test_restart_under_the_same_engine_id_rehandshakes(observed: Callable[[str], None],
                                                       told: bool) -> None:
    """The decode's cached handshake is the old process's. With a read intent, the answer
    "stale" makes it handshake again before the READ; told the generation (no intent), the
    READ runs against the dead process's mapping, its report names the old incarnation, and
    the decode handshakes again and READs again (issue 19): never finished with old bytes."""
    old, _ = make("p", seed=1)
    port = old.side_port
    decode, _ = make("d", serve=False)
    try:
        old.hold("r0", [1])
        ok, reason = outcome(decode, "r0", 10) if decode.read(
            "r0", RemoteEngine("p", "127.0.0.1", port), [1], [1]) is None else (False, "")
        assert ok, reason
        old.close()
        new, _ = make("p", seed=2, side_port=port)
        try:
            gen = new.hold("r1", [2])
            decode.read("r1", RemoteEngine("p", "127.0.0.1", port), [2], [2],
                        generation=gen if told else None)
            ok, reason = outcome(decode, "r1", 20)
            observed(f"{'told the generation' if told else 'read intent'}: read after the "
                     f"restart: {'ok' if ok else reason}; peers "
                     f"{decode.connected_peers()}")
            assert ok, reason
            assert np.array_equal(blocks(decode, [2]), blocks(new, [2]))  # the new bytes
            assert decode.connected_peers() == [new.agent_name]
        finally:
            new.close()
    finally:
        decode.close()


def test_two_engines_with_one_id_at_two_addresses() -> None:
    """Item 12: reads addressed to B get B's bytes (before: A's, reported finished)."""
    a, _ = make("p", seed=1)
    b, _ = make("p", seed=2)
    decode, _ = make("d", serve=False)
    try:
        a.hold("r", [3])
        b.hold("r", [3])
        decode.read("r", remote(a), [1], [3])
        assert outcome(decode, "r", 10)[0]
        decode.read("r", remote(b), [2], [3])
        ok, reason = outcome(decode, "r", 10)
        assert ok, reason
        assert np.array_equal(blocks(decode, [1]), blocks(a, [3]))
        assert np.array_equal(blocks(decode, [2]), blocks(b, [3]))
    finally:
        for w in (a, b, decode):
            w.close()


def test_closed_workers_leave_no_threads_and_refuse_reads() -> None:
    """Item 13: close() stops the tcp accept thread and the port; a peer that handshook
    before cannot READ afterwards."""
    base = threading.active_count()
    for _ in range(20):
        w, _ = make("p")
        w.close()
    assert threading.active_count() <= base + 2
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False, handshake_timeout=1.0)
    try:
        prefill.hold("r0", [1])
        prefill.hold("r1", [2])
        decode.read("r0", remote(prefill), [1], [1])
        assert outcome(decode, "r0", 10)[0]
        prefill.close()
        decode.read("r1", remote(prefill), [2], [2])
        ok, reason = outcome(decode, "r1", 10)
        assert not ok, reason
    finally:
        prefill.close()
        decode.close()


def test_close_is_bounded_with_undeliverable_notes() -> None:
    """Item 9: 16 refusals to a dead decode cost minutes of close() before; now <= ~2 s."""
    from kvlink import wire
    from kvlink.compat import WIRE_VERSION

    prefill, _ = make("p")
    try:
        for i in range(16):
            prefill.refuse_push(wire.PushRequest(
                v=WIRE_VERSION, engine_id="d", agent_name="a", req_id=f"r{i}", tp_rank=0,
                tp_size=1, host="127.0.0.1", port=1, block_ids=[0]), "no")
    finally:
        t0 = time.monotonic()
        prefill.close()
        assert time.monotonic() - t0 < 3.0


class _RaisingTcp(TcpTransport):
    """A fault no real transport gives on demand: post raises for a dropped peer."""

    name = "raising_tcp"

    def post(self, *args: Any, **kwargs: Any) -> int:
        raise TransferError("peer dropped (injected)")


def test_a_raising_post_fails_the_request_not_the_caller() -> None:
    """Item 8: an exception from a transport's post becomes a failed request (before, it
    escaped poll() and killed the vLLM worker), and the prefill is released at once."""
    register_transport("raising_tcp", _RaisingTcp)
    prefill, _ = make("p", seed=1, transports=["raising_tcp"])
    decode, _ = make("d", serve=False, transports=["raising_tcp"])
    try:
        prefill.hold("r0", [1])
        decode.read("r0", remote(prefill), [1], [1])
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "injected" in reason
        until(lambda: prefill.leases.stats.released_done == 1 or bool(prefill.released()),
              5, "the prefill was released")
    finally:
        prefill.close()
        decode.close()


def test_worker_config_names_bad_values() -> None:
    with pytest.raises(ConfigError, match="lease_seconds must be positive, got 0"):
        WorkerConfig(engine_id="p", lease_seconds=0)
