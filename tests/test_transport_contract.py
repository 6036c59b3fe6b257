"""The transport contract (``kvlink/transport.py``, module docstring), checked against every
transport: tcp, nixl (real NIXL over UCX) and mooncake (real Transfer Engine, tcp protocol,
metadata P2PHANDSHAKE). A transport whose library does not import is skipped with the reason.

Each case runs two or three transport instances in this process: the libraries serve in-process
peers exactly as they serve other processes, and both sides' memory can be checked directly.
(tests/test_nixl_transport.py and tests/test_mooncake_transport.py cover peers in separate
processes, killed and hung.) Faults a real library cannot produce on demand — a NIXL request
NIXL cannot cancel, or one that errors while its sibling still runs — are injected with the
smallest fake that makes them, named in the test's docstring.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvlink.errors import ExtentOutOfBounds
from kvlink.transport import (
    Extents,
    Op,
    Region,
    Transport,
    TransportContext,
    XferState,
    XferStatus,
    create_transport,
    make_extents,
)

os.environ.setdefault("GLOG_minloglevel", "1")  # mooncake: no per-batch INFO lines

NAMES = ["tcp", "nixl", "mooncake"]
OPTIONS: dict[str, dict[str, Any]] = {"tcp": {}, "nixl": {"ucx_probe": False}, "mooncake": {}}
LIBRARY = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}
SIZE = 16 << 20
TIMEOUT = 30.0


def _require(name: str) -> None:
    module = LIBRARY.get(name)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        why = f"{name}: {module} is not importable ({exc})"
        print(f"SKIP {why}")
        pytest.skip(why)


class Node:
    """One transport with one registered buffer of random bytes."""

    def __init__(self, kind: str, seed: int) -> None:
        ctx = TransportContext(agent_name=f"{kind}-{seed}-{uuid.uuid4().hex[:8]}")
        self.t: Transport = create_transport(kind, ctx, OPTIONS[kind])
        self.buf = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
        self.t.register([Region(self.buf.ctypes.data, self.buf.nbytes)])

    @property
    def name(self) -> str:
        return self.t.ctx.agent_name

    def ext(self, off: int, n: int) -> Extents:
        return make_extents(self.buf.ctypes.data + off, n)


def link(a: Node, b: Node) -> None:
    a.t.connect(b.name, b.t.descriptor())
    b.t.connect(a.name, a.t.descriptor())


def wait_until(cond: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(1e-3)
    return True


@pytest.fixture(params=NAMES)
def make(request: pytest.FixtureRequest) -> Iterator[Callable[[], Node]]:
    kind: str = request.param
    _require(kind)
    nodes: list[Node] = []

    def new() -> Node:
        nodes.append(Node(kind, len(nodes) + 1))
        return nodes[-1]

    yield new
    for n in nodes:
        n.t.close()


def _failed(state: XferState, peer: str) -> None:
    assert state.status is XferStatus.FAILED, state
    assert peer in state.reason, state


# ------------------------------------------------------------------ every transport


def test_post_to_unknown_peer_gives_a_failed_handle(make: Callable[[], Node]) -> None:
    """Rule 2. Old code: nixl and mooncake raised TransferError (tcp already passed)."""
    a = make()
    h = a.t.post(Op.READ, "nobody", a.ext(0, 4096), make_extents(1 << 20, 4096))
    _failed(a.t.poll(h), "nobody")
    a.t.release(h)


def test_post_after_disconnect_or_close_gives_a_failed_handle(make: Callable[[], Node]) -> None:
    """Rule 2. Old code: nixl and mooncake raised (not connected; transport closed)."""
    a, b = make(), make()
    link(a, b)
    h = a.t.post(Op.READ, b.name, a.ext(0, 4096), b.ext(0, 4096))
    assert a.t.wait(h, TIMEOUT).status is XferStatus.DONE
    a.t.release(h)
    a.t.disconnect(b.name)
    h = a.t.post(Op.READ, b.name, a.ext(0, 4096), b.ext(0, 4096))
    _failed(a.t.wait(h, TIMEOUT), b.name)
    a.t.release(h)
    a.t.close()
    h = a.t.post(Op.WRITE, b.name, a.ext(0, 4096), b.ext(0, 4096))
    _failed(a.t.wait(h, TIMEOUT), b.name)


def test_caller_bugs_raise_before_anything_moves(make: Callable[[], Node]) -> None:
    """Rule 2's exception: extents outside our memory or outside the peer's offer, or arrays
    that do not pair up, raise ExtentOutOfBounds. Old code: tcp failed the handle instead for
    a remote extent outside the peer's offer."""
    a, b = make(), make()
    link(a, b)
    before = b.buf.copy()
    cases = [
        (a.ext(SIZE - 100, 4096), b.ext(0, 4096)),  # local: past our region
        (a.ext(0, 4096), b.ext(SIZE - 100, 4096)),  # remote: past the peer's offer
        (a.ext(0, 4096), a.ext(4096, 4096)),  # remote: our own address, never offered
        (a.ext(0, 4096), b.ext(0, 4095)),  # lengths differ
    ]
    for op in (Op.WRITE, Op.READ):
        for lo, ro in cases:
            with pytest.raises(ExtentOutOfBounds):
                a.t.post(op, b.name, lo, ro)
    assert np.array_equal(b.buf, before)
    assert a.t.stats.transfers == 0


