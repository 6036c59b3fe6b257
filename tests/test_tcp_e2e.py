"""Two real processes over 127.0.0.1: the tcp transport, the worker and the demo end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_transport_contract import wait_until as until

import kvlink_transports.tcp.server as tcp_server  # the owner's side: sends the answers
from kvlink import native, wire
from kvlink.demo import data
from kvlink.demo.roles import DemoPlan
from kvlink.demo.run import Serving, free_port_range, run_demo
from kvlink.errors import BlockIdOutOfRange, ConfigError, LayoutError, TransportUnavailable
from kvlink.layout import KVCacheSpec
from kvlink.transport import Op, Region, TransportContext, XferState, XferStatus, make_extents
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig
from kvlink_transports.tcp import TcpTransport
from kvlink_transports.tcp.wire import _VERSION, _Descriptor, _enc, _frame, _Hdr, _recv_hdr

SMALL = data.Geometry(layers=4, kv_heads=4, head_dim=32, block_size=16)


def small_plan(**kw: object) -> DemoPlan:
    base = DemoPlan(geo=SMALL, requests=4, tokens=128, port=free_port_range(4),
                    cache_bytes=64 << 20, timeout=20.0)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def consumer(plan: DemoPlan, **cfg: object) -> tuple[KVWorker, list[object]]:
    _buf, layers = data.allocate(plan.geo, plan.slots(1) * plan.blocks_per_request, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="decode", serve=False, **cfg))  # type: ignore[arg-type]
    w.register(data.spec_of(plan.geo, layers, 1, 0))
    w._keepalive = _buf  # type: ignore[attr-defined]
    return w, layers


def wait_request(w: KVWorker, req: str, timeout: float) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = w.poll()
        if req in done:
            return True, ""
        if req in failed:
            return False, failed[req]
        time.sleep(0.001)
    raise AssertionError(f"{req} neither finished nor failed within {timeout}s")


def test_demo_pull_verified_and_leases_released() -> None:
    res = run_demo(small_plan(), show_progress=False)
    assert res["verified"], res["failed"]
    assert res["bytes"] == 4 * 8 * SMALL.block_bytes(1)
    assert res["descriptors"] < res["raw_descriptors"]
    assert res["leaks"] == 0


@pytest.mark.parametrize("ptp,dtp", [(2, 4), (4, 2), (8, 2)])  # 8 -> 2: replicated heads
def test_demo_heterogeneous_tp(ptp: int, dtp: int) -> None:
    res = run_demo(small_plan(prefill_tp=ptp, decode_tp=dtp, requests=2), show_progress=False)
    assert res["verified"], res["failed"]
    assert res["leaks"] == 0


def test_cli_demo_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvlink.cli", "demo", "--layers", "2", "--requests", "2",
         "--tokens", "64", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["verified"] is True and doc["transport"] == "tcp"
    assert doc["bytes"] > 0 and doc["seconds"] > 0 and doc["gbps"] > 0
    assert "descriptors after coalescing" in proc.stdout


def test_cli_unknown_transport_lists_registered() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvlink.cli", "demo", "--transport", "warp"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown transport 'warp'" in proc.stderr and "tcp" in proc.stderr


def test_unknown_transport_in_worker_config() -> None:
    w = KVWorker(WorkerConfig(engine_id="x", transports=["warp"], serve=False))
    arr = np.zeros((2, 4, 16, 1, 8), dtype=np.uint16)
    from kvlink.layout import KVCacheSpec

    with pytest.raises(TransportUnavailable, match=r"unknown transport 'warp'; registered: .*tcp"):
        w.register(KVCacheSpec.from_arrays([arr]))


@pytest.mark.fault("side channel unreachable (nothing listening)")
def test_unreachable_side_channel_fails_request_quickly(observed: Callable[[str], None]) -> None:
    plan = small_plan()
    w, _ = consumer(plan, handshake_timeout=0.5)
    try:
        port = free_port_range(1)
        t0 = time.monotonic()
        w.read("r0", RemoteEngine("prefill", "127.0.0.1", port), [0], [0])
        ok, reason = wait_request(w, "r0", 10)
        observed(f"request failed after {time.monotonic() - t0:.1f}s: {reason}")
        assert not ok and time.monotonic() - t0 < 5
        assert f"127.0.0.1:{port}" in reason and "0.5s" in reason
    finally:
        w.close()


@pytest.mark.fault("decode geometry differs from prefill (head_dim 16 vs 32)")
def test_geometry_mismatch_named_at_handshake(observed: Callable[[str], None]) -> None:
    plan = small_plan(requests=1)
    serving = Serving(plan)
    other = dataclasses.replace(plan, geo=dataclasses.replace(SMALL, head_dim=16))
    w, _ = consumer(other)
    try:
        serving.wait_ready(120)
        w.read("r0", RemoteEngine("prefill", "127.0.0.1", plan.port), [0], [0])
        ok, reason = wait_request(w, "r0", 20)
        observed(reason)
        assert not ok
        assert "head_dim: local=16 remote=32" in reason
    finally:
        w.close()
        serving.close()


def test_a_cache_holding_other_heads_than_its_total_gives_is_refused_at_register() -> None:
    """TP 2 of 4 KV heads: a spec whose total_kv_heads was left 0 (taken as the rank's own 2)
    is a LayoutError at register() naming both counts; told the total, a TP 2 -> TP 2 READ
    lands every head of every page. Before: the head map gave each rank 2 // 2 = 1 head,
    the READ moved the first head of every page, reported done, and the second stayed
    stale."""
    geo, ids = SMALL, np.array([3, 1, 7], dtype=np.int64)  # 4 heads: 2 a rank at TP 2
    caches = {(side, r): data.allocate(geo, 8, 2, r) for side in "pd" for r in range(2)}
    workers: list[KVWorker] = []
    try:
        for r in range(2):
            w = KVWorker(WorkerConfig(engine_id="bare", tp_rank=r, tp_size=2))
            workers.append(w)
            bare = KVCacheSpec.from_arrays(caches["p", r][1], dtype=geo.dtype)  # total left 0
            with pytest.raises(LayoutError, match=rf"holds 2 kv head\(s\) per page, but "
                               rf"total_kv_heads=2 over tp_size=2 gives rank {r} 1"):
                w.register(bare)
            assert w.spec is None and not w.transports
        port = free_port_range(2)
        prods = [KVWorker(WorkerConfig(engine_id="p", tp_rank=r, tp_size=2, side_port=port))
                 for r in range(2)]
        workers += prods
        gen = 1 + int(np.random.default_rng().integers(1 << 40))
        for r, w in enumerate(prods):
            data.fill(geo, caches["p", r][1], 2, r)
            w.register(data.spec_of(geo, caches["p", r][1], 2, r))
            w.hold("a", ids, generation=gen)
        cons = [KVWorker(WorkerConfig(engine_id="c", tp_rank=r, tp_size=2, serve=False))
                for r in range(2)]
        workers += cons
        for r, w in enumerate(cons):
            w.register(data.spec_of(geo, caches["d", r][1], 2, r))
            w.read("a", RemoteEngine("p", "127.0.0.1", port, 2), ids[::-1].copy(), ids,
                   generation=gen)
        for r, w in enumerate(cons):
            ok, why = _outcome(w, prods[r], "a")
            assert ok, why
            assert data.verify(geo, caches["d", r][1], 2, r, ids[::-1].copy(), ids) == 0
    finally:
        for w in workers:
            w.close()


@pytest.mark.fault("block ids out of range (local and remote)")
def test_block_ids_bounds_checked_before_posting(observed: Callable[[str], None]) -> None:
    plan = small_plan(requests=1)
    serving = Serving(plan)
    w, _ = consumer(plan)
    try:
        serving.wait_ready(120)
        remote = RemoteEngine("prefill", "127.0.0.1", plan.port)
        with pytest.raises(BlockIdOutOfRange, match="local block id 10000"):
            w.read("bad-local", remote, [10000], [0])
        w.read("req-0", remote, [0], [123456])  # a held request, but a block it cannot have
        ok, reason = wait_request(w, "req-0", 20)
        observed(f"local: BlockIdOutOfRange raised at read(); remote: {reason}; "
                 "transfers posted: 0")
        # refused by the producer: the request holds no such block (item 14 of issue 18)
        assert not ok and "blocks [123456] are not among the" in reason, reason
        assert w.transports["tcp"].stats.transfers == 0  # nothing was posted
    finally:
        w.close()
        serving.close()


def _worker(engine: str) -> tuple[KVWorker, Any]:
    buf, layers = data.allocate(SMALL, 16, 1, 0)
    w = KVWorker(WorkerConfig(engine_id=engine))
    w.register(data.spec_of(SMALL, layers, 1, 0))
    return w, (buf, layers)


def _outcome(cons: KVWorker, prod: KVWorker, rid: str, timeout: float = 10.0
             ) -> tuple[bool, str]:
    """Poll both workers (one process) until ``cons`` reports ``rid``: (finished, why not)."""
    done: set[str] = set()
    failed: dict[str, str] = {}

    def reported() -> bool:
        prod.poll()
        got, bad = cons.poll()
        done.update(got)
        failed.update(bad)
        return rid in done or rid in failed

    assert until(reported, timeout), f"{rid} was never reported"
    return rid in done, failed.get(rid, "")


@pytest.mark.parametrize("bad", [[-1, 4], [2**31, 4], [1.7, 4.2]],
                         ids=["negative", "past-the-wire", "float"])
def test_remote_ids_the_wire_cannot_carry_are_refused_at_read(bad: list[Any]) -> None:
    """Refused at read(), naming the id (or its type), nothing sent. Before: a float was
    truncated (block 1 read for 1.7); a negative id failed at poll, and the report of that
    failure, carrying it, broke the producer's frame — another request's intent in it failed
    ("bad_message") and the hold stayed until its lease."""
    prod, keep_p = _worker("p")
    cons, keep_c = _worker("c")
    try:
        remote = RemoteEngine("p", "127.0.0.1", prod.side_port)
        prod.hold("a", [1, 2])
        gen = prod.hold("b", [3, 4])
        cons.read("a", remote, [5, 6], [1, 2])  # (an intent: the same frame as b's report)
        with pytest.raises(BlockIdOutOfRange, match=r"remote block id|must be integers"):
            cons.read("b", remote, [7, 8], bad, generation=gen)
        assert _outcome(cons, prod, "a") == (True, "")
    finally:
        cons.close()
        prod.close()
    del keep_p, keep_c


def test_hold_and_read_arguments_are_typed_errors_at_the_call() -> None:
    """A caller's bad value is a ConfigError naming it, at the call. Before: readers="2" was
    taken, and every reader's report then failed on the producer's side-channel thread
    (TypeError), the hold staying until its lease; a duplicate hold, generation 0 or "5"
    were a ValueError or a TypeError."""
    prod, keep = _worker("p")
    try:
        for readers in ("2", 0, -3, True, 1.5):
            with pytest.raises(ConfigError, match=r"readers must be None .* got"):
                prod.hold("a", [1, 2], readers=readers)  # type: ignore[arg-type]
        for generation in (0, -1, 2**63, "5", 7.0):
            with pytest.raises(ConfigError, match=r"generation must be a positive 63-bit"):
                prod.hold("a", [1, 2], generation=generation)  # type: ignore[arg-type]
        assert prod.hold("n", [4], readers=np.int64(1), generation=np.int64(77)) == 77
        prod.hold("a", [1, 2], readers=1)
        with pytest.raises(ConfigError, match=r"request 'a' already holds blocks"):
            prod.hold("a", [3])
        remote = RemoteEngine("p", "127.0.0.1", prod.side_port)
        with pytest.raises(ConfigError, match=r"generation must be a positive 63-bit"):
            prod.read("r", remote, [1], [1], generation="5")  # type: ignore[arg-type]
    finally:
        prod.close()
    del keep


def test_register_once_and_a_failed_one_leaves_nothing_open() -> None:
    """A second register() is a ConfigError (it opened a second data plane and side
    channel, the first pair left running past close()); a register() that fails (here: an
    unauthenticated side channel on every interface) closes what it had opened."""
    before = {t.name for t in threading.enumerate()}
    buf, layers = data.allocate(SMALL, 16, 1, 0)
    spec = data.spec_of(SMALL, layers, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="open", host="0.0.0.0"))
    with pytest.raises(ConfigError, match="refusing to bind an unauthenticated side channel"):
        w.register(spec)
    assert {t.name for t in threading.enumerate()} <= before
    assert not w.transports and w.spec is None
    w.close()
    ok = KVWorker(WorkerConfig(engine_id="once"))
    try:
        ok.register(spec)
        port = ok.side_port
        with pytest.raises(ConfigError, match="registered its cache already"):
            ok.register(spec)
        assert ok.side_port == port and list(ok.transports) == ["tcp"]
    finally:
        ok.close()
    del buf


def test_a_closed_worker_reports_what_was_in_flight_and_takes_nothing_new() -> None:
    """After close(): the READ in flight (its producer never answers its handshake) is
    reported failed by the next poll, nothing is pending, and read()/hold()/register() are
    ConfigErrors. Before: read() raised a bare RuntimeError from a thread pool, hold() took
    blocks, and the READ stayed pending (a caller draining until nothing was pending spun)."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()  # accepts (in the backlog), never answers
    w, keep = _worker("closing")
    try:
        remote = RemoteEngine("mute", "127.0.0.1", mute.getsockname()[1])
        w.read("r", remote, [1], [1])
        assert w.pending() == 1
        w.close()
        assert w.poll() == (set(), {"r": "the worker was closed with it in flight"})
        assert w.poll() == (set(), {}) and w.pending() == 0
        for call in (lambda: w.read("s", remote, [1], [1]), lambda: w.hold("h", [1]),
                     lambda: w.register(w.spec)):  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="this worker is closed"):
                call()
    finally:
        w.close()
        mute.close()
    del keep


