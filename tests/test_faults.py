"""Faults on the control path: slow peers, restarted peers, stray notifications, who may connect."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_lifecycle import until

from kvlink import sidechannel, wire
from kvlink.compat import WIRE_VERSION
from kvlink.demo import data
from kvlink.demo.proc import StopFlag
from kvlink.demo.run import free_port_range
from kvlink.errors import AuthError, ConfigError, SideChannelError
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=2, kv_heads=2, head_dim=8, block_size=4)


def make(engine: str, seed: int = 0, **cfg: object) -> tuple[KVWorker, list[object]]:
    _buf, layers = data.allocate(GEO, 8, 1, 0)
    _buf[:] = np.random.default_rng(seed).integers(0, 2**16, _buf.shape, dtype=np.uint16)
    w = KVWorker(WorkerConfig(engine_id=engine, **cfg))  # type: ignore[arg-type]
    w.register(data.spec_of(GEO, layers, 1, 0))
    w._keep = _buf  # type: ignore[attr-defined]
    return w, layers


def wait(w: KVWorker, req: str, timeout: float = 20) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = w.poll()
        if req in done:
            return True, ""
        if req in failed:
            return False, failed[req]
    raise AssertionError(f"{req} did not finish in {timeout}s")


@pytest.mark.fault("side channel accepts but never answers (slow / hung peer)")
def test_hung_side_channel_times_out(observed: Callable[[str], None]) -> None:
    sink = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    port = sink.getsockname()[1]
    w, _ = make("d", serve=False, handshake_timeout=0.5)
    try:
        t0 = time.monotonic()
        w.read("r", RemoteEngine("p", "127.0.0.1", port), [0], [0])
        ok, reason = wait(w, "r")
        observed(f"failed after {time.monotonic() - t0:.2f}s: {reason}")
        assert not ok and "within 0.5s" in reason and time.monotonic() - t0 < 3
    finally:
        w.close()
        sink.close()


@pytest.mark.fault("prefill restarted at the same host:port with a new engine id")
def test_restarted_producer_stale_metadata_dropped(observed: Callable[[str], None]) -> None:
    old, _ = make("p-old", seed=1)
    port = old.side_port
    d, layers = make("d", serve=False)
    try:
        old.hold("a", [0])
        d.read("a", RemoteEngine("p-old", "127.0.0.1", port), [0], [0])
        assert wait(d, "a")[0]
        old_agent = d.connected_peers()[0]
        old.close()
        new, new_layers = make("p-new", seed=2, side_port=port)
        new.hold("b", [1, 2])
        try:
            d.read("b", RemoteEngine("p-new", "127.0.0.1", port), [1, 2], [1, 2])
            assert wait(d, "b")[0]
            assert old_agent not in d.connected_peers()  # stale metadata dropped
            got = np.asarray(layers[0])[:, [1, 2]]
            assert np.array_equal(got, np.asarray(new_layers[0])[:, [1, 2]])  # new bytes
            d.read("c", RemoteEngine("p-old", "127.0.0.1", port), [3], [3])
            ok, reason = wait(d, "c")
            observed(f"read from the new engine used its metadata; a read addressed to the old "
                     f"engine id failed: {reason}")
            assert not ok and "p-new" in reason and "expected 'p-old'" in reason
        finally:
            new.close()
    finally:
        d.close()


@pytest.mark.fault("duplicate, late and unknown notifications")
def test_stray_notifications_are_counted_not_applied(observed: Callable[[str], None]) -> None:
    p, _ = make("p")
    gen = p.hold("r1", [0, 1])
    try:
        def note(req: str, generation: int = gen) -> None:
            sidechannel.request("127.0.0.1", p.side_port, wire.ReadDone(
                v=WIRE_VERSION, engine_id="d", req_id=req, tp_rank=0, tp_size=1,
                generation=generation), 5)

        with pytest.raises(SideChannelError, match="not_yours"):
            note("r1", 0)  # a release that does not name the hold's generation: refused
        for req in ("r1", "r1", "ghost", "r1"):  # done, duplicate, unknown, late
            note(req)
        freed = [r.block_ids for r in p.released()]
        stats = p.leases.stats
        observed(f"freed once {freed.count([0, 1])}x; stats {stats}")
        assert freed == [[0, 1]]
        assert stats.duplicate_notifications == 0  # r1 was gone: late ones are unknown
        assert stats.unknown_notifications == 3 and stats.held_blocks == 0
    finally:
        p.close()


@pytest.mark.fault("peer without the shared secret, with a wrong one, and a replayed nonce")
def test_side_channel_authentication(observed: Callable[[str], None]) -> None:
    p, _ = make("p", secret="s3cret")
    try:
        hs = wire.HandshakeRequest(v=WIRE_VERSION, engine_id="d", agent_name="d/0", tp_rank=0,
                                   tp_size=1, host_id="h", compat="")
        with pytest.raises(AuthError, match="not signed") as e1:
            sidechannel.request("127.0.0.1", p.side_port, hs, 5)
        with pytest.raises(AuthError, match="secrets differ") as e2:
            sidechannel.request("127.0.0.1", p.side_port, hs, 5, secret=b"wrong")
        ok = sidechannel.request("127.0.0.1", p.side_port, hs, 5, secret=b"s3cret")
        assert isinstance(ok, wire.HandshakeResponse)
        # replay: capture a signed message and send it twice
        nonce = sidechannel._exchange("127.0.0.1", p.side_port,
                                      wire.Challenge(v=WIRE_VERSION, nonce=b""), 5)
        assert isinstance(nonce, wire.Challenge)
        body = wire.encode(hs)
        signed = wire.Signed(v=WIRE_VERSION, nonce=nonce.nonce,
                             mac=sidechannel._mac(b"s3cret", nonce.nonce, body), body=body)
        assert isinstance(sidechannel._exchange("127.0.0.1", p.side_port, signed, 5),
                          wire.HandshakeResponse)
        with pytest.raises(AuthError, match="replayed") as e3:
            sidechannel.request("127.0.0.1", p.side_port, signed, 5)
        observed(f"no secret: {e1.value}; wrong secret: {e2.value}; replay: {e3.value}")
    finally:
        p.close()


def test_unauthenticated_non_loopback_bind_refused() -> None:
    with pytest.raises(ConfigError, match="refusing to bind an unauthenticated side channel"):
        sidechannel.SideChannelServer("0.0.0.0", 0, lambda m: wire.Ack(v=WIRE_VERSION))
    srv = sidechannel.SideChannelServer("0.0.0.0", 0, lambda m: wire.Ack(v=WIRE_VERSION),
                                        secret=b"x")
    srv.close()


def _state(pid: int | None) -> str:
    """A process's state as the kernel shows it (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _frozen_producer(port: int, events: Any, stop: Any) -> None:
    """A producer process holding r0 and r1, polling until ``stop``; it reports its holds'
    generations and every release (what the test watches once it is thawed)."""
    _buf, layers = data.allocate(GEO, 8, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="p", side_port=port))
    try:
        w.register(data.spec_of(GEO, layers, 1, 0))
        events.put(("held", w.hold("r0", [1, 2]), w.hold("r1", [3, 4])))
        while not stop.is_set():
            w.poll()
            for rel in w.released():
                events.put(("released", rel.req_id, rel.why))
            w.wait(0.001)  # its step loop idles (woken by an answer), as a prefill's would
    finally:
        w.close()