def test_disconnect_fails_only_that_peers_transfers_once_quiescent(
    make: Callable[[], Node],
) -> None:
    """Rules 1 and 3 with the real library: B's big READ is cut by disconnect(B) (or has
    finished); if FAILED, our destination bytes never change afterwards. C's READ, posted
    alongside, finishes DONE with the right bytes. (The uncancellable-request case, which the
    old nixl code got wrong, is test_nixl_disconnect_waits_for_a_request_nixl_cannot_cancel.)"""
    a, b, c = make(), make(), make()
    link(a, b)
    link(a, c)
    half = SIZE // 2
    hb = a.t.post(Op.READ, b.name, a.ext(0, half), b.ext(0, half))
    hc = a.t.post(Op.READ, c.name, a.ext(half, half), c.ext(half, half))
    a.t.disconnect(b.name)
    assert wait_until(lambda: a.t.poll(hb).status is not XferStatus.PENDING)
    sb = a.t.poll(hb)
    snapshot = a.buf[:half].copy()
    assert a.t.wait(hc, TIMEOUT).status is XferStatus.DONE
    assert np.array_equal(a.buf[half:], c.buf[half:])
    if sb.status is XferStatus.FAILED:
        assert b.name in sb.reason, sb
    else:
        assert np.array_equal(a.buf[:half], b.buf[:half])
    # more traffic with C (its progress would deliver anything of B's still queued): no change
    more = a.t.post(Op.WRITE, c.name, a.ext(half, 4096), c.ext(0, 4096))
    assert a.t.wait(more, TIMEOUT).status is XferStatus.DONE
    assert np.array_equal(a.buf[:half], snapshot)
    for h in (hb, hc, more):
        a.t.release(h)


def test_close_is_bounded_and_leaves_no_threads(make: Callable[[], Node]) -> None:
    """Rule 4: close() returns within 2 s and no thread of the transport is left; tcp's port
    refuses connections. Old code: tcp left its accept thread blocked in accept() and the port
    accepting."""
    before = set(threading.enumerate())
    a, b = make(), make()
    link(a, b)
    h = b.t.post(Op.READ, a.name, b.ext(0, 1 << 20), a.ext(0, 1 << 20))
    assert b.t.wait(h, TIMEOUT).status is XferStatus.DONE
    b.t.release(h)
    port = getattr(a.t, "port", None)
    for n in (a, b):
        t0 = time.monotonic()
        n.t.close()
        assert time.monotonic() - t0 < 2.0
        n.t.close()  # idempotent
    left = [th.name for th in set(threading.enumerate()) - before if th.is_alive()]
    assert not left, left
    if port is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ------------------------------------------------------------------ tcp only


@pytest.fixture()
def tcp() -> Iterator[Callable[[], Node]]:
    nodes: list[Node] = []

    def new() -> Node:
        nodes.append(Node("tcp", len(nodes) + 1))
        return nodes[-1]

    yield new
    for n in nodes:
        n.t.close()


def test_tcp_peer_connected_before_close_cannot_read_after(tcp: Callable[[], Node]) -> None:
    """Rule 4: after the owner's close, a peer that had handshaken and read fails every READ.
    Old code: its first READ failed (connection shut down), the next reconnected to the port
    the blocked accept thread still served, and read the closed transport's memory."""
    a, b = tcp(), tcp()
    link(a, b)
    h = b.t.post(Op.READ, a.name, b.ext(0, 4096), a.ext(0, 4096))
    assert b.t.wait(h, TIMEOUT).status is XferStatus.DONE
    b.t.release(h)
    a.t.close()
    b.buf[:] = 0
    for _ in range(3):
        h = b.t.post(Op.READ, a.name, b.ext(0, 4096), a.ext(0, 4096))
        _failed(b.t.wait(h, TIMEOUT), a.name)
        b.t.release(h)
    assert not b.buf.any()