def test_a_push_with_wrong_local_ids_can_be_pushed_again() -> None:
    """push() with the caller's ids wrong (too few, out of range) raises naming them and
    leaves the push to be written: the corrected call lands it. Before, the first call used
    the push up — the retry was refused as "already taken (failed)" and the decode, never
    told, waited out its timeout."""
    buf, layers = data.allocate(SMALL, 16, 1, 0)
    prod = KVWorker(WorkerConfig(engine_id="p", serve_pushes=True, grants=False))
    prod.register(data.spec_of(SMALL, layers, 1, 0))
    cons, keep = _worker("c")
    try:
        cons.expect_push("e", RemoteEngine("p", "127.0.0.1", prod.side_port), [3, 4],
                         timeout=10)
        assert until(lambda: (cons.poll(), prod.poll(), prod.queued_pushes())[2] > 0, 10), \
            "the push request never came"
        (msg,) = prod.push_requests()
        with pytest.raises(ConfigError, match="1 local block ids for the decode's 2"):
            prod.push(msg, [1])
        with pytest.raises(BlockIdOutOfRange, match="local block id 99"):
            prod.push(msg, [1, 99])
        prod.push(msg, [1, 2])
        assert _outcome(cons, prod, "e") == (True, "")
    finally:
        cons.close()
        prod.close()
    del buf, keep


