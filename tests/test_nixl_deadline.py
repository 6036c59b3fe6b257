"""NIXL transfer deadlines (``timeout_s``) against a hung (SIGSTOPped) peer: real NIXL over UCX
(tcp only, and the default transports) between real processes on 127.0.0.1, with the peer helper
of tests/test_nixl_transport.py.

A READ's destination is our memory, and NIXL 1.5.1 cannot stop a UCX READ in flight (releasing
the request or removing the remote agent leaves it running: docs/nixl.md "Deadlines"), so these
tests check both halves of the contract's rule 1: the handle turns FAILED within its deadline,
and no byte of it lands afterwards, even once the hung peer runs again and answers what UCX had
queued for it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from test_transport_contract import wait_until as _until

try:
    from nixl import _api  # noqa: F401
except ImportError as exc:
    print(f"SKIP tests/test_nixl_deadline.py: NIXL is not importable ({exc})")
    pytest.skip(f"NIXL is not importable ({exc}): pip install 'kvlink[nixl]'",
                allow_module_level=True)

from procgroup import stop
from test_nixl_transport import OPTS, TIMEOUT, Peer

from kvlink.errors import ConfigError, HandshakeError, TransferError
from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink_transports import nixl as knixl

DEADLINE = 2.0  # timeout_s of the transport under test
N = 4 << 20  # bytes per READ
SENTINEL = 0xA5
QUIET = 3.0  # how long the destination is watched after the hung peer resumes
# bytes of a READ whose request was released land ~10 ms after the peer resumes (measured with
# the code before the deadline), so QUIET is some 300 times that


def _transport(opts: dict[str, Any]) -> knixl.NixlTransport:
    """A transport whose UCX context uses tcp only (the READ then needs the peer's progress)."""
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    try:
        return knixl.NixlTransport(
            TransportContext(agent_name=f"reader-{uuid.uuid4().hex[:8]}"), {**OPTS, **opts}
        )
    finally:
        if old is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = old




def _reap(p: Peer) -> None:
    if p.proc.is_alive():
        os.kill(p.proc.pid or 0, signal.SIGKILL)
    p.proc.join(TIMEOUT)


def _read(t: knixl.NixlTransport, p: Peer, buf: np.ndarray, off: int, n: int) -> int:
    return t.post(Op.READ, p.name, make_extents(buf.ctypes.data + off, n), make_extents(p.addr, n))


def _untouched_while(buf: np.ndarray, t: knixl.NixlTransport, seconds: float) -> bool:
    """True if ``buf`` still holds only SENTINEL after watching it for ``seconds`` (bounded
    polling, our UCX progressed meanwhile: a late byte would be written by that progress)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not np.all(buf == SENTINEL):
            return False
        t.notifications()
        time.sleep(0.01)
    return bool(np.all(buf == SENTINEL))


@pytest.fixture()
def peers() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def new(role: str, seed: int, name: str | None = None) -> Peer:
        made.append(Peer(name or f"{role}-{uuid.uuid4().hex[:8]}", N, seed=seed, tls="tcp"))
        return made[-1]

    yield new
    for p in made:
        if p.proc.is_alive():
            os.kill(p.proc.pid or 0, signal.SIGCONT)
        _reap(p)


def test_timeout_s_must_be_positive() -> None:
    for bad in (0, -1.0):
        with pytest.raises(ConfigError, match="timeout_s"):
            knixl.NixlTransport(TransportContext(agent_name=f"bad-{uuid.uuid4().hex[:8]}"),
                                {**OPTS, "timeout_s": bad})


@pytest.mark.fault("NIXL READ from a SIGSTOPped peer over UCX tcp (timeout_s=2), with a READ "
                   "from a live peer posted alongside; the hung peer resumes after the failure")
def test_read_from_stopped_peer_fails_at_deadline_and_nothing_lands(
    peers: Callable[..., Peer], observed: Callable[[str], None]
) -> None:
    """Old code: no deadline, the READ was still PENDING after 2 x timeout_s (issue: after 90 s)."""
    victim, live = peers("victim", 21), peers("live", 22)
    t = _transport({"timeout_s": DEADLINE})
    buf = np.zeros(2 * N, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        for p in (victim, live):  # connect and wire up, then the victim hangs
            t.connect(p.name, p.descriptor)
            h = _read(t, p, buf, 0, 4096)
            assert t.wait(h, TIMEOUT).status is XferStatus.DONE
            t.release(h)
            assert np.array_equal(buf[:4096], p.reference()[:4096])
        stop(victim.pid)
        mine, theirs = buf[:N], buf[N:]
        mine[:] = SENTINEL
        hv = _read(t, victim, buf, 0, N)
        hl = _read(t, live, buf, N, N)
        t0 = time.monotonic()
        while t.poll(hv).status is XferStatus.PENDING and time.monotonic() - t0 < 2 * DEADLINE:
            t.poll(hl)
            time.sleep(0.005)
        took = time.monotonic() - t0
        sv = t.poll(hv)
        observed(f"stopped peer's READ: {sv.status.value} after {took:.2f}s: {sv.reason}")
        assert sv.status is XferStatus.FAILED, (sv, took)
        assert DEADLINE * 0.9 <= took < 2 * DEADLINE, took
        assert victim.name in sv.reason and f"timeout_s={DEADLINE:g}s" in sv.reason, sv
        assert victim.name not in t._peers  # torn down: a new handshake loads it again
        assert t.wait(hl, TIMEOUT).status is XferStatus.DONE
        assert np.array_equal(theirs, live.reference())
        assert np.all(mine == SENTINEL)

        # the hung peer runs again and serves the READ request UCX had queued for it
        os.kill(victim.pid, signal.SIGCONT)
        assert _untouched_while(mine, t, QUIET), "bytes of a FAILED READ landed"
        observed(f"peer resumed: destination unchanged for {QUIET:.0f}s")

        # the live peer was not disturbed by the teardown
        theirs[:] = 0
        h = _read(t, live, buf, N, N)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(theirs, live.reference())

        # a new handshake with the victim works
        target = victim
        if not victim.proc.is_alive():  # UCX 1.23 aborts the resumed peer (docs/nixl.md)
            victim.proc.join(TIMEOUT)
            observed(f"the resumed peer exited with {victim.proc.exitcode} (UCX aborts a process "
                     "that answers a READ on a connection torn down meanwhile); reconnecting to "
                     "a restarted peer of the same name")
            target = peers("victim", 23, name=victim.name)
        t.connect(target.name, target.descriptor)
        mine[:] = 0
        h = _read(t, target, buf, 0, N)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(mine, target.reference())
        observed("a new connect to the victim's name reads its bytes")
        for h in (hv, hl):
            t.release(h)
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 2}
        assert t.stats.failed == 1
    finally:
        t.close()


@pytest.mark.fault("NIXL READ from a SIGSTOPped peer, default UCX transports (cma copies, tcp "
                   "carries notifications), after a READ with a notification (timeout_s=2)")
def test_read_behind_a_notification_fails_at_deadline_and_reconnects(
    observed: Callable[[str], None],
) -> None:
    """After a NIXL notification the next transfer on the endpoint completes only once the
    target has progressed (docs/nixl.md "Progress"), so against a stopped target a READ hangs
    even though cma needs no target CPU. Old code: PENDING for good."""
    victim = Peer(f"victim-{uuid.uuid4().hex[:8]}", N, seed=41)  # default UCX_TLS
    t = knixl.NixlTransport(TransportContext(agent_name=f"reader-{uuid.uuid4().hex[:8]}"),
                            {**OPTS, "timeout_s": DEADLINE})
    buf = np.zeros(N, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(victim.name, victim.descriptor)
        h = t.post(Op.READ, victim.name, make_extents(buf.ctypes.data, 4096),
                   make_extents(victim.addr, 4096), notify=b"warm")
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        stop(victim.pid)
        h = _read(t, victim, buf, 0, N)
        t0 = time.monotonic()
        assert _until(lambda: t.poll(h).status is not XferStatus.PENDING, 2 * DEADLINE)
        took = time.monotonic() - t0
        state = t.poll(h)
        observed(f"READ: {state.status.value} after {took:.2f}s: {state.reason}")
        assert state.status is XferStatus.FAILED and victim.name in state.reason, state
        assert DEADLINE * 0.9 <= took < 2 * DEADLINE, took
        after = buf.copy()  # cma may have copied before the failure; nothing may change now
        os.kill(victim.pid, signal.SIGCONT)
        end = time.monotonic() + QUIET
        while time.monotonic() < end:
            assert np.array_equal(buf, after), "bytes of a FAILED READ landed"
            t.notifications()
            time.sleep(0.01)
        t.release(h)
        assert victim.proc.is_alive()  # it had no READ of ours to answer
        t.connect(victim.name, victim.descriptor)  # the same descriptor: loaded again
        buf[:] = 0
        h = _read(t, victim, buf, 0, N)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(buf, victim.reference())
        observed(f"peer resumed: destination unchanged for {QUIET:.0f}s; connect with the same "
                 "descriptor again reads its bytes")
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 1}
    finally:
        t.close()
        if victim.proc.is_alive():
            os.kill(victim.proc.pid or 0, signal.SIGCONT)
        _reap(victim)


@pytest.mark.fault("disconnect() of a SIGSTOPped peer while a READ from it is in flight "
                   "(UCX tcp); the peer resumes after the failure")
def test_disconnect_of_stopped_peer_fails_read_only_once_nothing_can_land(
    peers: Callable[..., Peer], observed: Callable[[str], None]
) -> None:
    """Rule 1 for disconnect. Old code: FAILED at once (it released the NIXL request, which
    does not stop UCX's READ), and the bytes landed once the peer resumed."""
    victim = peers("victim", 31)
    t = _transport({"timeout_s": 600.0})  # the deadline plays no part here
    buf = np.zeros(N, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(victim.name, victim.descriptor)
        h = _read(t, victim, buf, 0, 4096)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        stop(victim.pid)
        buf[:] = SENTINEL
        h = _read(t, victim, buf, 0, N)
        assert t.poll(h).status is XferStatus.PENDING
        t0 = time.monotonic()
        t.disconnect(victim.name)
        assert _until(lambda: t.poll(h).status is not XferStatus.PENDING, TIMEOUT)
        state = t.poll(h)
        observed(f"READ after disconnect: {state.status.value} after "
                 f"{time.monotonic() - t0:.2f}s: {state.reason}")
        assert state.status is XferStatus.FAILED and victim.name in state.reason, state
        os.kill(victim.pid, signal.SIGCONT)
        assert _untouched_while(buf, t, QUIET), "bytes of a FAILED READ landed"
        observed(f"peer resumed: destination unchanged for {QUIET:.0f}s")
        t.release(h)
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 0}
    finally:
        t.close()



@pytest.mark.fault("release() of a READ still in flight from a SIGSTOPped peer (UCX tcp), then "
                   "disconnect(); the peer resumes after")
def test_a_read_released_in_flight_is_torn_down_by_disconnect_and_nothing_lands(
    peers: Callable[..., Peer], observed: Callable[[str], None]
) -> None:
    """Releasing a handle does not stop NIXL's request (docs/nixl.md "Deadlines"), so the
    transport keeps a released READ that is still in flight until UCX ends it: a disconnect
    tears its peer down, and close finds nothing left. Old code: release handed the request
    to NIXL and forgot it; disconnect saw no transfer in flight, removed the peer's agent
    without a teardown, and the whole READ landed once the peer resumed."""
    victim = peers("victim", 61)
    t = _transport({"timeout_s": 600.0})  # the deadline plays no part here
    buf = np.zeros(N, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(victim.name, victim.descriptor)
        stop(victim.pid)
        buf[:] = SENTINEL
        h = _read(t, victim, buf, 0, N)
        assert t.poll(h).status is XferStatus.PENDING
        t.release(h)  # abandoned while in flight (the caller gave up on it)
        with pytest.raises(TransferError, match="released"):
            t.poll(h)
        t.disconnect(victim.name)
        os.kill(victim.pid, signal.SIGCONT)
        untouched = _untouched_while(buf, t, QUIET)
        observed(f"READ released in flight, then disconnect: destination "
                 f"{'unchanged' if untouched else 'written'} for {QUIET:.0f}s after the peer "
                 f"resumed ({int(np.count_nonzero(buf != SENTINEL))} bytes changed)")
        assert untouched, "bytes of a released READ landed after its peer was disconnected"
        t.release(h)  # released twice: nothing to do, and what UCX ended is forgotten
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 0}
    finally:
        t.close()


@pytest.mark.fault("a NIXL peer SIGSTOPped after handing over its descriptor, before connect "
                   "(UCX tcp, timeout_s=2); it resumes after connect failed")
def test_a_peer_hung_before_the_wire_up_fails_connect_and_connects_once_it_runs(
    peers: Callable[..., Peer], observed: Callable[[str], None]
) -> None:
    """UCX wires an endpoint up at its first operation; with the peer stopped as
    ``add_remote_agent`` dialled it, the deadline's teardown could not end that operation.
    Old code: connect returned, and the first READ stayed PENDING past timeout_s for as long as
    the peer was stopped (8 s of 8 in a probe), then landed. Now connect completes the wire-up
    (a small READ into a buffer of the transport's own) or fails the handshake."""
    victim = peers("victim", 51)
    t = _transport({"timeout_s": DEADLINE})
    buf = np.zeros(N, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        stop(victim.pid)
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="wire-up") as err:
            t.connect(victim.name, victim.descriptor)
        took = time.monotonic() - t0
        observed(f"connect to the stopped peer: HandshakeError after {took:.2f}s: {err.value}")
        assert took < 2 * DEADLINE, took
        assert victim.name in str(err.value) and f"timeout_s={DEADLINE:g}s" in str(err.value)
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 0}
        h = _read(t, victim, buf, 0, N)  # not connected: FAILED at once, nothing posted
        assert t.poll(h).status is XferStatus.FAILED
        t.release(h)

        os.kill(victim.pid, signal.SIGCONT)
        t.connect(victim.name, victim.descriptor)  # the same descriptor, once it runs
        h = _read(t, victim, buf, 0, N)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(buf, victim.reference())
        observed("resumed: connect with the same descriptor, its READ verified")
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 1}
    finally:
        t.close()
