"""Least privilege (issue 20, items 1 and 2): what a peer that *is* let in may still do.

Real KVWorkers over the real tcp transport and side channel on 127.0.0.1; the attacker is
another real process-local client speaking the real wire (a handshake, then its own
TcpTransport or side-channel messages), as a hostile user would. Each test failed on the code
before: one handshake handed out a master key to all registered memory, and a release or hold
from anyone who knew a request id was taken.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_lifecycle import blocks, make, outcome, remote, until

from kvlink import sidechannel, wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import AuthError, KVLinkError
from kvlink.grants import read_ticket
from kvlink.hostid import host_id
from kvlink.integrity import checker
from kvlink.leases import BlockLeases, new_generation
from kvlink.transport import (
    Op,
    TransportContext,
    XferStatus,
    create_transport,
    make_extents,
    register_transport,
)
from kvlink.worker import KVWorker
from kvlink_transports.tcp import TcpTransport


def _handshake(prefill: KVWorker, engine: str = "attacker") -> wire.HandshakeResponse:
    spec = prefill._require_spec()
    from kvlink.compat import compat_hash

    reply = sidechannel.request("127.0.0.1", prefill.side_port, wire.HandshakeRequest(
        v=WIRE_VERSION, engine_id=engine, agent_name=f"{engine}/0/1", tp_rank=0, tp_size=1,
        host_id=host_id(), compat=compat_hash(spec.geometry())), 5.0)
    assert isinstance(reply, wire.HandshakeResponse)
    return reply


def _attacker_transport(prefill: KVWorker) -> tuple[object, np.ndarray]:
    """A tcp transport of our own, connected with the descriptor one handshake handed out."""
    reply = _handshake(prefill)
    t = create_transport("tcp", TransportContext(agent_name="attacker/0/1"))
    buf = np.full(1 << 16, 0xAB, dtype=np.uint8)
    from kvlink.transport import Region

    t.register([Region(buf.ctypes.data, buf.nbytes, "cpu")])
    t.connect(reply.agent_name, reply.transports["tcp"])
    return t, buf


def _first_page(prefill: KVWorker, block: int) -> tuple[int, int]:
    spec = prefill._require_spec()
    ext = spec.page_extents(0, block)
    return int(ext["addr"][0]), int(ext["len"][0])


def _wait(t: object, handle: int) -> tuple[XferStatus, str]:
    state = t.wait(handle, 10.0)  # type: ignore[attr-defined]
    return state.status, state.reason


@pytest.mark.attack("a reader WRITEs 64 B into prefill block 0 with its handshake's memory key")
def test_a_reader_cannot_write_into_the_producer(observed: Callable[[str], None]) -> None:
    """Item 1: with the tcp memory key from one handshake, a 64 B WRITE into prefill block 0
    was accepted and the next legitimate pull of it read the attacker's bytes. Now refused —
    with no grant, and under a READ grant alike — and the block stays the prefill's."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    t, buf = _attacker_transport(prefill)
    try:
        before = blocks(prefill, [0]).copy()
        gen = prefill.hold("r0", [0])
        addr, _n = _first_page(prefill, 0)
        agent = next(iter(t._peers))  # type: ignore[attr-defined]
        local = make_extents([buf.ctypes.data], [64])
        for ticket in (b"", read_ticket("r0", gen)):
            h = t.post(Op.WRITE, agent, local, make_extents([addr], [64]),  # type: ignore
                       ticket=ticket)
            status, reason = _wait(t, h)
            assert status is XferStatus.FAILED and "refused" in reason, reason
            observed(f"ticket {'none' if not ticket else 'READ grant'}: FAILED ({reason})")
        assert np.array_equal(blocks(prefill, [0]), before)
        assert prefill.stats()["tcp"].refused == 2
        decode.read("r0", remote(prefill), [5], [0], generation=gen)
        ok, reason = outcome(decode, "r0", 10)
        assert ok, reason
        assert np.array_equal(blocks(decode, [5]), before)
        observed("block 0 unchanged; tcp refused=2; the next legitimate pull verified")
    finally:
        t.close()  # type: ignore[attr-defined]
        prefill.close()
        decode.close()