@pytest.mark.parametrize("args,named", [
    (("p", "127.0.0.1", "41377"), "port must be an integer"),
    (("p", "127.0.0.1", 70000), "port must be an integer 1..65535"),
    (("p", "127.0.0.1", 65535, 2), "port must be an integer 1..65534"),
    (("p", "127.0.0.1", 5600, 0), "tp_size must be an integer"),
    (("p", "", 5600), "host must be a name or an address"),
    ((None, "127.0.0.1", 5600), "remote engine id must be a non-empty string"),
])
def test_a_remote_engine_is_checked_when_made(args: tuple[Any, ...], named: str) -> None:
    """A ConfigError naming the field where the RemoteEngine is made (before: a TypeError
    deep in a handshake, or a READ that failed 10 s later as "nobody listens there")."""
    with pytest.raises(ConfigError, match=named):
        RemoteEngine(*args)


def test_a_remote_named_with_another_tp_size_fails_naming_both() -> None:
    """A producer of one TP rank named with tp_size 2: the handshake says so (before: the
    READ failed on a grant refusal and a side channel that never answered)."""
    prod, keep_p = _worker("p")
    buf, layers = data.allocate(SMALL, 16, 1, 0)
    cons = KVWorker(WorkerConfig(engine_id="c", handshake_timeout=1.0))
    cons.register(data.spec_of(SMALL, layers, 1, 0))
    try:
        gen = prod.hold("a", [1, 2])
        cons.read("a", RemoteEngine("p", "127.0.0.1", prod.side_port, 2), [5, 6], [1, 2],
                  generation=gen)
        ok, why = _outcome(cons, prod, "a")
        assert not ok and "runs 1 TP rank(s), but it was named with tp_size 2" in why, why
    finally:
        cons.close()
        prod.close()
    del keep_p, buf


def test_a_transport_name_nothing_registered_is_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """A typo in ``transports`` beside a name that works is said at WARNING (a library
    missing on this host stays at INFO); before, both were INFO lines."""
    buf, layers = data.allocate(SMALL, 16, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="typo", transports=["tpc", "tcp"]))
    try:
        with caplog.at_level(logging.WARNING, logger="kvlink"):
            w.register(data.spec_of(SMALL, layers, 1, 0))
        assert list(w.transports) == ["tcp"]
        assert any("unknown transport 'tpc'" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING), caplog.text
    finally:
        w.close()
    del buf


def test_an_unexpected_error_under_a_transfer_fails_it_and_the_next_one_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the peer's thread did not expect (injected: a fake _transfer raising once,
    standing in for a bug, which the real code cannot be made to show on demand) fails that
    transfer naming it, and the next one moves. Before, it ended the peer's thread: that
    transfer and every later one to the peer stayed PENDING past timeout_s."""
    import kvlink_transports.tcp.client as tcp_client

    real = tcp_client._Peer._transfer
    calls = {"n": 0}

    def once_broken(self: Any, sock: Any, x: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ZeroDivisionError("injected")
        real(self, sock, x)

    monkeypatch.setattr(tcp_client._Peer, "_transfer", once_broken)
    opts = {"timeout_s": 2.0}
    a = TcpTransport(TransportContext(agent_name="bug-a", require_grants=False), opts)
    b = TcpTransport(TransportContext(agent_name="bug-b", require_grants=False), opts)
    n = 1 << 16
    dst, src = np.zeros(n, np.uint8), np.arange(n, dtype=np.uint8)
    try:
        a.register([Region(dst.ctypes.data, n)])
        b.register([Region(src.ctypes.data, n)])
        a.connect("bug-b", b.descriptor())
        ext = (make_extents(dst.ctypes.data, n), make_extents(src.ctypes.data, n))
        first = a.wait(a.post(Op.READ, "bug-b", *ext), 10)
        assert first.status is XferStatus.FAILED and "injected" in first.reason, first
        second = a.wait(a.post(Op.READ, "bug-b", *ext), 10)
        assert second.status is XferStatus.DONE, second
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


@pytest.mark.fault("prefill killed mid-READ (256 MiB in flight)")
def test_producer_killed_mid_transfer_fails_within_timeout(observed: Callable[[str], None]) -> None:
    geo = data.Geometry(layers=8, kv_heads=8, head_dim=128, block_size=16)
    plan = DemoPlan(geo=geo, requests=1, tokens=8192, port=free_port_range(1),
                    cache_bytes=512 << 20, timeout=20.0)
    serving = Serving(plan)
    w, layers = consumer(plan, transport_options={"tcp": {"timeout_s": 8.0}})
    try:
        serving.wait_ready(120)
        first = int(plan.decode_blocks(0)[0])
        w.read("req-0", RemoteEngine("prefill", "127.0.0.1", plan.port),
               plan.decode_blocks(0), plan.prefill_blocks(0))
        k_plane = np.asarray(layers[0])[0]
        deadline = time.monotonic() + 30
        while not k_plane[first].any():  # the first bytes have landed: the READ is mid-flight
            w.poll()
            assert time.monotonic() < deadline, "READ never started"
        serving.procs[0].kill()
        t0 = time.monotonic()
        ok, reason = wait_request(w, "req-0", 15)
        observed(f"READ FAILED after {time.monotonic() - t0:.2f}s: {reason}")
        if ok:
            pytest.skip("the 256 MiB READ finished before the kill landed; nothing to test")
        assert time.monotonic() - t0 < 9
        assert "connection lost" in reason or "closed by peer" in reason, reason
    finally:
        w.close()
        serving.close()


def _transport(name: str) -> tuple[TcpTransport, np.ndarray]:
    buf = np.arange(1 << 16, dtype=np.uint8)
    t = TcpTransport(TransportContext(name))
    t.register([Region(int(buf.__array_interface__["data"][0]), buf.nbytes)])
    return t, buf


@contextlib.contextmanager
def _idle_connection() -> Iterator[tuple[TcpTransport, np.ndarray, np.ndarray,
                                         Callable[[int], XferState], Any]]:
    """Transports a and b, b connected to a by a first READ, b's thread for a back waiting for
    work on the open connection: (a, a's buffer, b's buffer, a READ by b of 4 KiB at an offset
    of a's buffer into its own, waited for, b's peer a)."""
    a, abuf = _transport("a")
    b, bbuf = _transport("b")
    try:
        b.connect("a", a.descriptor())
        abase = int(abuf.__array_interface__["data"][0])
        bbase = int(bbuf.__array_interface__["data"][0])

        def read(off: int) -> XferState:
            h = b.post(Op.READ, "a", make_extents([bbase + off], [4096]),
                       make_extents([abase + off], [4096]))
            st = b.wait(h, 10)
            b.release(h)
            return st

        assert read(0).status is XferStatus.DONE  # connects
        peer = b._peers["a"]
        with peer.cv:  # (the thread notifies as it goes back to waiting: in C where it parks)
            assert peer.cv.wait_for(lambda: peer.idle or peer.parked, timeout=10), \
                "the thread never went idle"
        yield a, abuf, bbuf, read, peer
    finally:
        a.close()
        b.close()


@pytest.mark.fault("peer requests memory it was never offered (forged descriptor)")
def test_server_refuses_ranges_it_never_offered(observed: Callable[[str], None]) -> None:
    """A client lying about the peer's regions still cannot read outside them: the server checks."""
    a, abuf = _transport("a")
    b, bbuf = _transport("b")
    try:
        base = int(abuf.__array_interface__["data"][0])
        import msgspec

        from kvlink_transports.tcp import _Descriptor

        real = msgspec.msgpack.decode(a.descriptor(), type=_Descriptor)
        forged = msgspec.msgpack.encode(_Descriptor(
            v=real.v, agent=real.agent, host=real.host, port=real.port,
            regions=[(base, abuf.nbytes * 4, "cpu")], token=real.token))
        b.connect("a", forged)
        bptr = int(bbuf.__array_interface__["data"][0])
        h = b.post(Op.READ, "a", make_extents([bptr], [4096]),
                   make_extents([base + abuf.nbytes], [4096]))
        st = b.wait(h, 10)
        assert st.status is XferStatus.FAILED and "outside" in st.reason
        observed(f"READ refused by the owner: {st.reason}")
        h = b.post(Op.WRITE, "a", make_extents([bptr], [4096]),
                   make_extents([base + abuf.nbytes - 100], [4096]))
        st = b.wait(h, 10)
        assert st.status is XferStatus.FAILED and "outside" in st.reason
        assert np.array_equal(abuf, np.arange(1 << 16, dtype=np.uint8))  # untouched
    finally:
        a.close()
        b.close()