def test_tcp_fence_revokes_a_peers_writes_until_it_reconnects(tcp: Callable[[], Node]) -> None:
    """Rule 5: once ``fence(peer)`` returns True no byte of that peer's WRITEs lands — neither
    of one in flight at the fence nor of later ones — until connect() names it again. Old
    code: no fence (the base class had none)."""
    a, b = tcp(), tcp()
    link(a, b)
    h = b.t.post(Op.WRITE, a.name, b.ext(0, 4096), a.ext(0, 4096))  # opens b's connection
    assert b.t.wait(h, TIMEOUT).status is XferStatus.DONE
    b.t.release(h)
    big = b.t.post(Op.WRITE, a.name, b.ext(0, SIZE), a.ext(0, SIZE))  # in flight at the fence
    assert a.t.fence(b.name, 5.0) is True
    fenced = a.buf.copy()
    b.buf[:] = 0  # what a later landing byte would carry
    assert b.t.wait(big, TIMEOUT).status in (XferStatus.DONE, XferStatus.FAILED)
    b.t.release(big)
    for _ in range(2):  # on the broken connection, then on a new one: both refused
        h = b.t.post(Op.WRITE, a.name, b.ext(0, 4096), a.ext(0, 4096))
        _failed(b.t.wait(h, TIMEOUT), a.name)
        b.t.release(h)
    assert np.array_equal(a.buf, fenced)
    a.t.connect(b.name, b.t.descriptor())  # a new handshake re-admits it
    h = b.t.post(Op.WRITE, a.name, b.ext(0, 4096), a.ext(0, 4096))
    assert b.t.wait(h, TIMEOUT).status is XferStatus.DONE
    assert not a.buf[:4096].any()


def test_fence_default_cannot_guarantee() -> None:
    """Rule 5: a transport without a fence says so (False), it does not pretend."""
    _require("mooncake")
    n = Node("mooncake", 1)
    try:
        assert n.t.fence("anyone", 0.1) is False
    finally:
        n.t.close()


# ------------------------------------------------------------------ nixl: injected faults


class _Req:
    """A NIXL request seen through :class:`_FakeAgent`."""

    def __init__(self, agent: _FakeAgent, real: Any, mode: str) -> None:
        self.agent, self.real, self.mode = agent, real, mode

    def release(self) -> None:
        if self.mode == "stuck" and not self.agent.let_go:
            raise RuntimeError("injected: NIXL cannot cancel this active request")
        self.real.release()


class _FakeAgent:
    """The real NIXL agent, except for the faults named in ``modes`` (one per request made,
    in order; missing = "real"): "stuck" reports PROC and refuses release (NIXL could not
    cancel it) until ``let_go``; "err" reports ERR. ``vram_as_dram`` posts descriptor lists
    named VRAM as DRAM, so a region the test relabels as VRAM still moves real bytes."""

    def __init__(self, real: Any, modes: list[str], vram_as_dram: bool = False) -> None:
        self.real, self.modes, self.vram_as_dram = real, list(modes), vram_as_dram
        self.let_go = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str, *a: Any, **k: Any) -> Any:
        if self.vram_as_dram and mem == "VRAM":
            mem = "DRAM"
        return self.real.prep_xfer_dlist(agent, descs, mem, *a, **k)

    def make_prepped_xfer(self, *a: Any, **k: Any) -> _Req:
        mode = self.modes.pop(0) if self.modes else "real"
        return _Req(self, self.real.make_prepped_xfer(*a, **k), mode)

    def transfer(self, req: _Req) -> str:
        return str(self.real.transfer(req.real))

    def check_xfer_state(self, req: _Req) -> str:
        if req.mode == "err":
            return "ERR"
        if req.mode == "stuck" and not self.let_go:
            return "PROC"  # without asking NIXL: whatever the real request did, it "runs"
        return str(self.real.check_xfer_state(req.real))

    def get_xfer_telemetry(self, req: _Req) -> Any:
        return self.real.get_xfer_telemetry(req.real)


@pytest.fixture()
def nixl() -> Iterator[Callable[[], Node]]:
    _require("nixl")
    nodes: list[Node] = []

    def new() -> Node:
        nodes.append(Node("nixl", len(nodes) + 1))
        return nodes[-1]

    yield new
    for n in nodes:
        fake = getattr(n.t, "_agent", None)
        if isinstance(fake, _FakeAgent):
            fake.let_go = True
        n.t.close()


