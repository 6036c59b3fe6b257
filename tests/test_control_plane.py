"""The control plane off the critical path (issue 19), through the public API.

Real KVWorkers over the real tcp transport and the real side channel on 127.0.0.1. Each
test failed on the code before: a READ waited for a read intent answered on a thread pool, and
every side-channel message opened its own socket (plus a challenge round trip with a secret).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_lifecycle import blocks, make, outcome, remote, sleep_until, until

from kvlink import sidechannel, wire
from kvlink.channel import Channels
from kvlink.compat import WIRE_VERSION
from kvlink.errors import AuthError, PeerUnreachable, SideChannelError
from kvlink.worker import KVWorker, RemoteEngine


def _warm(decode: KVWorker, prefill: KVWorker) -> None:
    """One request so the decode has the prefill's handshake cached."""
    gen = prefill.hold("warm", [0])
    decode.read("warm", remote(prefill), [0], [0], generation=gen)
    ok, reason = outcome(decode, "warm", 10)
    assert ok, reason
    decode.poll()  # what it owes the producer (its report) leaves with the next poll


def test_read_told_its_generation_is_posted_inside_read() -> None:
    """No round trip before the READ: with the handshake cached, read() itself posts it, on
    the caller's thread; the bytes are validated after (finished = the producer confirmed)."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    try:
        _warm(decode, prefill)
        gen = prefill.hold("r0", [2, 3, 9])
        decode.read("r0", remote(prefill), [4, 5, 6], [2, 3, 9], generation=gen)
        assert decode._requests["r0"].parts[0].handle is not None  # posted already
        ok, reason = outcome(decode, "r0", 10)
        assert ok, reason
        assert np.array_equal(blocks(decode, [4, 5, 6]), blocks(prefill, [2, 3, 9]))
        gone: list[str] = []  # the reports that let the producer release need not be awaited:
        # they leave with the decode's next poll
        until(lambda: decode.poll() is None or bool(gone.extend(
            r.req_id for r in prefill.released())) or len(gone) == 2, 5, "both holds released")
        assert gone == ["warm", "r0"]
        phases = decode.phases.pop("r0")
        assert phases.transfer > 0 and phases.verdict > 0 and phases.wait == pytest.approx(
            0, abs=0.05)
    finally:
        prefill.close()
        decode.close()


def test_read_without_an_intent_whose_lease_ended_fails() -> None:
    """The lease expired (and the blocks were free to be reused) before the READ: the owner
    refuses it (its grant ended with the hold), nothing moves, and the reader is told why."""
    prefill, _ = make("p", seed=1, lease_seconds=0.3)
    decode, _ = make("d", serve=False)
    try:
        _warm(decode, prefill)
        gen = prefill.hold("r0", [2])
        sleep_until(time.monotonic() + 0.4)
        assert [r.why for r in prefill.released()] == ["read", "expired"]  # warm, r0
        decode.read("r0", remote(prefill), [7], [2], generation=gen)
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "no grant" in reason and "expired" in reason
        assert prefill.stats()["tcp"].refused == 1
    finally:
        prefill.close()
        decode.close()


def test_read_with_another_holds_generation_fails() -> None:
    """Released and held again under the READ: the generation the reader was told is not the
    one held now, so its bytes may be the next request's."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    try:
        _warm(decode, prefill)
        old = prefill.hold("r0", [2])
        prefill.abort("r0")
        prefill.hold("r0", [2])
        decode.read("r0", remote(prefill), [7], [2], generation=old)
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "ended before its READ" in reason
    finally:
        prefill.close()
        decode.close()


def test_read_without_an_intent_of_blocks_not_held_fails() -> None:
    """Blocks outside the hold: the owner refuses the READ (outside its grant), the producer
    names them, and the reader counts as done (the hold is released, not left to expire)."""
    prefill, _ = make("p", seed=1, lease_seconds=60)
    decode, _ = make("d", serve=False)
    try:
        gen = prefill.hold("r0", [2])
        decode.read("r0", remote(prefill), [7, 8], [2, 5], generation=gen)
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "not among" in reason
        gone: list[tuple[str, str]] = []
        until(lambda: bool(gone.extend((r.req_id, r.why) for r in prefill.released()) or gone),
              5, "the failed reader's release")
        assert gone == [("r0", "read")]
    finally:
        prefill.close()
        decode.close()