def _end(child: Any, stop: Any, stopped: bool) -> None:
    """A producer process this test stopped (``stopped``: SIGSTOP still on) resumed, told to
    stop, and reaped (killed if it does not end in 10 s)."""
    if stopped:
        os.kill(child.pid, signal.SIGCONT)
    stop.set()
    child.join(10)
    if child.is_alive():
        child.kill()


WIDE = data.Geometry(layers=256, kv_heads=1, head_dim=8, block_size=4)  # many small extents
TINY_BUFFERS = {"tcp": {"socket_buffer_bytes": 4096, "timeout_s": 2.0}}


def _frozen_wide_producer(port: int, events: Any, stop: Any) -> None:
    """A producer of WIDE holding r0 and r1 (every block each), its sockets' buffers the
    kernel's least, polling until ``stop``."""
    _buf, layers = data.allocate(WIDE, 8, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="p", side_port=port, transport_options=TINY_BUFFERS))
    try:
        w.register(data.spec_of(WIDE, layers, 1, 0))
        events.put(("held", w.hold("r0", list(range(8))), w.hold("r1", list(range(8)))))
        while not stop.is_set():
            w.poll()
            w.wait(0.001)
    finally:
        w.close()


@pytest.mark.fault("a producer process stopped (SIGSTOP) while a READ's request is more "
                   "than its connection's buffers hold")
