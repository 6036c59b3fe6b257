"""NixlTransport between two real processes (multiprocessing spawn), bytes checked against numpy.

The peer process owns a registered numpy buffer and answers commands over a pipe. It blocks on the
pipe between commands and never polls: the transport's own light progress thread answers UCX's
wire-up (NIXL's busy-spinning progress thread stays off).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

pytest.importorskip("nixl", reason="NIXL not installed: pip install 'kvlink[nixl]'")

from kvlink.errors import (
    ConfigError,
    ExtentOutOfBounds,
    TransferError,
    WireError,
    WireVersionError,
)
from kvlink.transport import (
    EXTENT_DTYPE,
    Op,
    Region,
    Runs,
    TransportContext,
    XferStatus,
    create_transport,
    make_extents,
)
from kvlink_transports import nixl as knixl

TIMEOUT = 30.0
OPTS = {"ucx_probe": False}


def _peer_main(
    conn: Connection,
    name: str,
    nbytes: int,
    seed: int,
    tls: str | None,
    opts: dict[str, Any] | None = None,
) -> None:
    if tls is not None:
        os.environ["UCX_TLS"] = tls
    from kvlink_transports.nixl import NixlTransport

    t = NixlTransport(TransportContext(agent_name=name), {**OPTS, **(opts or {})})
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    conn.send(("ready", t.descriptor(), buf.ctypes.data, os.getpid()))
    notes: list[tuple[str, bytes]] = []
    while True:  # blocks: the transport's progress thread serves the initiator meanwhile
        cmd, *args = conn.recv()
        if cmd == "connect":
            t.connect(args[0], args[1])
            conn.send("ok")
        elif cmd == "bytes":
            conn.send_bytes(buf.tobytes())
        elif cmd == "notifs":  # wait (bounded) until at least args[0] arrived, then hand them over
            deadline = time.monotonic() + TIMEOUT
            notes.extend(t.notifications())
            while len(notes) < args[0] and time.monotonic() < deadline:
                notes.extend(t.notifications())
            conn.send(list(notes))
            notes.clear()
        elif cmd == "expect":  # a READ of ours is due: progress fast until its notification
            t.expect_access(args[0], args[1])
            conn.send("ok")
        elif cmd == "notify":
            t.notify(args[0], args[1])
            conn.send("ok")
        elif cmd == "stop":
            t.close()
            conn.send("bye")
            return


class Peer:
    def __init__(
        self,
        name: str,
        nbytes: int,
        seed: int,
        tls: str | None = None,
        opts: dict[str, Any] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name, self.nbytes, self.seed = name, nbytes, seed
        self.proc = ctx.Process(
            target=_peer_main, args=(child, name, nbytes, seed, tls, opts), daemon=True
        )
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise RuntimeError("peer did not start")
        tag, self.descriptor, self.addr, self.pid = self.conn.recv()
        assert tag == "ready"

    def reference(self) -> np.ndarray:
        return np.random.default_rng(self.seed).integers(0, 256, self.nbytes, dtype=np.uint8)

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        assert self.conn.poll(TIMEOUT), f"peer {self.name} did not answer {msg[0]}"
        return self.conn.recv()

    def buffer(self) -> np.ndarray:
        self.conn.send(("bytes",))
        assert self.conn.poll(TIMEOUT)
        return np.frombuffer(self.conn.recv_bytes(), dtype=np.uint8)

    def kill(self) -> None:
        os.kill(self.proc.pid or 0, signal.SIGKILL)
        self.proc.join(TIMEOUT)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (OSError, EOFError, AssertionError):
                pass
            self.proc.join(TIMEOUT)
            if self.proc.is_alive():
                self.kill()


def _ctx() -> TransportContext:
    return TransportContext(agent_name=f"test-{uuid.uuid4().hex[:8]}")


def _pairs(
    rng: np.random.Generator, n: int, local_size: int, remote_size: int, max_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lens = rng.integers(1, max_len, n).astype(np.uint64)
    gaps_l = rng.integers(1, 4096, n).astype(np.uint64)
    gaps_r = rng.integers(1, 4096, n).astype(np.uint64)
    loc_off = np.cumsum(gaps_l + lens) - lens
    perm = rng.permutation(n)
    rl = lens[perm]
    rem_off_sorted = np.cumsum(gaps_r + rl) - rl
    rem_off = np.empty(n, dtype=np.uint64)
    rem_off[perm] = rem_off_sorted  # extent i lands at a shuffled place on the remote side
    assert int((loc_off + lens).max()) <= local_size and int((rem_off + lens).max()) <= remote_size
    return loc_off, rem_off, lens


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer(f"peer-{uuid.uuid4().hex[:8]}", 8 << 20, seed=7)
    yield p
    p.stop()


@pytest.fixture()
def local() -> Iterator[tuple[Any, np.ndarray]]:
    t = create_transport("nixl", _ctx(), OPTS)
    buf = np.zeros(8 << 20, dtype=np.uint8)
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    yield t, buf
    t.close()


def _wait_notes(t: Any, n: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + TIMEOUT
    while len(got) < n and time.monotonic() < deadline:
        got.extend(t.notifications())
    return got


def test_read_write_many_extents_and_notifications(
    peer: Peer, local: tuple[Any, np.ndarray]
) -> None:
    t, buf = local
    t.connect(peer.name, peer.descriptor)
    assert peer.call("connect", t.ctx.agent_name, t.descriptor()) == "ok"
    rng = np.random.default_rng(1)
    remote_ref = peer.reference()

    # READ: 400 non-contiguous extents of varying length, remote order shuffled
    loc_off, rem_off, lens = _pairs(rng, 400, buf.nbytes, peer.nbytes, 16 << 10)
    lo = make_extents(buf.ctypes.data + loc_off, lens)
    ro = make_extents(peer.addr + rem_off, lens)
    h = t.post(Op.READ, peer.name, lo, ro, notify=b"read-done")
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    t.release(h)
    expect = np.zeros_like(buf)
    for a, b, n in zip(loc_off.tolist(), rem_off.tolist(), lens.tolist(), strict=True):
        expect[a : a + n] = remote_ref[b : b + n]
    assert np.array_equal(buf, expect)
    assert int(buf.astype(np.uint64).sum()) == int(expect.astype(np.uint64).sum())

    # WRITE: fresh random local bytes into other shuffled remote extents
    buf[:] = np.random.default_rng(2).integers(0, 256, buf.nbytes, dtype=np.uint8)
    loc_off, rem_off, lens = _pairs(rng, 300, buf.nbytes, peer.nbytes, 20 << 10)
    h = t.post(
        Op.WRITE,
        peer.name,
        make_extents(buf.ctypes.data + loc_off, lens),
        make_extents(peer.addr + rem_off, lens),
        notify=b"write-done",
    )
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    t.release(h)
    for a, b, n in zip(loc_off.tolist(), rem_off.tolist(), lens.tolist(), strict=True):
        remote_ref[b : b + n] = buf[a : a + n]
    assert np.array_equal(peer.buffer(), remote_ref)

    # notifications: on transfers (sent by NIXL after the data) and standalone, both directions
    notes = peer.call("notifs", 2)
    assert sorted(notes) == [(t.ctx.agent_name, b"read-done"), (t.ctx.agent_name, b"write-done")]
    t.notify(peer.name, b"hello")
    assert peer.call("notifs", 1) == [(t.ctx.agent_name, b"hello")]
    assert peer.call("notify", t.ctx.agent_name, b"from-peer") == "ok"
    assert _wait_notes(t, 1) == [(peer.name, b"from-peer")]

    # an empty request completes at once and still notifies
    empty = np.empty(0, dtype=EXTENT_DTYPE)
    h = t.post(Op.READ, peer.name, empty, empty, notify=b"empty")
    assert t.poll(h).status is XferStatus.DONE
    t.release(h)
    assert peer.call("notifs", 1) == [(t.ctx.agent_name, b"empty")]

    assert t.stats.transfers == 2 and t.stats.failed == 0 and t.stats.descriptors == 700
    assert t.stats.xfer_seconds > 0 and t.stats.post_seconds > 0
    t.disconnect(peer.name)


def test_bounds_checked_before_posting(peer: Peer, local: tuple[Any, np.ndarray]) -> None:
    t, buf = local
    t.connect(peer.name, peer.descriptor)
    ok_l = make_extents(buf.ctypes.data, 4096)
    cases = [
        (ok_l, make_extents(peer.addr + peer.nbytes - 100, 4096)),  # runs past the peer's region
        (ok_l, make_extents(peer.addr - 4096, 4096)),  # before it
        (make_extents(buf.ctypes.data + buf.nbytes, 4096), make_extents(peer.addr, 4096)),  # local
        (ok_l, make_extents(peer.addr, 4095)),  # lengths differ
    ]
    for lo, ro in cases:
        with pytest.raises(ExtentOutOfBounds):
            t.post(Op.READ, peer.name, lo, ro)
    h = t.post(Op.READ, "nobody", ok_l, make_extents(peer.addr, 4096))  # a FAILED handle
    state = t.poll(h)
    assert state.status is XferStatus.FAILED and "'nobody'" in state.reason, state
    t.release(h)
    assert t.stats.transfers == 0 and t._handle_counts()["xfers"] == 0
    t.disconnect(peer.name)


def test_post_runs_indexes_the_prepped_lists_and_keeps_the_bounds(
    peer: Peer, local: tuple[Any, np.ndarray]
) -> None:
    """A RUNS-form READ (what the worker hands a transport with ``post_runs``): indices from
    segment bases and block offsets, no extents built — the same bytes as post, in the same
    places; runs past a region's end, or of unequal lengths, take post's path (its bounds
    check raises)."""
    t, buf = local
    t.connect(peer.name, peer.descriptor)
    page, segs = 4096, 8
    seg = np.uint64(64 * page)  # 8 segments of 64 pages each side
    rng = np.random.default_rng(5)
    lids = rng.choice(64, 24, replace=False).astype(np.uint64)
    rids = rng.choice(64, 24, replace=False).astype(np.uint64)
    lbase = np.uint64(buf.ctypes.data) + np.arange(segs, dtype=np.uint64) * seg
    rbase = np.uint64(peer.addr) + np.arange(segs, dtype=np.uint64) * seg + np.uint64(page)
    u = np.uint64(page)
    lens = np.full(24, page, dtype=np.uint64)
    runs = Runs(lbase, rbase, lids * u, rids * u, lens, 24 * segs, 24 * page, page)
    buf[:] = 0
    h = t.post_runs(Op.READ, peer.name, runs)
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    assert t.xfer_timing(h)["path"] == "prepped"
    t.release(h)
    ref = peer.buffer()  # (the module's peer: earlier tests WROTE into it)
    plan = runs.expand()
    for (la, ln), ra in zip(plan.local[["addr", "len"]].tolist(), plan.remote["addr"].tolist()):
        lo, ro = la - buf.ctypes.data, ra - peer.addr
        assert np.array_equal(buf[lo:lo + ln], ref[ro:ro + ln])
    assert int(buf.astype(np.int64).sum()) == int(sum(
        ref[ra - peer.addr:ra - peer.addr + page].astype(np.int64).sum()
        for ra in plan.remote["addr"].tolist()))  # nothing landed anywhere else
    rbase += np.uint64(3 * page)  # the same array refilled: the new places, not the cached
    buf[:] = 0
    h = t.post_runs(Op.READ, peer.name, runs)
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    t.release(h)
    plan = runs.expand()
    for (la, ln), ra in zip(plan.local[["addr", "len"]].tolist(), plan.remote["addr"].tolist()):
        lo, ro = la - buf.ctypes.data, ra - peer.addr
        assert np.array_equal(buf[lo:lo + ln], ref[ro:ro + ln])
    far = Runs(lbase, rbase, lids * u, (rids + np.uint64(2048)) * u, lens, 24 * segs,
               24 * page, page)  # past the peer's 8 MiB
    with pytest.raises(ExtentOutOfBounds):
        t.post_runs(Op.READ, peer.name, far)
    mixed = Runs(lbase, rbase, lids[:2] * u, rids[:2] * u,
                 np.array([page, 2 * page], dtype=np.uint64), 3 * segs, 3 * page, 2 * page)
    h = t.post_runs(Op.READ, peer.name, mixed)  # runs of two lengths: post's lists
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    t.release(h)
    t.disconnect(peer.name)


def test_handles_do_not_leak(peer: Peer, local: tuple[Any, np.ndarray]) -> None:
    t, buf = local
    t.connect(peer.name, peer.descriptor)
    rng = np.random.default_rng(3)
    outstanding: list[int] = []
    for i in range(2000):
        k = int(rng.integers(1, 8))
        off = rng.choice(buf.nbytes // 4096, k, replace=False).astype(np.uint64) * 4096
        h = t.post(
            Op.READ if i % 2 else Op.WRITE,
            peer.name,
            make_extents(buf.ctypes.data + off, 4096),
            make_extents(peer.addr + off, 4096),
        )
        outstanding.append(h)
        if len(outstanding) == 32:
            for h in outstanding:
                assert t.wait(h, TIMEOUT).status is XferStatus.DONE
                t.release(h)
            outstanding.clear()
    for h in outstanding:
        t.wait(h, TIMEOUT)
        t.release(h)
    assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 1}
    assert t.stats.transfers == 2000 and t.stats.failed == 0
    with pytest.raises(TransferError):
        t.poll(outstanding[0] if outstanding else 1)
    t.disconnect(peer.name)
    assert t._handle_counts()["peers"] == 0


def test_telemetry_shows_nixl_merging_adjacent_extents(peer: Peer) -> None:
    t = knixl.NixlTransport(_ctx(), {**OPTS, "telemetry": True})
    buf = np.zeros(1 << 20, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(peer.name, peer.descriptor)
        off = np.arange(64, dtype=np.uint64) * 4096  # 64 back-to-back extents on both sides
        lo = make_extents(buf.ctypes.data + off, 4096)
        h = t.post(Op.READ, peer.name, lo, make_extents(peer.addr + off, 4096))
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        (tel,) = t.xfer_telemetry(h)
        t.release(h)
        assert tel["bytes"] == 64 * 4096 and tel["descriptors"] == 1
        assert np.array_equal(buf[: 64 * 4096], peer.buffer()[: 64 * 4096])  # earlier tests wrote
        assert t.stats.descriptors == 64
    finally:
        t.close()


def _idle_peer(t: Any, seed: int, progress_interval: float) -> Peer:
    """A 1 MiB peer whose progress thread idles at ``progress_interval``, connected both ways."""
    p = Peer(f"peer-{uuid.uuid4().hex[:8]}", 1 << 20, seed=seed,
             opts={"progress_interval": progress_interval})
    try:
        t.connect(p.name, p.descriptor)
        assert p.call("connect", t.ctx.agent_name, t.descriptor()) == "ok"
    except BaseException:
        p.stop()
        raise
    return p


def test_reads_without_notification_never_wait_for_the_target(
    local: tuple[Any, np.ndarray],
) -> None:
    """What the worker relies on when it sends a READ's "done" over the side channel instead
    of attaching it: over cma a READ without a notification is copied inside the post call,
    so back-to-back READs finish without any progress of the target (idling at 1 s here).
    (After a NIXL notification the next transfer on the endpoint waits for that progress.)"""
    t, buf = local
    p = _idle_peer(t, seed=5, progress_interval=1.0)
    try:
        ref = p.reference()
        took = []
        for i in range(6):  # the first one does UCX's wire-up: not timed
            n = 64 << 10
            t0 = time.perf_counter()
            h = t.post(Op.READ, p.name, make_extents(buf.ctypes.data, n),
                       make_extents(p.addr + i * n, n))
            assert t.wait(h, TIMEOUT).status is XferStatus.DONE
            took.append(time.perf_counter() - t0)
            t.release(h)
            assert np.array_equal(buf[:n], ref[i * n : (i + 1) * n])
        assert max(took[1:]) < 0.2, took
    finally:
        p.stop()


def test_expect_access_serves_a_read_at_the_fast_cadence(
    local: tuple[Any, np.ndarray],
) -> None:
    """After a NIXL notification, the next transfer on that endpoint completes only once the
    TARGET's UCX worker has progressed (docs/nixl.md "Progress"). Here the target progresses
    every 0.2 s when idle: without the hint back-to-back READs with notifications wait up to
    0.2 s; after ``expect_access`` the target progresses every 50 us until the READ's
    notification, then goes back to idle."""
    t, buf = local
    p = _idle_peer(t, seed=11, progress_interval=0.2)
    try:
        ref = p.reference()
        warm = t.post(
            Op.READ,
            p.name,
            make_extents(buf.ctypes.data, 4096),
            make_extents(p.addr, 4096),
            notify=b"warm",
        )  # UCX wire-up, not timed
        assert t.wait(warm, TIMEOUT).status is XferStatus.DONE
        t.release(warm)
        assert p.call("notifs", 1)
        took = []
        for i in range(5):
            assert p.call("expect", 5.0, 1) == "ok"
            n = 256 << 10
            t0 = time.perf_counter()
            h = t.post(
                Op.READ,
                p.name,
                make_extents(buf.ctypes.data, n),
                make_extents(p.addr + i * n // 4, n),
                notify=b"r%d" % i,
            )
            assert t.wait(h, TIMEOUT).status is XferStatus.DONE
            took.append(time.perf_counter() - t0)
            t.release(h)
            assert np.array_equal(buf[:n], ref[i * n // 4 : i * n // 4 + n])
            assert p.call("notifs", 1) == [(t.ctx.agent_name, b"r%d" % i)]
        assert sorted(took)[2] < 0.01, took
        # the window closed with the notification: the next READ waits for the idle cadence
        slow = []
        for i in range(3):
            t0 = time.perf_counter()
            h = t.post(
                Op.READ,
                p.name,
                make_extents(buf.ctypes.data, 4096),
                make_extents(p.addr, 4096),
                notify=b"s%d" % i,
            )
            assert t.wait(h, TIMEOUT).status is XferStatus.DONE
            slow.append(time.perf_counter() - t0)
            t.release(h)
        assert p.call("notifs", 3)
        assert max(slow) > 0.01, slow
    finally:
        p.stop()


def test_the_progress_thread_leaves_an_owner_that_polls_alone(
    local: tuple[Any, np.ndarray],
) -> None:
    """An owner polling a transfer progresses UCX itself: the light progress thread (1 ms
    idle cadence here) then leaves the transport's lock alone — taking it made the owner's
    next poll wait for its NIXL call and two GIL hand-offs (a 4 MiB READ polled in a loop on
    one H200 host: 1.47 ms with the thread, 1.29 ms without). A READ after a notification
    waits for the target's progress (idle at 0.5 s here), so the owner polls it for a while:
    the thread drains at most one wake-up in nine meanwhile (it drained every one before)."""
    t, buf = local
    p = _idle_peer(t, seed=13, progress_interval=0.5)
    progress = t._progress
    assert progress is not None
    drains: list[float] = []
    drain = t._drain_notifs  # counted, not faked: the wrapper calls the real drain

    def counted() -> None:
        if threading.current_thread() is progress.thread:
            drains.append(time.monotonic())
        drain()

    t._drain_notifs = counted
    try:
        for attempt in range(5):
            h = t.post(Op.READ, p.name, make_extents(buf.ctypes.data, 4096),
                       make_extents(p.addr, 4096), notify=b"n%d" % attempt)
            t0 = time.monotonic()
            while t.poll(h).status is XferStatus.PENDING:
                assert time.monotonic() - t0 < TIMEOUT
            span = time.monotonic() - t0
            t.release(h)
            if span >= 0.1:  # the target's idle progress came late enough to judge
                break
        assert span >= 0.1, "every READ completed at once: nothing to judge"
        during = [d for d in drains if t0 < d < t0 + span]
        assert len(during) <= 2 + span / (9 * 0.001), (len(during), span)
    finally:
        t._drain_notifs = drain
        p.stop()


def test_peer_killed_mid_transfer_fails() -> None:
    # TCP makes RMA asynchronous (the peer serves it), so a 256 MiB READ is surely in flight
    os.environ["UCX_TLS"] = "tcp"
    try:
        p = Peer(f"victim-{uuid.uuid4().hex[:8]}", 256 << 20, seed=3, tls="tcp")
        t = knixl.NixlTransport(_ctx(), OPTS)
    finally:
        del os.environ["UCX_TLS"]
    buf = np.zeros(256 << 20, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(p.name, p.descriptor)
        h = t.post(
            Op.READ,
            p.name,
            make_extents(buf.ctypes.data, buf.nbytes),
            make_extents(p.addr, p.nbytes),
            notify=b"never",
        )
        p.kill()
        t0 = time.monotonic()
        state = t.wait(h, TIMEOUT)
        assert state.status is XferStatus.FAILED, state
        assert time.monotonic() - t0 < TIMEOUT
        t.release(h)
        # posting to the dead peer fails too (at post or on the first poll), never hangs
        h = t.post(Op.READ, p.name, make_extents(buf.ctypes.data, 4096), make_extents(p.addr, 4096))
        assert t.wait(h, TIMEOUT).status is XferStatus.FAILED
        t.release(h)
        assert t.stats.failed == 2
        assert t._handle_counts()["nixl_requests"] == 0
    finally:
        t.close()
        p.stop()


def test_dead_peer_default_transports() -> None:
    p = Peer(f"victim-{uuid.uuid4().hex[:8]}", 1 << 20, seed=4)
    t = knixl.NixlTransport(_ctx(), OPTS)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(p.name, p.descriptor)
        p.kill()
        h = t.post(
            Op.READ,
            p.name,
            make_extents(buf.ctypes.data, buf.nbytes),
            make_extents(p.addr, p.nbytes),
        )
        assert t.wait(h, TIMEOUT).status is XferStatus.FAILED
        t.release(h)
        t.disconnect(p.name)
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 0}
    finally:
        t.close()
        p.stop()


def test_a_peer_dead_after_its_connection_was_up_does_not_abort_us() -> None:
    """Old code: with UCX's keepalive on (its default), an endpoint whose peer died holding a
    keepalive queued asserted as the agent was destroyed (``arbiter.c:36 Assertion
    `ucs_arbiter_group_is_empty(group)' failed``) and SIGABRT took the whole process — 5 of 8
    processes running these two tests four times, one CI run of the suite. kvlink turns UCX's
    keepalive off (kvlink_transports._ucx.env). The two tests above, six times, in a process
    of their own: it must exit 0, its dead peers' transfers failed as before."""
    code = ("import gc, test_nixl_transport as t\n"
            "for _ in range(6):\n"
            "    t.test_peer_killed_mid_transfer_fails(); gc.collect()\n"
            "    t.test_dead_peer_default_transports(); gc.collect()\n"
            "print('survived', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_KEEPALIVE_INTERVAL"}
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "survived" in run.stdout, (run.returncode,
                                                              run.stderr[-2000:])


def test_restarted_peer_same_name_gets_new_metadata(local: tuple[Any, np.ndarray]) -> None:
    t, buf = local
    name = f"restart-{uuid.uuid4().hex[:8]}"
    n = 1 << 20
    old = Peer(name, n, seed=11)
    new: Peer | None = None
    try:
        t.connect(name, old.descriptor)
        t.connect(name, old.descriptor)  # same descriptor again: no-op
        lo, ro = make_extents(buf.ctypes.data, n), make_extents(old.addr, n)
        h = t.post(Op.READ, name, lo, ro)
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(buf[:n], old.reference())
        stale = t.post(Op.READ, name, lo, ro)  # left unreleased across the restart
        old.kill()

        new = Peer(name, n, seed=12)  # same agent name, new process, new bytes
        assert new.descriptor != old.descriptor
        t.connect(name, new.descriptor)
        assert t.poll(stale).status in (XferStatus.DONE, XferStatus.FAILED)
        t.release(stale)
        buf[:n] = 0
        h = t.post(Op.READ, name, make_extents(buf.ctypes.data, n), make_extents(new.addr, n))
        assert t.wait(h, TIMEOUT).status is XferStatus.DONE
        t.release(h)
        assert np.array_equal(buf[:n], new.reference())
        # the old process's offer is gone: its range is checked against the NEW region table
        if not (new.addr <= old.addr and old.addr + n <= new.addr + n):
            with pytest.raises(ExtentOutOfBounds):
                t.post(Op.READ, name, lo, ro)
        assert t._handle_counts() == {"xfers": 0, "nixl_requests": 0, "zombies": 0, "peers": 1}
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_descriptor_decoding_is_strict(local: tuple[Any, np.ndarray]) -> None:
    t, _ = local
    good = msgspec.msgpack.decode(t.descriptor())
    assert good["v"] == 1 and good["agent"] == t.ctx.agent_name and len(good["regions"]) == 1
    with pytest.raises(WireError):
        t.connect("x", b"\x00garbage")
    with pytest.raises(WireVersionError):
        t.connect("x", msgspec.msgpack.encode({**good, "v": 2}))
    with pytest.raises(WireError):
        t.connect("x", msgspec.msgpack.encode({**good, "extra": 1}))
    with pytest.raises(WireError):
        t.connect("x", msgspec.msgpack.encode({**good, "regions": [[0, 10, "cpu"]]}))
    with pytest.raises(WireError):
        t.connect("x", msgspec.msgpack.encode({**good, "regions": [[4096, 10, "tpu:0"]]}))
    assert t.unreachable_reason(msgspec.msgpack.encode({**good, "backends": ["GDS"]}), True)
    assert t.unreachable_reason(t.descriptor(), True) is None


def test_missing_nixl_is_transport_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: nixl IS installed here, so a missing library can only be simulated —
    the import hook below is the one fake in this file, and it fakes nothing but that fault."""
    import builtins

    from kvlink.errors import TransportUnavailable

    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "nixl" or name.startswith("nixl."):
            raise ImportError("No module named 'nixl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(TransportUnavailable, match="pip install"):
        knixl.NixlTransport(_ctx())


def test_cross_host_tcp_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    from kvlink_transports import _ucx

    if _ucx.ucx_info_path() is None:
        pytest.skip("ucx_info not found (pip install --no-deps libucx-cu12)")
    knixl.agent._warned.clear()
    mk = [
        knixl.NixlTransport(
            TransportContext(agent_name=f"h{i}-{uuid.uuid4().hex[:6]}", host_id=f"host-{i}")
        )
        for i in range(3)
    ]
    bufs = [np.zeros(4096, np.uint8) for _ in mk]
    try:
        for t, b in zip(mk, bufs, strict=True):
            t.register([Region(b.ctypes.data, b.nbytes)])
        with caplog.at_level("INFO", logger="kvlink.nixl"):
            mk[0].connect("p1", mk[1].descriptor())
            mk[0].connect("p2", mk[2].descriptor())
            assert mk[0].wait_probes(120)  # ucx_info runs off the connect path
        warns = [r for r in caplog.records if r.levelname == "WARNING" and "TCP" in r.message]
        expect = 1 if _ucx.tcp_fallback_between_hosts() else 0
        assert len(warns) == expect, [r.message for r in caplog.records]
        assert any("UCX RMA predicted over" in r.message for r in caplog.records)
    finally:
        for t in mk:
            t.close()


def test_parse_proto_info() -> None:
    from kvlink_transports import _ucx

    text = """
[1.0] [vm:1 :0]   | a self cfg#0                                        |
[1.0] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1 :0]   | 0..inf | zero-copy   | self/memory                        |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | a intra-node cfg#1                                  |
[1.0] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | 0..inf | zero-copy   | cma/memory                        |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [vm:1 :0]   |      0..8184 | short              | tcp/lo        |
[1.0] [vm:1 :0]   |    8185..inf | zero-copy          | 52% on tcp/lo and 48% on tcp/eth0 |
"""
    assert _ucx.parse_proto_info(text) == {
        "read": ["cma/memory"],
        "write": ["tcp/lo", "52% on tcp/lo and 48% on tcp/eth0"],
    }


class _PendingStream:
    """A STAND-IN for the caller's CUDA stream with work still queued (this machine has no
    GPU, and a real stream's timing cannot be held open on demand): the transport's marks
    report the work unfinished until ``finish()``. Everything else is real NIXL over UCX."""

    def __init__(self) -> None:
        self.ran = False
        self.taken = self.dropped = 0

    def take(self) -> object:
        self.taken += 1
        return object()

    def reached(self, mark: object) -> bool:
        return self.ran

    def drop(self, mark: object) -> None:
        self.dropped += 1

    def finish(self) -> None:
        self.ran = True


def test_a_post_waits_for_the_callers_stream_before_nixl_moves_a_byte(
    peer: Peer, local: tuple[Any, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stream order (the transport contract's rule 6): a WRITE whose source the caller's
    stream is still writing is handed to NIXL only once that stream ran — polls before that
    leave the peer's bytes untouched; then it moves, and the peer holds what the caller wrote
    after the post. (Before: NIXL copied at post — a layer-wise push over NIXL on one H200
    landed 82.8M of 83.9M elements wrong.) A post released while it waits moves nothing."""
    t, buf = local
    t.connect(peer.name, peer.descriptor)
    assert peer.call("connect", t.ctx.agent_name, t.descriptor()) == "ok"
    stream = _PendingStream()
    monkeypatch.setattr(t, "_marks", stream)
    # no VRAM to register here: the post is taken for one touching VRAM (fault injection)
    monkeypatch.setattr(t, "_stream_mark", lambda li: stream.take())
    before = peer.buffer().copy()
    n = 1 << 20
    lo = make_extents(np.array([buf.ctypes.data], dtype=np.uint64), np.array([n], np.uint64))
    ro = make_extents(np.array([peer.addr], dtype=np.uint64), np.array([n], np.uint64))
    buf[:n] = 1  # what the caller's stream had written at the post...
    h = t.post(Op.WRITE, peer.name, lo, ro)
    for _ in range(20):
        assert t.poll(h).status is XferStatus.PENDING
    assert np.array_equal(peer.buffer(), before)  # nothing moved while the stream ran
    buf[:n] = 7  # ...and what it wrote before it ended: the bytes the WRITE must carry
    stream.finish()
    assert t.wait(h, TIMEOUT).status is XferStatus.DONE
    t.release(h)
    assert np.array_equal(peer.buffer()[:n], np.full(n, 7, np.uint8))
    assert stream.dropped == 1  # its mark went back
    stream.ran = False
    h = t.post(Op.WRITE, peer.name, lo, make_extents(
        np.array([peer.addr + n], dtype=np.uint64), np.array([n], np.uint64)))
    t.release(h)  # released while waiting: nothing was handed to NIXL
    assert stream.dropped == 2
    assert np.array_equal(peer.buffer()[n:2 * n], before[n:2 * n])


def test_prepped_blocks_of_a_size_not_a_power_of_two_move_the_right_bytes() -> None:
    """prep_block_bytes 3000: an extent at offset 8 is not made of whole prepped blocks (it
    goes the per-request way). Before, its alignment test OR-ed offset and length (a shortcut
    that holds for powers of two only): 8 | 3000 = 3000 mapped it onto block 0, the READ was
    DONE with the wrong bytes, and 8 bytes landed before the extent."""
    o = {"ucx_probe": False, "prep_block_bytes": 3000}
    peer = f"np2b-{uuid.uuid4().hex[:6]}"
    a = create_transport("nixl", TransportContext(agent_name=f"np2a-{uuid.uuid4().hex[:6]}"), o)
    b = create_transport("nixl", TransportContext(agent_name=peer), o)
    n = 30000
    dst = np.zeros(n, np.uint8)
    src = np.random.default_rng(1).integers(1, 256, n, dtype=np.uint8)
    try:
        a.register([Region(dst.ctypes.data, n)])
        b.register([Region(src.ctypes.data, n)])
        a.connect(peer, b.descriptor())
        for off, length in ((8, 3000), (24, 2976), (3000, 6000)):
            dst[:] = 0
            h = a.post(Op.READ, peer, make_extents(dst.ctypes.data + off, length),
                       make_extents(src.ctypes.data + off, length))
            assert a.wait(h, 10).status is XferStatus.DONE
            assert np.array_equal(dst[off:off + length], src[off:off + length]), (off, length)
            assert not dst[:off].any() and not dst[off + length:].any(), (off, length)
            a.release(h)
    finally:
        a.close()
        b.close()


def test_a_prep_block_given_in_tokens_is_refused_naming_its_unit() -> None:
    """Old code: an explicit ``prep_block_bytes`` was taken whatever it made of the memory: 16
    (a KV block's tokens, not its bytes) cut a 10 GiB cache into 671M descriptors, prepped at
    register. Now a block that makes more than ``prep_max_descriptors`` is refused there,
    before NIXL registers anything, naming the option, the count and its unit; the KV block's
    bytes are taken."""
    buf = np.zeros(1 << 20, dtype=np.uint8)
    t = knixl.NixlTransport(_ctx(), {**OPTS, "prep_block_bytes": 16, "prep_max_descriptors": 4096})
    try:
        with pytest.raises(ConfigError, match=r"prep_block_bytes=16 cuts 1048576 registered "
                                              r"bytes into 65536 descriptors.*in bytes"):
            t.register([Region(buf.ctypes.data, buf.nbytes)])
        assert t._reg_dlists == []
    finally:
        t.close()
    t = knixl.NixlTransport(_ctx(), {**OPTS, "prep_block_bytes": 4096,
                                     "prep_max_descriptors": 4096})
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        assert 4096 in t._lpreps
    finally:
        t.close()