@pytest.mark.attack("a reader READs blocks of another request, and its own after the hold ended")
def test_reads_only_the_granted_blocks_and_only_while_held(observed: Callable[[str], None]) -> None:
    """Item 1, range: a peer that knows one request's generation READs that request's blocks
    and no other, and nothing once its hold ended (the owner refuses; before, any registered
    byte was readable by anyone who handshook)."""
    prefill, _ = make("p", seed=1)
    t, buf = _attacker_transport(prefill)
    try:
        gen = prefill.hold("r0", [3])
        prefill.hold("secret", [4])
        agent = next(iter(t._peers))  # type: ignore[attr-defined]
        local = make_extents([buf.ctypes.data], [64])
        mine, _ = _first_page(prefill, 3)
        other, _ = _first_page(prefill, 4)
        h = t.post(Op.READ, agent, local, make_extents([mine], [64]),  # type: ignore
                   ticket=read_ticket("r0", gen))
        assert _wait(t, h)[0] is XferStatus.DONE
        h = t.post(Op.READ, agent, local, make_extents([other], [64]),  # type: ignore
                   ticket=read_ticket("r0", gen))
        assert _wait(t, h)[0] is XferStatus.FAILED
        prefill.abort("r0")
        h = t.post(Op.READ, agent, local, make_extents([mine], [64]),  # type: ignore
                   ticket=read_ticket("r0", gen))
        status, reason = _wait(t, h)
        assert status is XferStatus.FAILED and "grant" in reason, reason
        observed("own blocks under the grant: DONE; another request's: FAILED; after the "
                 f"release: FAILED ({reason})")
    finally:
        t.close()  # type: ignore[attr-defined]
        prefill.close()