def test_many_requests_in_flight_and_notifications() -> None:
    a, abuf = _transport("a")
    b, bbuf = _transport("b")
    try:
        b.connect("a", a.descriptor())
        a.connect("b", b.descriptor())
        abase = int(abuf.__array_interface__["data"][0])
        bbase = int(bbuf.__array_interface__["data"][0])
        rng = np.random.default_rng(0)
        handles = []
        for i in range(16):
            off = np.arange(16, dtype=np.uint64) * 256 + i * 4096
            perm = rng.permutation(16).astype(np.uint64) * 256 + i * 4096
            handles.append(b.post(Op.READ, "a", make_extents(bbase + off, 256),
                                  make_extents(abase + perm, 256), notify=f"n{i}".encode()))
        for h in handles:
            assert b.wait(h, 10).status is XferStatus.DONE
            b.release(h)
        assert b.inflight() == 0
        rng = np.random.default_rng(0)
        for i in range(16):
            perm = rng.permutation(16)
            src = abuf[i * 4096 : (i + 1) * 4096].reshape(16, 256)[perm]
            assert np.array_equal(bbuf[i * 4096 : (i + 1) * 4096].reshape(16, 256), src)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 16 and time.monotonic() < deadline:
            got += [m for _, m in a.notifications()]
        assert sorted(got) == sorted(f"n{i}".encode() for i in range(16))
    finally:
        a.close()
        b.close()



@pytest.mark.fault("the connection breaks while its thread is idle (a real socket, shut down)")
def test_a_read_the_caller_could_not_send_fails_and_the_next_reconnects(
        observed: Callable[[str], None]) -> None:
    """A READ posted while the peer's thread is parked sends its request header on the
    caller's thread, what the connection takes at once (tcp/client.py, _reader.c): here
    nothing, and the thread's send of the rest fails. The READ fails quiescent naming why —
    the thread never reads an answer off a half-written stream — and the next READ opens a
    new connection. The connection is broken for real: our socket's sending side shut down."""
    import socket as _socket

    with _idle_connection() as (_, abuf, bbuf, read, peer):
        assert peer.sock is not None
        peer.sock.shutdown(_socket.SHUT_WR)
        st = read(4096)
        assert st.status is XferStatus.FAILED and "peer a" in st.reason, st.reason
        if native.load() is not None:  # (in Python, the thread's own send is the first)
            assert "Broken pipe" in st.reason, st.reason
        observed(f"READ failed: {st.reason}")
        bbuf[8192:12288] = 0
        assert read(8192).status is XferStatus.DONE  # a new connection
        assert np.array_equal(bbuf[8192:12288], abuf[8192:12288])