def test_a_read_posted_to_a_frozen_producer_never_holds_the_caller(
        observed: Callable[[str], None]) -> None:
    """A READ's request (its header: every remote extent) went out on the caller's thread
    with a blocking send: where the producer had stopped reading (SIGSTOP here; a hung host,
    a long GC pause) and the request was more than the socket buffers hold — 4096 extents
    here, a 70B request is 10x that — ``read()`` itself hung until tcp's deadline (2 s here,
    30 s by default), and a decode's step loop with it. Now the caller sends what the
    connection takes at once and the peer's thread sends the rest: ``read()`` returns in
    milliseconds and the request fails at the transport's deadline, through ``poll()``."""
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    stop = StopFlag(ctx)
    port = free_port_range(1)
    child = ctx.Process(target=_frozen_wide_producer, args=(port, events, stop), daemon=True)
    child.start()
    _buf, layers = data.allocate(WIDE, 8, 1, 0)
    w = KVWorker(WorkerConfig(engine_id="d", transport_options=TINY_BUFFERS))
    w.register(data.spec_of(WIDE, layers, 1, 0))
    stopped = False
    try:
        _, gen0, gen1 = events.get(timeout=60)
        remote = RemoteEngine("p", "127.0.0.1", port)
        w.read("r0", remote, list(range(8)), list(range(8)), generation=gen0)
        assert wait(w, "r0") == (True, "")
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        stopped = True
        until(lambda: _state(child.pid) in ("T", "t"), 10, "the producer stopped")
        shuffled = [5, 2, 7, 0, 3, 6, 1, 4]  # one extent per block, layer and plane: 4096
        t0 = time.monotonic()
        w.read("r1", remote, shuffled, list(range(8)), generation=gen1)
        took = time.monotonic() - t0
        observed(f"read() returned after {took * 1e3:.1f} ms")
        assert took < 0.5, f"read() held the caller {took:.2f}s: its request's send blocked"
        ok, reason = wait(w, "r1", timeout=30)
        observed(f"failed after {time.monotonic() - t0:.2f}s: {reason}")
        assert not ok and "no bytes moved within 2.0s" in reason, reason
    finally:
        _end(child, stop, stopped)
        w.close()


@pytest.mark.fault("a producer process stopped (SIGSTOP: alive, connections open, silent) "
                   "under a READ, then resumed")
def test_a_read_from_a_frozen_producer_fails_at_the_transports_deadline(
        observed: Callable[[str], None]) -> None:
    """A prefill that stops answering mid-flight (SIGSTOP; a hung host, a long pause) after a
    READ of it went well: the next READ moves nothing, fails once its transport saw no byte
    move for ``timeout_s`` (here 2 s; tcp's default 30) and its report went unanswered (2
    s), so the request is failed — recomputed — in seconds, not held for ever; resumed, the
    producer learns of the failure and releases the hold at once, not at its lease's end."""
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    stop = StopFlag(ctx)
    port = free_port_range(1)
    child = ctx.Process(target=_frozen_producer, args=(port, events, stop), daemon=True)
    child.start()
    w, _ = make("d", transport_options={"tcp": {"timeout_s": 2.0}})
    stopped = False
    try:
        _, gen0, gen1 = events.get(timeout=60)
        remote = RemoteEngine("p", "127.0.0.1", port)
        w.read("r0", remote, [5, 6], [1, 2], generation=gen0)
        assert wait(w, "r0") == (True, "")
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        stopped = True
        until(lambda: _state(child.pid) in ("T", "t"), 10, "the producer stopped")
        t0 = time.monotonic()
        w.read("r1", remote, [6, 7], [3, 4], generation=gen1)
        ok, reason = wait(w, "r1", timeout=30)
        took = time.monotonic() - t0
        observed(f"failed after {took:.2f}s: {reason}")
        assert not ok and "no bytes moved within 2.0s" in reason, reason
        assert took < 8, f"{took:.1f}s for a READ of a frozen producer to fail"
        os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
        stopped = False
        t1 = time.monotonic()
        released: dict[str, object] = {}
        while "r1" not in released:
            w.poll()  # (our report of the failure leaves with a poll)
            try:
                ev = events.get(timeout=0.01)
            except queue.Empty:
                assert time.monotonic() - t1 < 10, f"r1 not released: {released}"
                continue
            released[ev[1]] = ev[2]
        observed(f"resumed, it released r1 after {time.monotonic() - t1:.2f}s: "
                 f"{released['r1']}")
        assert "expired" not in str(released["r1"])
    finally:
        _end(child, stop, stopped)
        w.close()