@pytest.mark.attack("engine 'attacker' sends done/failed notes for req-0..3")
def test_forged_releases_are_refused_and_counted(observed: Callable[[str], None]) -> None:
    """Item 2: four "done" notes from engine "attacker" freed req-0..3 under their readers.
    A release now must name the hold's generation; the forgeries are refused and counted, and
    the real reader still reads every request."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    try:
        gens = [prefill.hold(f"req-{i}", [i]) for i in range(4)]
        for i in range(4):
            for ok in (True, False):
                with np.testing.assert_raises(KVLinkError):
                    sidechannel.request("127.0.0.1", prefill.side_port, wire.ReadDone(
                        v=WIRE_VERSION, engine_id="attacker", req_id=f"req-{i}", tp_rank=0,
                        tp_size=1, ok=ok), 5.0)
        assert prefill.refusals["release"] == 8
        assert prefill.released() == []
        for i, gen in enumerate(gens):
            decode.read(f"req-{i}", remote(prefill), [8 + i], [i], generation=gen)
            ok, reason = outcome(decode, f"req-{i}", 10)
            assert ok, reason
        gone: list[str] = []  # the readers' reports arrive after they finished (holdboard),
        # with the reader's next poll
        until(lambda: decode.poll() is None or bool(gone.extend(
            r.req_id for r in prefill.released())) or len(gone) >= 4, 5, "every hold released")
        assert sorted(gone) == [f"req-{i}" for i in range(4)]
        observed("8 forgeries refused (not_yours), refusals['release']=8, nothing released; "
                 "the real reader then read all 4")
    finally:
        prefill.close()
        decode.close()


@pytest.mark.attack("a third party's 'written' note for a push it was not asked")
def test_a_forged_written_note_does_not_finish_a_push(observed: Callable[[str], None]) -> None:
    """Item 2: a third party's Notification(kind='write', engine_id='p', req_id='req-1')
    made the decode report req-1 finished with its blocks still zero. A note counts only for
    the push it answers (its random push id); others are refused and counted."""
    decode, _ = make("d", seed=0, serve=True)
    try:
        decode.expect_push("req-1", remote(decode, "p"), [1, 2], timeout=0.5)
        note = wire.Notification(v=WIRE_VERSION, engine_id="p", req_id="req-1", tp_rank=0,
                                 tp_size=1)
        with np.testing.assert_raises(KVLinkError):
            sidechannel.request("127.0.0.1", decode.side_port, note, 5.0)
        finished: set[str] = set()

        def refused() -> bool:
            finished.update(decode.poll()[0])
            return decode.refusals["written"] == 1

        until(refused, 5, "the forged note refused")
        assert "req-1" not in finished
        observed("refusals['written']=1; req-1 not finished")
    finally:
        decode.close()


@pytest.mark.attack("a Hold of any blocks under a generation the sender picked")
def test_a_hold_not_signed_by_our_scheduler_is_refused(observed: Callable[[str], None]) -> None:
    """A hold names the generation that lets a reader in: one from anyone on the host would
    open any block to its sender. Only holds MAC'd with the engine's local key are taken."""
    prefill, _ = make("p", seed=1)
    held: list[wire.Hold] = []
    prefill.hold_hook = held.append
    try:
        forged = wire.Hold(v=WIRE_VERSION, engine_id="p", req_id="x", block_ids=[0, 1, 2],
                           generation=12345)
        with np.testing.assert_raises(AuthError):
            sidechannel.request("127.0.0.1", prefill.side_port, forged, 5.0)
        from kvlink import localkey

        body = wire.hold_body("p", "x", [0, 1, 2], 12345)
        signed = wire.Hold(v=WIRE_VERSION, engine_id="p", req_id="x", block_ids=[0, 1, 2],
                           generation=12345, mac=localkey.sign(prefill.engine_key(), body))
        sidechannel.request("127.0.0.1", prefill.side_port, signed, 5.0)
        assert [h.req_id for h in held] == ["x"] and prefill.refusals["hold"] == 1
        observed("unsigned: refused (auth), refusals['hold']=1; signed with the engine key: "
                 "taken")
    finally:
        prefill.close()


@pytest.mark.attack("read intents every second from new reader names, to pin a 10 s lease")
def test_read_intents_cannot_pin_a_hold_past_its_lease(observed: Callable[[str], None]) -> None:
    """Item 2: intents from a non-reader kept extending a request's lease. An intent extends
    it once, to lease + read_seconds at most, whoever keeps sending them."""
    now = [0.0]
    leases = BlockLeases(10.0, lambda: now[0], read_seconds=3.0)
    leases.hold("r", [1])
    for t in range(0, 40):
        now[0] = float(t)
        leases.begin_read("r", f"attacker/{t}", [1])
        if leases.expire():
            break
    assert now[0] <= 13.0
    observed(f"expired at t={now[0]:.0f} s (lease 10 s + one read window of 3 s)")


def _read_refused(prefill: KVWorker, decode: KVWorker, gen: int,
                  observed: Callable[[str], None]) -> None:
    """A READ of the prefill's block 3 under ``gen`` into the decode's block 5 is refused by
    the owner (no grant), the block untouched."""
    before = blocks(decode, [5]).copy()
    decode.read("r0", remote(prefill), [5], [3], generation=gen)
    ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
    observed(f"reader: {reason}")
    assert not ok and "no grant for this transfer" in reason, reason
    assert np.array_equal(blocks(decode, [5]), before)


@pytest.mark.fault("hold(): the integrity digests of the held blocks cannot be taken (injected)")
def test_a_hold_that_raises_leaves_no_grant(monkeypatch: pytest.MonkeyPatch,
                                            observed: Callable[[str], None]) -> None:
    """A hold whose digests cannot be fixed (injected: the digest raises, as a device error in
    its kernel would — the real one cannot be made to fail on demand) raises and leaves
    nothing: not held, no digests, and no grant — a reader told the generation (minted before
    the hold, as vLLM's scheduler does) has its READ refused by the owner, its block
    untouched. Before, the grant outlived the raise: the owner served the READ and the
    prefill's bytes landed, only its verdict failed it. The same hold taken again then serves
    its reader."""
    prefill, _ = make("p", seed=1, integrity="full")
    decode, _ = make("d", intent_timeout=0.5)
    try:
        gen = new_generation()

        def fails(*args: object, **kw: object) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(checker, "digest", fails)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            prefill.hold("r0", [3], generation=gen)
        monkeypatch.undo()
        assert not prefill.leases.is_held("r0") and "r0" not in prefill.integrity._fixed
        _read_refused(prefill, decode, gen, observed)
        assert prefill.hold("r0", [3], generation=gen) == gen
        decode.read("r0", remote(prefill), [5], [3], generation=gen)
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        assert np.array_equal(blocks(decode, [5]), blocks(prefill, [3]))
    finally:
        prefill.close()
        decode.close()


class _GrantFailsTcp(TcpTransport):
    """A second transport that enforces grants, whose grant raises: no real one fails on
    demand (only tcp enforces grants today, and its gate only when out of memory)."""

    name = "grant_fails_tcp"

    def grant(self, ticket: bytes, op: Op, extents: np.ndarray) -> None:
        raise MemoryError("grant window (injected)")


@pytest.mark.fault("hold(): the second of two transports that enforce grants cannot grant "
                   "(injected)")
def test_a_grant_that_fails_partway_leaves_no_grant(observed: Callable[[str], None]) -> None:
    """The prefill serves over tcp and a second grant-enforcing transport whose grant raises
    (injected, see _GrantFailsTcp): hold() raises, and tcp, granted first, keeps no grant — a
    reader told the generation has its READ refused by the owner, its block untouched.
    Before, tcp's grant was taken outside the hold's cleanup and outlived the raise: the owner
    served the READ of blocks the caller believed not held."""
    register_transport("grant_fails_tcp", _GrantFailsTcp)
    prefill, _ = make("p", seed=1, transports=["tcp", "grant_fails_tcp"])
    decode, _ = make("d", intent_timeout=0.5)
    try:
        gen = new_generation()
        with pytest.raises(MemoryError, match="injected"):
            prefill.hold("r0", [3], generation=gen)
        assert not prefill.leases.is_held("r0")
        _read_refused(prefill, decode, gen, observed)
    finally:
        prefill.close()
        decode.close()