@pytest.mark.parametrize("in_c", [False, True], ids=["reader_in_python", "reader_in_c"])
def test_reads_whose_requests_outgrow_the_connections_buffers_all_land(in_c: bool) -> None:
    """READs posted back to back whose requests (one extent per 16 B: 16 Ki extents, 256 KiB of
    header each) are far more than both ends' socket buffers (32 KiB, the option) hold: the
    caller sends what the connection takes at once and the peer's thread the rest, in C —
    waiting for the hand-over, not for an answer that cannot come before it — while the
    READs behind have their headers sent by the thread, in turn. Every READ lands, every
    byte right, none out of order; the caller's posts never wait for the owner."""
    if in_c and native.load() is None:
        pytest.skip("kvlink's C helpers are not built here: no inbox")
    opts = {"socket_buffer_bytes": 32 << 10, "reader_in_c": in_c}
    a, b = TcpTransport(TransportContext("a"), opts), TcpTransport(TransportContext("b"), opts)
    n, piece = 8, 256 << 10
    abuf = np.random.default_rng(3).integers(0, 256, n * piece, dtype=np.uint8)
    bbuf = np.zeros_like(abuf)
    abase, bbase = (int(x.__array_interface__["data"][0]) for x in (abuf, bbuf))
    try:
        a.register([Region(abase, abuf.nbytes)])
        b.register([Region(bbase, bbuf.nbytes)])
        b.connect("a", a.descriptor())
        h = b.post(Op.READ, "a", make_extents([bbase], [16]), make_extents([abase], [16]))
        assert b.wait(h, 10).status is XferStatus.DONE  # connects
        b.release(h)
        peer = b._peers["a"]
        with peer.cv:  # (its thread waits for work on the open connection: parked, in C)
            assert peer.cv.wait_for(lambda: peer.idle or peer.parked, timeout=10)
        perm = np.random.default_rng(4).permutation(piece // 16)  # 16 Ki extents of 16 B
        handles = []
        for i in range(n):
            far = abase + i * piece + perm * 16
            near = bbase + i * piece + np.arange(piece // 16) * 16
            handles.append(b.post(Op.READ, "a", make_extents(near, np.full(near.size, 16)),
                                  make_extents(far, np.full(far.size, 16))))
        for h in handles:
            st = b.wait(h, 60)
            assert st.status is XferStatus.DONE, st.reason
            b.release(h)
        for i in range(n):
            src = abuf[i * piece:(i + 1) * piece].reshape(-1, 16)[perm]
            assert np.array_equal(bbuf[i * piece:(i + 1) * piece].reshape(-1, 16), src), i
    finally:
        a.close()
        b.close()


# 8 -> 2: replicated heads (each decode rank asks one replica per head; the rest are released)
@pytest.mark.parametrize("ptp,dtp", [(1, 1), (2, 4), (4, 2), (8, 2)])
def test_demo_push_mode_verified(ptp: int, dtp: int) -> None:
    res = run_demo(small_plan(mode="push", prefill_tp=ptp, decode_tp=dtp, requests=3),
                   show_progress=False)
    assert res["verified"], res["failed"]
    assert res["descriptors"] > 0
    assert all(s["push_failed"] == 0 for s in res["prefill_leases"].values())


def _push_pair() -> tuple[KVWorker, KVWorker]:
    """In-process (decode serving its side channel, prefill) workers over one small geometry,
    8 blocks each; the prefill's steps are the test's to drive."""
    geo = small_plan().geo
    w = KVWorker(WorkerConfig(engine_id="decode", serve=True))
    prefill = KVWorker(WorkerConfig(engine_id="prefill", serve_pushes=True))
    for worker in (w, prefill):
        # the memory must outlive the worker: registered bytes are written by the transport
        # (a buffer freed right after register was written after free: heap corruption)
        buf, layers = data.allocate(geo, 8, 1, 0)
        worker.register(data.spec_of(geo, layers, 1, 0))
        worker._keep = (buf, layers)  # type: ignore[attr-defined]
    return w, prefill


@pytest.mark.fault("push mode: prefill never writes")
def test_push_times_out_when_nobody_writes(observed: Callable[[str], None]) -> None:
    w, idle = _push_pair()  # idle: a prefill that acknowledges the push but never writes
    try:
        w.expect_push("r0", RemoteEngine("prefill", "127.0.0.1", idle.side_port), [0, 1],
                      timeout=0.5)
        ok, reason = wait_request(w, "r0", 10)
        observed(reason)
        assert not ok and "did not push" in reason
        assert [m.req_id for m in idle.push_requests()] == ["r0"]
    finally:
        w.close()
        idle.close()


def test_refused_push_fails_the_decode_at_once() -> None:
    """A prefill that will not write says so (a "write" notification with ok=False): the decode
    fails the request at once, and never takes the refusal for "written"."""
    w, prefill = _push_pair()
    try:
        w.expect_push("r0", RemoteEngine("prefill", "127.0.0.1", prefill.side_port), [0, 1],
                      timeout=30.0)
        deadline = time.monotonic() + 10
        msgs: list[object] = []
        while not msgs:
            msgs = prefill.push_requests()  # type: ignore[assignment]
            assert time.monotonic() < deadline, "decode never asked for a push"
            time.sleep(0.001)
        t0 = time.monotonic()
        prefill.refuse_push(msgs[0], "its lease expired")  # type: ignore[arg-type]
        ok, reason = wait_request(w, "r0", 10)
        assert not ok and "did not write: its lease expired" in reason, reason
        assert time.monotonic() - t0 < 5  # not the 30 s timeout
    finally:
        w.close()
        prefill.close()


@pytest.mark.fault("decode killed mid-WRITE (push, 256 MiB in flight)")
def test_decode_killed_mid_write_fails_push_on_prefill(observed: Callable[[str], None]) -> None:
    import multiprocessing as mp

    from kvlink.demo.roles import pull_rank

    geo = data.Geometry(layers=8, kv_heads=8, head_dim=128, block_size=16)
    plan = DemoPlan(geo=geo, requests=1, tokens=8192, port=free_port_range(1),
                    decode_port=free_port_range(1), cache_bytes=512 << 20, timeout=30.0,
                    mode="push")
    _buf, layers = data.allocate(geo, plan.slots(1) * plan.blocks_per_request, 1, 0)
    prefill = KVWorker(WorkerConfig(engine_id="prefill", side_port=plan.port, serve_pushes=True,
                                    transport_options={"tcp": {"timeout_s": 8.0}}))
    prefill.register(data.spec_of(geo, layers, 1, 0))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()  # keep a reference: the child unpickles it after start()
    decode = ctx.Process(target=pull_rank, args=(plan, 0, results, False))
    decode.start()
    try:
        deadline = time.monotonic() + 60
        msgs: list[object] = []
        while not msgs:
            msgs = prefill.push_requests()  # type: ignore[assignment]
            assert time.monotonic() < deadline, "decode never asked for a push"
        key = prefill.push(msgs[0], plan.prefill_blocks(0))  # type: ignore[arg-type]
        while prefill.transports["tcp"].inflight() == 0:
            _, failed = prefill.poll()
            assert key not in failed, failed
        decode.kill()
        t0 = time.monotonic()
        ok, reason = wait_request(prefill, key, 15)
        observed(f"WRITE FAILED on prefill after {time.monotonic() - t0:.2f}s: {reason}; "
                 f"still in flight on prefill: {prefill.pending()}")
        if ok:
            pytest.skip("the 256 MiB WRITE finished before the kill landed; nothing to test")
        assert time.monotonic() - t0 < 9
        assert "connection" in reason.lower() or "stalled" in reason
        assert prefill.pending() == 0  # nothing left in flight on the prefill side
    finally:
        decode.kill()
        decode.join(10)
        prefill.close()


@pytest.mark.fault("lease expired before the decode READ")
def test_read_of_expired_lease_is_refused_and_touches_nothing(
        observed: Callable[[str], None]) -> None:
    """Lease expiry racing a READ: announced in time it is pinned and correct; announced
    after expiry it is refused before anything is posted: freed blocks are never read."""
    lease = 0.5
    plan = small_plan(requests=2, lease_seconds=lease)
    serving = Serving(plan)
    w, layers = consumer(plan)
    try:
        serving.wait_ready(120)
        remote = RemoteEngine("prefill", "127.0.0.1", plan.port)
        w.read("req-0", remote, plan.decode_blocks(0), plan.prefill_blocks(0))
        t_read = time.monotonic()
        ok, reason = wait_request(w, "req-0", 20)
        assert ok, reason
        assert data.verify(plan.geo, layers, 1, 0, plan.decode_blocks(0),
                           plan.prefill_blocks(0)) == 0
        assert 0 < w.xfer_seconds.pop("req-0") < 20  # transport span, post to completion
        # Leases are wall-clock: waiting them out is the behaviour under test, not a sync.
        time.sleep(max(0.0, t_read + 3 * lease - time.monotonic()))
        w.read("req-1", remote, plan.decode_blocks(1), plan.prefill_blocks(1))
        ok, reason = wait_request(w, "req-1", 20)
        observed(f"READ refused before posting: {reason}")
        assert not ok and "expired" in reason, reason
        assert w.transports["tcp"].stats.transfers == 1  # the refused READ was never posted
        assert not w.xfer_seconds  # nor timed
        k_plane = np.asarray(layers[0])[0]
        assert not k_plane[plan.decode_blocks(1)].any()  # not a byte of req-1 landed
    finally:
        w.close()
        serving.close()


def test_a_decode_closing_as_soon_as_it_is_written_does_not_fail_the_push(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The WRITE's native note reached the decode before the owner's answer reached the
    prefill: a decode that finished on the note and closed at once made the prefill's WRITE
    FAILED ("connection closed by peer") although every byte had landed (seen in CI as
    test_demo_push_mode_verified[2-4]). The owner now answers before the note is visible.
    Injected, and said so: every answer "A" leaves 50 ms late (a busy owner thread), which
    makes the window the real race needs on demand."""
    real = tcp_server._send_hdr

    def late_answer(sock: Any, hdr: Any) -> None:
        if hdr.op == "A":
            time.sleep(0.05)
        real(sock, hdr)

    monkeypatch.setattr(tcp_server, "_send_hdr", late_answer)
    for i in range(3):
        w, prefill = _push_pair()
        ended: dict[str, str] = {}
        done: set[str] = set()

        def step(prefill: KVWorker = prefill, done: set[str] = done,
                 ended: dict[str, str] = ended) -> None:
            d, f = prefill.poll()
            done.update(d)
            ended.update(f)

        try:
            w.expect_push(f"r{i}", RemoteEngine("prefill", "127.0.0.1", prefill.side_port),
                          [0, 1], timeout=10)
            deadline = time.monotonic() + 10
            msgs: list[wire.PushRequest] = []
            while not msgs:
                assert time.monotonic() < deadline, "no push request arrived"
                msgs = prefill.push_requests()
                time.sleep(0.001)
            rid = prefill.push(msgs[0], [2, 3])
            deadline = time.monotonic() + 10
            while True:  # the prefill's poll drives its WRITE; the decode's sees the note
                assert time.monotonic() < deadline, "the push did not finish on the decode"
                step()
                d, f = w.poll()
                assert f"r{i}" not in f, f
                if f"r{i}" in d:
                    break
                time.sleep(0.001)
        finally:
            w.close()  # at once, as the demo's decode does once every request is in
        deadline = time.monotonic() + 10
        while rid not in done and rid not in ended:
            assert time.monotonic() < deadline, "the prefill's push did not end"
            step()
            time.sleep(0.001)
        prefill.close()
        assert rid in done, f"iteration {i}: {ended.get(rid)}"


def test_an_ok_answer_framed_otherwise_still_gets_the_read_its_bytes() -> None:
    """The reader expects the owner's "ok" as the exact bytes this build frames it in, and
    takes it with the READ's bytes in one call; an owner that frames its ok otherwise (another
    build: here a field this one leaves empty, which no real kvlink owner sends — a fake
    owner, a socket speaking the tcp wire) is read on in Python, and the bytes that follow
    still land, every one."""
    payload = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[str] = []

    def owner() -> None:
        conn, _ = listener.accept()
        with conn:
            hello, req = _recv_hdr(conn), _recv_hdr(conn, 1 << 20)
            served.extend((hello.op, req.op))
            conn.sendall(_frame(_Hdr(_VERSION, "A", agent="another-build")))
            conn.sendall(payload.tobytes())
            conn.recv(1)  # (until the reader closes)

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    dst = np.zeros(8192, dtype=np.uint8)
    reader = TcpTransport(TransportContext("reader"))
    try:
        reader.register([Region(dst.ctypes.data, dst.nbytes)])
        far = 1 << 30
        reader.connect("owner", _enc.encode(_Descriptor(
            v=_VERSION, agent="owner", host="127.0.0.1", port=listener.getsockname()[1],
            regions=[(far, 8192, "cpu")], token=b"k" * 16)))
        base = dst.ctypes.data
        h = reader.post(Op.READ, "owner",
                        make_extents(np.array([base + 4096, base], np.uint64),
                                     np.array([4096, 4096], np.uint64)),
                        make_extents(np.array([far, far + 4096], np.uint64),
                                     np.array([4096, 4096], np.uint64)))
        st = reader.wait(h, 10)
        assert st.status is XferStatus.DONE, st.reason
        assert served == ["H", "R"]
        assert np.array_equal(dst[4096:], payload[:4096])
        assert np.array_equal(dst[:4096], payload[4096:])
    finally:
        reader.close()
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("in_c", [False, True], ids=["reader_in_python", "reader_in_c"])
@pytest.mark.parametrize("agent", ["reader", "lecteur-é"])  # (the C loop: ASCII agents only)
def test_requests_the_c_serving_loop_leaves_to_python_interleave_with_those_it_serves(
        agent: str, in_c: bool) -> None:
    """On one connection, READs the owner serves in C (where kvlink's helpers are built)
    interleave with what its loop hands to Python — a notification, a WRITE, a READ refused
    (under a WRITE grant), a READ from an agent whose name is not ASCII (all of its
    requests) — each served or refused as Python serves it, every byte where it belongs, in
    order. With the reader's thread parked in C too (``reader_in_c``): the refusal comes back
    to its Python from the inbox."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    mine = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    owner = TcpTransport(TransportContext("owner", require_grants=True))
    reader = TcpTransport(TransportContext(agent), {"reader_in_c": in_c})
    try:
        owner.register([Region(src.ctypes.data, src.nbytes)])
        owner.grant(b"read", Op.READ, make_extents(src.ctypes.data, src.nbytes))
        owner.grant(b"write", Op.WRITE, make_extents(src.ctypes.data + 8192, 4096))
        reader.register([Region(dst.ctypes.data, dst.nbytes), Region(mine.ctypes.data,
                                                                     mine.nbytes)])
        reader.connect("owner", owner.descriptor())

        def run(op: Op, at: int, n: int, local: np.ndarray, ticket: bytes = b"") -> XferState:
            h = reader.post(op, "owner", make_extents(local.ctypes.data + at, n),
                            make_extents(src.ctypes.data + at, n),
                            ticket=ticket or op.value.encode())
            state = reader.wait(h, 10.0)
            reader.release(h)
            return state

        assert run(Op.READ, 0, 4096, dst).status is XferStatus.DONE
        reader.notify("owner", b"first")
        assert run(Op.WRITE, 8192, 4096, mine).status is XferStatus.DONE
        refused = run(Op.READ, 8192, 4096, dst, ticket=b"write")
        assert refused.status is XferStatus.FAILED and "WRITE" in (refused.reason or "")
        assert run(Op.READ, 65536, 1 << 19, dst).status is XferStatus.DONE
        reader.notify("owner", b"second")
        assert np.array_equal(dst[:4096], src[:4096])
        assert np.array_equal(src[8192:12288], mine[8192:12288])
        assert np.array_equal(dst[65536:65536 + (1 << 19)], src[65536:65536 + (1 << 19)])
        notes: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < deadline:
            notes += owner.notifications()
        assert notes == [(agent, b"first"), (agent, b"second")]
    finally:
        reader.close()
        owner.close()


def test_reads_the_inbox_holds_behind_a_refusal_are_answered_before_a_read_posted_after() -> None:
    """A READ refused while others wait in the reader's C inbox (their headers sent, their
    answers next on the wire) hands the thread back to Python; a READ posted in that moment
    (a caller retrying the refused one, say) is queued for Python, whose request reads the
    next answer on the wire. Those answers belong to the inbox's READs, so the inbox is
    emptied first: each READ gets its own bytes. (It was not: the queued READ took the first
    inbox READ's answer and bytes — both ended DONE with each other's bytes, or one waited
    past its deadline for an answer already taken.) A fake owner, a socket speaking the tcp
    wire, answers only once both READs' headers are in, so the refusal always finds the
    second in the inbox; the transport's ``_finish`` is wrapped to post the third READ from
    within the refusal's handling, the moment a caller's post can land in the gap."""
    rng = np.random.default_rng(11)
    payloads = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(3)]
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[str] = []

    def ok(conn: socket.socket, payload: np.ndarray) -> None:
        conn.sendall(_frame(_Hdr(_VERSION, "A")) + payload.tobytes())

    def owner() -> None:
        conn, _ = listener.accept()
        with conn:
            served.append(_recv_hdr(conn).op)  # the hello
            served.append(_recv_hdr(conn, 1 << 20).op)  # the first READ: the thread parks after
            ok(conn, payloads[0])
            served.extend(_recv_hdr(conn, 1 << 20).op for _ in range(2))  # both in the inbox
            conn.sendall(_frame(_Hdr(_VERSION, "E", reason="no grant covers it")))
            ok(conn, payloads[1])
            served.append(_recv_hdr(conn, 1 << 20).op)  # the READ posted after the refusal
            ok(conn, payloads[2])
            conn.recv(1)  # (until the reader closes)

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    dst = np.zeros(4 * 4096, dtype=np.uint8)
    reader = TcpTransport(TransportContext("reader"), {"reader_in_c": True})
    far = 1 << 30
    try:
        reader.register([Region(dst.ctypes.data, dst.nbytes)])
        reader.connect("owner", _enc.encode(_Descriptor(
            v=_VERSION, agent="owner", host="127.0.0.1", port=listener.getsockname()[1],
            regions=[(far, 4 * 4096, "cpu")], token=b"k" * 16)))

        def post(i: int) -> int:
            return reader.post(Op.READ, "owner", make_extents(dst.ctypes.data + i * 4096, 4096),
                               make_extents(far + i * 4096, 4096))

        first = post(0)
        assert reader.wait(first, 10).status is XferStatus.DONE
        peer = reader._peers["owner"]
        assert until(lambda: peer.parked, 10), "the peer's thread never parked in C"
        after: list[int] = []
        finish = reader._finish

        def finish_then_post(xfer: Any, state: XferState) -> None:
            finish(xfer, state)
            if state.status is XferStatus.FAILED and not after:
                after.append(post(3))  # on the peer's thread, inside the refusal's handling

        reader._finish = finish_then_post  # type: ignore[method-assign]
        refused, second = post(1), post(2)
        assert "no grant" in (reader.wait(refused, 10).reason or "")
        assert reader.wait(second, 10).status is XferStatus.DONE
        assert after and reader.wait(after[0], 10).status is XferStatus.DONE
        assert served == ["H", "R", "R", "R", "R"]
        assert np.array_equal(dst[:4096], payloads[0])
        assert np.array_equal(dst[2 * 4096:3 * 4096], payloads[1]), "the second READ's bytes"
        assert np.array_equal(dst[3 * 4096:], payloads[2]), "the READ posted after the refusal"
    finally:
        reader.close()
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("size", [4096, 4 << 20], ids=["payload-sent", "payload-cut"])
def test_a_write_refused_in_the_inbox_fails_alone_and_the_transfers_behind_it_run_again(
        size: int) -> None:
    """A WRITE the writer's thread runs in C (its inbox) that the owner refuses — no grant
    for it — is FAILED, nothing of it landed, and the owner, which cannot skip a refused
    WRITE's payload, closes the connection without reading on.

    Small payload: all of it was sent before the refusal was read (the answer is E, read in
    Python). A READ and a WRITE posted right behind it (queued in the inbox, or a READ's
    header sent by the caller into the doomed connection) are not failed with it: they go
    back to the queue and run on a new connection, DONE with the right bytes. Large: the
    owner closed while the payload was being sent, and its reset can swallow the E that came
    first; then the connection failed under everything queued on it, as any lost connection
    does (they end, no hang), and the next transfer opens a new one."""
    src = np.random.default_rng(5).integers(0, 256, 16 << 20, dtype=np.uint8)
    far = np.zeros(16 << 20, dtype=np.uint8)
    back = np.zeros(16 << 20, dtype=np.uint8)
    owner = TcpTransport(TransportContext("owner", require_grants=True))
    writer = TcpTransport(TransportContext("writer"), {"reader_in_c": True})
    if native.load() is None:
        pytest.skip("kvlink's C helpers are not built here: no inbox")
    try:
        owner.register([Region(far.ctypes.data, far.nbytes)])
        up = far.ctypes.data + (4 << 20)
        owner.grant(b"w", Op.WRITE, make_extents(up, 12 << 20))
        owner.grant(b"r", Op.READ, make_extents(far.ctypes.data, far.nbytes))
        writer.register([Region(src.ctypes.data, src.nbytes),
                         Region(back.ctypes.data, back.nbytes)])
        writer.connect("owner", owner.descriptor())
        warm = writer.post(Op.WRITE, "owner", make_extents(src.ctypes.data, 4096),
                           make_extents(up, 4096), ticket=b"w")
        assert writer.wait(warm, 10).status is XferStatus.DONE  # (the connection opened)
        peer = writer._peers["owner"]
        with peer.cv:
            assert peer.cv.wait_for(lambda: peer.parked, 10)
        bad = writer.post(Op.WRITE, "owner", make_extents(src.ctypes.data, size),
                          make_extents(far.ctypes.data, size), ticket=b"w")  # not granted there
        read = writer.post(Op.READ, "owner", make_extents(back.ctypes.data, 4096),
                           make_extents(up, 4096), ticket=b"r")
        good = writer.post(Op.WRITE, "owner", make_extents(src.ctypes.data + 4096, size),
                           make_extents(up + 4096, size), ticket=b"w")
        st = writer.wait(bad, 30)
        assert st.status is XferStatus.FAILED, st
        behind = [writer.wait(read, 30), writer.wait(good, 30)]
        if size == 4096:
            assert "refused" in st.reason, st.reason
            assert all(b.status is XferStatus.DONE for b in behind), behind
            assert np.array_equal(back[:4096], src[:4096])  # the warm WRITE's, read back
            assert np.array_equal(far[(4 << 20) + 4096:(4 << 20) + 4096 + size],
                                  src[4096:4096 + size])
        else:
            assert all(b.status is not XferStatus.PENDING for b in behind), behind
            again = writer.post(Op.READ, "owner", make_extents(back.ctypes.data, 4096),
                                make_extents(up, 4096), ticket=b"r")
            assert writer.wait(again, 30).status is XferStatus.DONE
            assert np.array_equal(back[:4096], src[:4096])
        assert not far[:4 << 20].any()  # nothing of the refused WRITE landed
    finally:
        writer.close()
        owner.close()


@pytest.mark.fault("an owner that takes a WRITE's header and then stops reading its bytes (a "
                   "fake owner: a socket speaking the tcp wire, which a real owner never does "
                   "on demand)")
@pytest.mark.parametrize("in_c", [True, False], ids=["inbox", "python"])
def test_a_write_the_owner_stops_reading_fails_at_its_timeout_and_close_is_bounded(
        observed: Callable[[str], None], in_c: bool) -> None:
    """A WRITE whose owner stops taking its bytes mid-payload (a hung decode), run in the
    writer's C inbox or in its thread's Python: the send waits at most the transport's
    ``timeout_s`` without progress, then the WRITE is FAILED naming the stall — quiescent,
    the thread back from the send — and neither the caller's poll nor close() hangs. (A
    stall was then waited on a second time, for an answer a stalled owner does not send:
    the WRITE failed at ``timeout_s`` + 1 s.)"""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def owner() -> None:
        conn, _ = listener.accept()
        with conn:
            _recv_hdr(conn)  # the hello
            _recv_hdr(conn, 1 << 20)  # the first WRITE: taken whole and answered
            got = 0
            while got < 4096:
                got += len(conn.recv(4096 - got))
            conn.sendall(_frame(_Hdr(_VERSION, "A")))
            _recv_hdr(conn, 1 << 20)  # the second: its header, then nothing more read
            stop.wait(30)

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    src = np.ones(64 << 20, dtype=np.uint8)
    writer = TcpTransport(TransportContext("writer"), {"reader_in_c": in_c, "timeout_s": 1.0})
    far = 1 << 30
    try:
        writer.register([Region(src.ctypes.data, src.nbytes)])
        writer.connect("owner", _enc.encode(_Descriptor(
            v=_VERSION, agent="owner", host="127.0.0.1", port=listener.getsockname()[1],
            regions=[(far, src.nbytes, "cpu")], token=b"k" * 16)))
        warm = writer.post(Op.WRITE, "owner", make_extents(src.ctypes.data, 4096),
                           make_extents(far, 4096))
        assert writer.wait(warm, 10).status is XferStatus.DONE
        peer = writer._peers["owner"]
        assert until(lambda: peer.parked or not in_c, 10), "the peer's thread never parked"
        t0 = time.monotonic()
        h = writer.post(Op.WRITE, "owner", make_extents(src.ctypes.data, src.nbytes),
                        make_extents(far, src.nbytes))
        st = writer.wait(h, 10)
        took = time.monotonic() - t0
        observed(f"WRITE {st.status.name} after {took:.2f}s: {st.reason}")
        assert st.status is XferStatus.FAILED and "stalled: no bytes moved within 1.0s" \
            in st.reason, st
        assert 0.9 < took < 1.8, took  # (no second wait for an answer after it)
        assert not peer.in_c and not peer.parked  # back from C: nothing of it still moving
        t1 = time.monotonic()
        writer.close()
        assert time.monotonic() - t1 < 3
    finally:
        stop.set()
        writer.close()
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("option", [None, 1 << 18], ids=["same-host-default", "given"])
def test_socket_buffers_follow_the_option_and_where_the_peer_is(option: int | None) -> None:
    """Each connection's socket buffers (tcp option ``socket_buffer_bytes``): by default
    ``SAME_HOST_BUFFER`` between two processes of one host, the size given otherwise — on
    both ends of the connection (Linux reports twice what was set, at most twice
    ``net.core.{w,r}mem_max``). (0, the kernel's autotuning: below, where what is set is
    seen; an autotuned buffer's size moves.)"""
    from kvlink_transports.tcp import wire as tcp_wire

    size = tcp_wire.SAME_HOST_BUFFER if option is None else option
    limits = {socket.SO_SNDBUF: Path("/proc/sys/net/core/wmem_max"),
              socket.SO_RCVBUF: Path("/proc/sys/net/core/rmem_max")}
    want = {opt: 2 * min(size, int(p.read_text())) for opt, p in limits.items()}

    opts = {} if option is None else {"socket_buffer_bytes": option}
    a = TcpTransport(TransportContext("a"), opts)
    b = TcpTransport(TransportContext("b"), opts)
    buf = np.arange(1 << 16, dtype=np.uint8)
    try:
        a.register([Region(buf.ctypes.data, buf.nbytes)])
        b.register([Region(buf.ctypes.data, buf.nbytes)])
        b.connect("a", a.descriptor())
        h = b.post(Op.READ, "a", make_extents(buf.ctypes.data, 4096),
                   make_extents(buf.ctypes.data + 4096, 4096))
        assert b.wait(h, 10).status is XferStatus.DONE
        ends = [b._peers["a"].sock, *(c.conn for c in a._inbound.values())]
        assert len(ends) == 2 and ends[0] is not None
        for sock in ends:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                assert sock.getsockopt(socket.SOL_SOCKET, opt) == want[opt], opt
    finally:
        b.close()
        a.close()


def test_a_peer_on_another_host_keeps_the_kernels_socket_buffers() -> None:
    """Between hosts (and anywhere with ``socket_buffer_bytes`` 0) the buffers are left to the
    kernel's autotuning: setting a size turns it off, and a common ``rmem_max`` clamps it to
    ~416 KiB. A connection to another host cannot be made here: a stand-in exposes the two
    addresses a real socket would, and records what would be set on it (it says so)."""
    from kvlink_transports.tcp import wire as tcp_wire

    class Across:  # a stand-in for a socket connected to another host
        def __init__(self, peer: str, local: str) -> None:
            self.peer, self.local, self.set = peer, local, []

        def getpeername(self) -> tuple[str, int]:
            return self.peer, 1

        def getsockname(self) -> tuple[str, int]:
            return self.local, 2

        def setsockopt(self, level: int, opt: int, value: int) -> None:
            self.set.append((opt, value))

    far = Across("198.51.100.7", "192.0.2.2")
    tcp_wire._tune(far, None)  # type: ignore[arg-type]
    assert far.set == [(socket.TCP_NODELAY, 1)]
    kernel = Across("127.0.0.1", "127.0.0.1")
    tcp_wire._tune(kernel, 0)  # type: ignore[arg-type]
    assert kernel.set == [(socket.TCP_NODELAY, 1)]
    for peer, local in (("127.0.0.1", "192.0.2.2"), ("192.0.2.2", "192.0.2.2")):
        near = Across(peer, local)
        tcp_wire._tune(near, None)  # type: ignore[arg-type]
        assert (socket.SO_RCVBUF, tcp_wire.SAME_HOST_BUFFER) in near.set, (peer, local)


def test_a_connection_no_thread_can_serve_is_refused_and_forgotten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner cannot start a serving thread for a connection (the OS's thread limit):
    the connection is closed (the READ on it fails) and forgotten — not left counted
    against ``max_connections`` for good, nor joined by ``fence()`` and ``close()``, which
    raised "cannot join thread before it is started" (and close() then left its listener
    open). The fault is injected (Thread.start raising for the serving thread, as CPython
    does when the OS refuses one); the transports and sockets are real."""
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    owner = TcpTransport(TransportContext(agent_name="B"), {"timeout_s": 2.0})
    reader = TcpTransport(TransportContext(agent_name="A"), {"timeout_s": 2.0})
    try:
        owner.register([Region(src.ctypes.data, src.nbytes)])
        reader.register([Region(dst.ctypes.data, dst.nbytes)])
        reader.connect("B", owner.descriptor())
        real_start = threading.Thread.start

        def start(self: threading.Thread) -> None:
            if self.name == "kvlink-tcp-serve":
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        h = reader.post(Op.READ, "B", make_extents(dst.ctypes.data, 64),
                        make_extents(src.ctypes.data, 64))
        assert reader.wait(h, 10).status.name == "FAILED"
        monkeypatch.undo()
        assert not owner._inbound
        owner.fence("A", 1.0)
    finally:
        reader.close()
        owner.close()


@pytest.mark.parametrize("helpers", [True, False], ids=["C queue", "Python queue"])
def test_notifications_nobody_takes_are_bounded(helpers: bool) -> None:
    """An owner whose caller never takes notifications (a prefill: nothing notifies it in a
    pull) and a peer that sends them anyway (it holds the memory key: a buggy or hostile
    decode): the owner queues at most 64 MiB of them, drops and counts the rest, and the
    queue it keeps is intact. Before, every byte sent was kept (392 MiB for 48 notes of
    8 MiB). Real transports and sockets; the Python queue is the one used where kvlink's C
    helpers are not built (not a fake: the path they replace)."""
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    owner = TcpTransport(TransportContext(agent_name="B"), {"timeout_s": 5.0})
    peer = TcpTransport(TransportContext(agent_name="A"), {"timeout_s": 5.0})
    try:
        if not helpers:
            owner._notifs = tcp_server._Notes(None)
        owner.register([Region(src.ctypes.data, src.nbytes)])
        peer.register([Region(dst.ctypes.data, dst.nbytes)])
        peer.connect("B", owner.descriptor())
        note = b"n" * (8 << 20)
        for _ in range(12):
            peer.notify("B", note)
        assert until(lambda: owner._notifs.dropped == 5, 30)  # 12 of 8 MiB: 7 kept
        kept = owner.notifications()
        assert len(kept) == 7 and all(n == ("A", note) for n in kept)
        peer.notify("B", b"after")  # room again once taken
        later: list[tuple[str, bytes]] = []
        assert until(lambda: bool(later.extend(owner.notifications()) or later), 10)
        assert later == [("A", b"after")]
    finally:
        peer.close()
        owner.close()