def _read_before_the_hold(gen: int, until_asked: Callable[[KVWorker, KVWorker], bool],
                          stall: float = 0.0, **decode_cfg: Any) -> None:
    """vLLM's order: the decode READs under a generation minted before the prefill holds; once
    ``until_asked`` (the READ refused, its question sent), the decode's step stalls ``stall``
    seconds, the prefill holds, and the READ must finish with the prefill's bytes."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False, **decode_cfg)
    try:
        _warm(decode, prefill)
        decode.read("r0", remote(prefill), [7], [4], generation=gen)
        until(lambda: decode.poll() is None or until_asked(decode, prefill), 10,
              "the early READ refused and asked about")
        if stall:
            sleep_until(time.monotonic() + stall)  # the reader's step stalls: under test
        prefill.hold("r0", [4], generation=gen)
        ok, reason = outcome(decode, "r0", 10)
        assert ok, reason
        assert np.array_equal(blocks(decode, [7]), blocks(prefill, [4]))
    finally:
        prefill.close()
        decode.close()


def test_generation_minted_before_the_hold_validates_once_held() -> None:
    """vLLM's case: the scheduler mints the generation where it keeps the blocks, the decode
    READs before the prefill worker's next step holds them. The owner refuses that READ (no
    grant yet: nothing moved), the reader asks, is told "not held yet", READs again, and is
    validated once the hold (same generation) arrives."""
    _read_before_the_hold(123456789, lambda d, p: p.stats()["tcp"].refused >= 2)


def test_a_reader_starved_past_the_intent_timeout_keeps_an_answer_that_came_in_time() -> None:
    """The "not held yet" answer arrived in time, but the reader's process did not run for
    longer than intent_timeout (a compile holding its GIL: the caller's poll stalls) before
    reading it. The question was asked in time, so it asks again and finishes once held.
    Before: judged by when the answer was read, the READ failed and was recomputed."""
    _read_before_the_hold(987654321,
                          lambda d, p: d._requests["r0"].parts[0].verdict is not None,
                          stall=0.8, intent_timeout=0.5)


def test_one_session_carries_every_message_with_a_secret() -> None:
    """Authenticate once per connection: 20 requests with a shared secret cost one Hello, and
    each poll's reports leave in one frame per peer (before: a socket and a challenge round
    trip per message)."""
    prefill, _ = make("p", seed=1, secret="s3cret")
    decode, _ = make("d", serve=False, secret="s3cret")
    try:
        gens = {f"r{i}": prefill.hold(f"r{i}", [i]) for i in range(8)}
        for req, gen in gens.items():
            i = int(req[1:])
            decode.read(req, remote(prefill), [i], [i], generation=gen)
        pending = set(gens)
        deadline = time.monotonic() + 20
        while pending and time.monotonic() < deadline:
            done, failed = decode.poll()
            assert not failed, failed
            pending -= done
        assert not pending
        assert np.array_equal(blocks(decode, list(range(8))), blocks(prefill, list(range(8))))
        chan, server = decode._chan, prefill._server
        assert server is not None
        # the reads' reports to the producer leave with a later poll (a session opens first)
        until(lambda: decode.poll() is None or (decode.pending() == 0 and not chan.busy()
                                                and server.stats()["authenticated"] == 1),
              5, "the reads' reports delivered")
        assert len(chan._conns) == 1  # one connection to the one peer, kept open
        assert server.stats()["authenticated"] == 1
        frames, calls = chan.frames_sent, chan.calls_sent
        for i in range(8):  # one step's eight reports: one frame
            decode.release(f"gone{i}", remote(prefill))
        decode.poll()
        assert (chan.frames_sent - frames, chan.calls_sent - calls) == (1, 8)
    finally:
        prefill.close()
        decode.close()


def _server(secret: bytes | None) -> sidechannel.SideChannelServer:
    return sidechannel.SideChannelServer(
        "127.0.0.1", 0, lambda m: wire.Ack(v=WIRE_VERSION), secret=secret)


def _ack(chan: Channels, port: int, timeout: float = 5.0) -> wire._Msg:
    note = wire.Notification(v=WIRE_VERSION, engine_id="e", req_id="r", tp_rank=0, tp_size=1,
                             kind="write", ok=True)
    pending = chan.call("127.0.0.1", port, note, timeout)
    chan.flush()
    deadline = time.monotonic() + timeout + 1
    while not pending.done() and time.monotonic() < deadline:
        chan.wait(0.05)
    return pending.result()


def test_sessions_refuse_wrong_secrets_unsealed_batches_and_replays() -> None:
    srv = _server(b"right")
    try:
        assert isinstance(_ack(Channels(b"right"), srv.port), wire.Ack)
        with pytest.raises(AuthError, match="secrets differ"):
            _ack(Channels(b"wrong"), srv.port)
        with pytest.raises(AuthError, match="requires authentication"):
            _ack(Channels(None), srv.port)
        # a frame replayed on its own connection: the counter has moved on
        chan = Channels(b"right")
        assert isinstance(_ack(chan, srv.port), wire.Ack)
        conn = next(iter(chan._conns.values()))
        assert conn.key is not None
        body = wire.encode(wire.Batch(v=WIRE_VERSION, calls=[]))
        mac = sidechannel.seal_mac(conn.key, conn.counter, body)
        assert conn.pipe is not None
        conn.pipe.put(wire.encode(wire.Sealed(
            v=WIRE_VERSION, counter=conn.counter, mac=mac, body=body)))
        deadline, frames = time.monotonic() + 5, []
        while not frames and time.monotonic() < deadline:
            frames = conn.pipe.take()
        reply = wire.decode(frames[0])
        assert isinstance(reply, wire.ErrorReply) and "replayed" in reply.message
    finally:
        srv.close()


def _rebind(port: int, handler: sidechannel.Handler = lambda m: wire.Ack(v=WIRE_VERSION)
            ) -> sidechannel.SideChannelServer:
    """The same port again (tried until it is free: a closed port may linger a moment)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return sidechannel.SideChannelServer("127.0.0.1", port, handler, secret=b"k")
        except SideChannelError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_a_restarted_server_gets_a_new_session_and_a_dead_one_times_out() -> None:
    """The kept-open connection outlives its server: the first frame to the restarted one is
    refused (no session), the next call opens a new session; a server that is gone fails the
    call at its deadline, not later."""
    srv = _server(b"k")
    port = srv.port
    chan = Channels(b"k")
    assert isinstance(_ack(chan, port), wire.Ack)
    srv.close()
    srv = _rebind(port)
    try:
        try:
            _ack(chan, port)
        except AuthError as exc:
            assert "no session" in str(exc)
        assert isinstance(_ack(chan, port), wire.Ack)
    finally:
        srv.close()
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable):
        _ack(chan, port, timeout=0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_quiet_report_whose_frame_did_not_leave_goes_on_the_next_connection() -> None:
    """A report that wants no answer is settled once its frame leaves; one whose frame our
    kernel refused (the kept-open connection had ended: its server restarted, and the frame
    before it drew the reset) did not leave, and goes on the next connection like any call.
    Before, it was taken off the queue and neither sent again nor settled: lost, its Pending
    never done (a worker kept it among its reports for good, its failure never logged)."""
    srv = _server(b"k")
    port = srv.port
    chan = Channels(b"k")
    seen: list[str] = []

    def note(req_id: str) -> wire.Notification:
        return wire.Notification(v=WIRE_VERSION, engine_id="e", req_id=req_id, tp_rank=0,
                                 tp_size=1, kind="write", ok=True)

    def record(msg: object) -> wire.Reply:
        assert isinstance(msg, wire.Notification)
        seen.append(msg.req_id)
        return wire.Ack(v=WIRE_VERSION)

    try:
        assert isinstance(_ack(chan, port), wire.Ack)  # the kept-open connection, answered
        pipe = chan._conns[("127.0.0.1", port)].pipe
        assert pipe is not None
        srv.close()  # nothing awaits an answer: the connection is not read, its end unseen
        srv = _rebind(port, record)
        lost = chan.call("127.0.0.1", port, note("lost"), 5.0, quiet=True)
        chan.flush()  # taken by our kernel: sent, not delivered (Channels.call says so) ...
        assert isinstance(lost.result(), wire.Ack)
        hangup = select.poll()  # ... and the closed end answers it with a reset
        hangup.register(pipe.fileno(), select.POLLHUP | select.POLLERR)
        assert hangup.poll(5000), "no reset from the closed end within 5 s"
        again = chan.call("127.0.0.1", port, note("again"), 2.0, quiet=True)
        chan.flush()  # refused by our kernel (the reset): not sent
        assert chan._conns[("127.0.0.1", port)].broken
        until(lambda: (chan.wait(0.01), again.done())[1], 5.0,  # past its 2 s deadline
              "the report sent on a new connection, or failed")
        assert isinstance(again.result(), wire.Ack)
        until(lambda: bool(seen), 5.0, "the report at the restarted server")
        assert seen == ["again"]
    finally:
        srv.close()
        chan.close()


def test_wait_sleeps_when_nothing_is_awaited() -> None:
    """``wait`` is a caller's idle sleep (vLLM's idle step yields through it): with nothing
    awaited it sleeps. Returning at once made that yield a busy loop holding the GIL from
    the side channel's and the transport's threads (the prefill stopped answering)."""
    chan = Channels(None)
    t0 = time.monotonic()
    chan.wait(0.05)
    assert time.monotonic() - t0 >= 0.045
    srv = _server(None)
    try:
        assert srv.session_port == srv.port  # one port serves handshakes and sessions
        assert isinstance(_ack(chan, srv.port), wire.Ack)  # over the kept-open connection
        assert next(iter(chan._conns.values())).pipe is not None
    finally:
        srv.close()


def test_a_wait_shorter_than_a_millisecond_is_not_rounded_up_to_one() -> None:
    """With an answer awaited, ``wait`` polls the connections, and ``poll`` counts whole
    milliseconds: a 0.2 ms wait slept 1 ms. The vLLM worker waits for a load in 0.2 ms steps
    (its idle yield, a synchronous load before the forward), and a READ's end is no message:
    each step overslept it by 0.8 ms."""
    import threading

    go = threading.Event()

    def slow(msg: Any) -> wire._Msg:
        go.wait(10)
        return wire.Ack(v=WIRE_VERSION)

    srv = sidechannel.SideChannelServer("127.0.0.1", 0, slow, secret=None)
    chan = Channels(None)
    try:
        note = wire.Notification(v=WIRE_VERSION, engine_id="e", req_id="r", tp_rank=0,
                                 tp_size=1, kind="write", ok=True)
        pending = chan.call("127.0.0.1", srv.port, note, 5.0)
        chan.flush()
        chan.wait(0.05)  # (the handshake and the frame out)
        t0 = time.perf_counter()
        for _ in range(20):
            chan.wait(0.0002)
        took = time.perf_counter() - t0
        assert not pending.done()  # awaited all along
        assert took < 0.015, f"20 waits of 0.2 ms took {took * 1e3:.1f} ms"
        go.set()
        deadline = time.monotonic() + 5
        while not pending.done() and time.monotonic() < deadline:
            chan.wait(0.01)
        assert isinstance(pending.result(), wire.Ack)
    finally:
        go.set()
        srv.close()
        chan.close()


def test_a_question_only_a_live_peer_answers_fails_at_once_when_nobody_listens() -> None:
    """``live_only`` (what became of a READ of that process's memory): once the process at an
    address is gone and nobody listens there (connection refused), such a call fails at the
    next pump, not at its deadline; other calls keep trying until theirs (a peer starting up
    may still come). Before, a dead prefill held a synchronous load's forward for the report
    timeout (2 s)."""
    srv = sidechannel.SideChannelServer("127.0.0.1", 0,
                                        lambda msg: wire.Ack(v=WIRE_VERSION), secret=None)
    chan = Channels(None)
    note = wire.Notification(v=WIRE_VERSION, engine_id="e", req_id="r", tp_rank=0, tp_size=1,
                             kind="write", ok=True)
    try:
        first = chan.call("127.0.0.1", srv.port, note, 5.0)
        chan.flush()
        until(lambda: (chan.wait(0.01), first.done())[1], 5.0, "the first answer")
        assert isinstance(first.result(), wire.Ack)  # the kept-open connection answered
        srv.close()  # the process is gone: nobody listens at its port any more
        asked = chan.call("127.0.0.1", srv.port, note, 5.0, live_only=True)
        other = chan.call("127.0.0.1", srv.port, note, 5.0)
        chan.flush()
        t0 = time.monotonic()
        until(lambda: (chan.wait(0.01), asked.done())[1], 1.0, "the live-only call's failure")
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(PeerUnreachable, match="nobody listens"):
            asked.result()
        assert not other.done()  # retried until its deadline, as before
    finally:
        srv.close()
        chan.close()


def test_no_stale_report_reaches_the_next_process_at_an_address() -> None:
    """A release sent to an address nobody serves times out; it must not sit in a kept-open
    connection's queue and reach the next process bound there (which holds the same request
    id), releasing that hold. And a release naming another hold's generation is ignored."""
    from kvlink.demo.run import free_port_range

    port = free_port_range(1)
    decode, _ = make("d", serve=False, handshake_timeout=0.3)
    prefill: KVWorker | None = None
    try:
        decode.release("r0", remote_at(port))
        until(lambda: decode.poll() is None or not decode._told, 10, "the release timed out")
        prefill, _ = make("p", seed=1, side_port=port)
        gen = prefill.hold("r0", [1])
        decode.release("r0", remote_at(port), generation=gen + 1)  # another hold's
        # answered: the prefill took it (and, had it survived, the stale one before it)
        until(lambda: decode.poll() is None or not decode._told, 10, "the release was answered")
        assert prefill.leases.is_held("r0"), prefill.leases.released_why("r0")
        assert prefill.refusals["release"] >= 1
    finally:
        decode.close()
        if prefill is not None:
            prefill.close()


def remote_at(port: int) -> RemoteEngine:
    return RemoteEngine("p", "127.0.0.1", port)


def test_a_push_request_sent_again_is_queued_once() -> None:
    """A session that breaks with calls unanswered resends them through the side channel; a
    push request the prefill had already taken must not be written twice."""
    prefill, _ = make("p")
    try:
        msg = wire.PushRequest(v=WIRE_VERSION, engine_id="d", agent_name="a", req_id="r0",
                               tp_rank=0, tp_size=1, host="127.0.0.1", port=1, block_ids=[0],
                               push_id=7, ttl_ms=10_000)
        assert isinstance(prefill._on_side_message(msg), wire.Ack)
        assert isinstance(prefill._on_side_message(msg), wire.Ack)  # again
        assert [m.push_id for m in prefill.push_requests()] == [7]
    finally:
        prefill.close()


def test_what_callers_read_back_is_written_off_the_reporting_poll() -> None:
    """The poll that reports a request only notes what ended (kvlink.worker.ledger): its
    records are written by a later poll, before any of them is read, or at close — never
    lost, never read stale, and the transport's handles are released all the same."""
    from kvlink.worker.ledger import OWED_MAX

    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    tcp = decode.transports["tcp"]
    try:
        _warm(decode, prefill)
        decode.take_transfers()
        before = decode.finished_bytes
        rids = [f"r{i}" for i in range(OWED_MAX + 8)]
        most = 0
        for i, rid in enumerate(rids):
            gen = prefill.hold(rid, [i % 8])
            decode.read(rid, remote(prefill), [8 + i % 8], [i % 8], generation=gen)
            ok, reason = outcome(decode, rid, 10, step=prefill.poll)
            assert ok, reason
            most = max(most, decode._ledger.owed())  # read off the worker: no settling
        assert 0 < most <= 2 * (OWED_MAX + 1)  # owed for a while, and bounded
        # read back as if each had been written at its report
        assert set(rids) <= set(decode.xfer_seconds) and set(rids) <= set(decode.phases)
        assert all(decode.phases[r].transfer > 0 for r in rids)
        nbytes = decode.spec.num_layers * 2 * decode.spec.page_bytes
        assert decode.finished_bytes - before == len(rids) * nbytes
        transfers = decode.take_transfers()
        assert len(transfers) == len(rids) and all(t.ok and t.nbytes == nbytes
                                                   for t in transfers)
        assert not tcp._xfers  # every handle released once written down
        released: list[int] = []
        release = tcp.release
        tcp.release = lambda h: (released.append(h), release(h))[1]  # type: ignore[method-assign]
        gen = prefill.hold("last", [1])
        decode.read("last", remote(prefill), [15], [1], generation=gen)
        ok, reason = outcome(decode, "last", 10, step=prefill.poll)
        assert ok, reason
        owed = decode._ledger.owed()
    finally:
        prefill.close()
        decode.close()
    assert decode._ledger.owed() == 0 and len(released) == 1  # close wrote it down (owed
    assert owed >= 0  # or not by then), releasing its handle once