def _split_peer(a: Node, b: Node) -> None:
    """Make a's post to ``b`` two NIXL requests: b's buffer is offered as two regions and a
    relabels the second as VRAM (a DRAM->DRAM and a DRAM->VRAM part)."""
    t: Any = a.t
    side = t._peers[b.name].side
    assert len(side.mem) == 1
    from kvlink_transports.nixl.memory import _Side

    half = SIZE // 2
    base = b.buf.ctypes.data
    two = _Side([Region(base, half), Region(base + half, half, "cuda:0")])  # (labelled VRAM)
    assert two.one_kind is None and two.has_vram
    t._peers[b.name].side = two


def test_nixl_error_in_one_part_waits_for_the_other(nixl: Callable[[], Node]) -> None:
    """Rule 1. Injected (``_FakeAgent``): of a two-request transfer, request 0 reports ERR
    while request 1 reports PROC and NIXL cannot cancel it. The handle stays PENDING until
    request 1 is over, then reports request 0's error. Old code: FAILED at once, request 1
    sent to the zombies while it still moved bytes."""
    a, b = nixl(), nixl()
    link(a, b)
    _split_peer(a, b)
    t: Any = a.t
    fake = _FakeAgent(t._agent, ["err", "stuck"], vram_as_dram=True)
    t._agent = fake
    half = SIZE // 2
    lo = make_extents([a.buf.ctypes.data, a.buf.ctypes.data + half], 4096)
    ro = make_extents([b.buf.ctypes.data, b.buf.ctypes.data + half], 4096)
    h = t.post(Op.READ, b.name, lo, ro)
    assert len(t._xfers[h].reqs) == 2
    for _ in range(3):
        assert t.poll(h).status is XferStatus.PENDING
    fake.let_go = True
    state = t.wait(h, TIMEOUT)
    assert state.status is XferStatus.FAILED and "NIXL returned ERR" in state.reason, state
    t.release(h)
    assert t._handle_counts()["zombies"] == 0 and t._handle_counts()["nixl_requests"] == 0


def test_nixl_failed_second_post_waits_for_the_first(nixl: Callable[[], Node]) -> None:
    """Rule 1. The second request of a split transfer fails at post for real (NIXL finds no
    VRAM registration for a region relabelled VRAM); injected (``_FakeAgent``): the first,
    already posted, reports PROC and cannot be cancelled. The handle stays PENDING until the
    first is over, then reports the post error. Old code: FAILED at once, the first request to
    the zombies."""
    a, b = nixl(), nixl()
    link(a, b)
    _split_peer(a, b)
    t: Any = a.t
    fake = _FakeAgent(t._agent, ["stuck"])
    t._agent = fake
    half = SIZE // 2
    lo = make_extents([a.buf.ctypes.data, a.buf.ctypes.data + half], 4096)
    ro = make_extents([b.buf.ctypes.data, b.buf.ctypes.data + half], 4096)
    h = t.post(Op.WRITE, b.name, lo, ro)
    assert t.poll(h).status is XferStatus.PENDING
    fake.let_go = True
    state = t.wait(h, TIMEOUT)
    assert state.status is XferStatus.FAILED and "failed at post" in state.reason, state
    t.release(h)
    assert t._handle_counts()["zombies"] == 0


def test_nixl_disconnect_waits_for_a_request_nixl_cannot_cancel(
    nixl: Callable[[], Node],
) -> None:
    """Rules 1 and 3. Injected (``_FakeAgent``): the READ from B reports PROC and NIXL cannot
    cancel it. disconnect(B) leaves it PENDING (it may still move bytes) until it is over, then
    FAILED naming B; C's READ completes DONE with the right bytes meanwhile. Old code: FAILED
    at disconnect, the request to the zombies."""
    a, b, c = nixl(), nixl(), nixl()
    link(a, b)
    link(a, c)
    t: Any = a.t
    fake = _FakeAgent(t._agent, ["stuck"])
    t._agent = fake
    half = SIZE // 2
    hb = t.post(Op.READ, b.name, a.ext(0, half), b.ext(0, half))
    hc = t.post(Op.READ, c.name, a.ext(half, half), c.ext(half, half))
    t.disconnect(b.name)
    assert t.poll(hb).status is XferStatus.PENDING
    assert t.wait(hc, TIMEOUT).status is XferStatus.DONE
    assert np.array_equal(a.buf[half:], c.buf[half:])
    assert t.poll(hb).status is XferStatus.PENDING
    fake.let_go = True
    _failed(t.wait(hb, TIMEOUT), b.name)
    for h in (hb, hc):
        t.release(h)
    assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 1}
