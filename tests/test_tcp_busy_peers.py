"""tcp serves and takes a READ, and takes a push's WRITE, while its process's own Python is busy.

tcp's threads are Python threads: each time one of them comes back from a socket call it
takes the GIL back, and where the process's own thread is busy in Python that waits up to a
switch interval (5 ms by default). The owner's serving thread came back from five socket
calls before a READ's bytes left (the header's first byte, its length, its body, the timeout
reset, the answer), the reader's thread from three before the bytes were in; a prefill busy in
Python for 20 ms turned a 5 ms 16-block READ into 17-18 ms (bench/busy_peers.py). Then kvlink's
C helper read a request's header in one call and sent the answer with the bytes in one call
(one wait); now the owner's serving thread serves a READ of host memory in C from its header
to its last byte, checked against the grant gate there, and takes the GIL for none of it. The
reader takes the answer with the bytes in one call, which marks the READ landed for the
caller's poll before that thread waits for the GIL.

Real processes, the real transport on 127.0.0.1; the busy owner's Python is a loop, with its
switch interval raised to 0.25 s so that each wait for the GIL is a quarter second, far above
the bytes' time: the READ's time counts the waits.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvlink import native
from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink_transports.tcp import TcpTransport

INTERVAL = 0.25  # the busy process's switch interval, seconds
SIZE = 4 << 20  # the owner's memory; a READ takes 64 extents of 16 KiB from it
BUSY = 3.0  # seconds a busy process's own Python runs


def _extents(base: int, order: np.ndarray) -> Any:
    return make_extents(np.asarray(base + order * (16 << 10), dtype=np.uint64),
                        np.full(order.shape[0], 16 << 10, dtype=np.uint64))


TICKET = b"busy-owner-ticket"


def _owner(q: Any, go: Any, busy: Any, grants: bool) -> None:
    """The owner: its memory registered (and, with ``grants``, granted to the reader's
    ticket), then its main thread in Python (``busy`` set as it starts)."""
    src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    t = TcpTransport(TransportContext("owner", require_grants=grants))
    t.register([Region(src.ctypes.data, SIZE)])
    t.grant(TICKET, Op.READ, make_extents(src.ctypes.data, SIZE))
    q.put((t.descriptor(), src.ctypes.data))
    go.get()
    sys.setswitchinterval(INTERVAL)
    busy.set()
    end, x = time.monotonic() + BUSY, 0
    while time.monotonic() < end:
        x += 1  # a forward's Python
    go.get()
    t.close()


def _read_while_the_owner_is_busy(grants: bool = False) -> float:
    """Seconds a 64-extent READ took to be DONE (the reader's transport's own count) while
    the owner's main thread runs Python."""
    ctx = mp.get_context("spawn")
    q, go, busy = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_owner, args=(q, go, busy, grants), daemon=True)
    child.start()
    dst = np.zeros(SIZE, dtype=np.uint8)
    reader = TcpTransport(TransportContext("reader"))
    try:
        desc, far = q.get(timeout=60)
        reader.register([Region(dst.ctypes.data, SIZE)])
        reader.connect("owner", desc)
        order = np.random.default_rng(0).permutation(SIZE // (16 << 10))[:64]
        warm = reader.post(Op.READ, "owner", _extents(dst.ctypes.data, order[:1]),
                           _extents(far, order[:1]), ticket=TICKET)  # the connection opened
        assert reader.wait(warm, 30).status is XferStatus.DONE
        reader.release(warm)
        go.put("busy")
        assert busy.wait(30), "the owner did not start its loop"  # (the READ lands in it)
        before = reader.stats.xfer_seconds
        h = reader.post(Op.READ, "owner", _extents(dst.ctypes.data, order),
                        _extents(far, order), ticket=TICKET)
        assert reader.wait(h, 30).status is XferStatus.DONE
        took = reader.stats.xfer_seconds - before
        src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
        for k in order:
            at = int(k) * (16 << 10)
            assert np.array_equal(dst[at:at + (16 << 10)], src[at:at + (16 << 10)])
        return took
    finally:
        reader.close()
        go.put("stop")
        go.put("stop")
        child.join(10)
        if child.is_alive():
            child.kill()


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.load() is not None, f"kvlink's C helpers did not build: {native.why_not()}"


@pytest.mark.parametrize("grants", [False, True], ids=["open", "require_grants"])
def test_a_busy_owner_serves_a_read_without_waiting_for_the_gil(grants: bool) -> None:
    """The owner's serving thread serves the READ in C, the grant checked there too: it
    waits for the GIL not once (the READ takes milliseconds, not a quarter second). On the
    code before it waited once (0.25-0.27 s), and before that 2-4 times."""
    took = _read_while_the_owner_is_busy(grants)
    assert took < INTERVAL / 2, f"{took:.3f} s: the owner waited for the GIL ({INTERVAL} s)"


def test_a_read_is_done_once_its_bytes_landed_though_its_thread_has_not_run_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ taken by the peer's thread in Python (the first on a connection: the thread
    opens it) is marked landed by the C helper before that thread takes the GIL back, and
    ``poll()`` reads the mark and finishes the READ itself, on the caller's thread. Here the
    peer's thread is held after the bytes landed, before its own bookkeeping (a spy on
    ``_finish``, for calls from that thread only: the real one runs once released; it stands
    in for the wait for the GIL, which cannot be made to last on demand): the READ is DONE
    meanwhile, every byte in, and its record says so. On the code before last, DONE was that
    bookkeeping: the READ stayed PENDING while it was held (5 s here)."""
    let_go = threading.Event()
    real = TcpTransport._finish

    def finish_later(self: TcpTransport, xfer: Any, state: Any) -> None:
        if (state.status is XferStatus.DONE and self.ctx.agent_name == "reader"
                and threading.current_thread().name.startswith("kvlink-tcp-")):
            let_go.wait(10)
        real(self, xfer, state)

    monkeypatch.setattr(TcpTransport, "_finish", finish_later)
    src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    owner = TcpTransport(TransportContext("owner"))
    reader = TcpTransport(TransportContext("reader"))
    try:
        owner.register([Region(src.ctypes.data, SIZE)])
        reader.register([Region(dst.ctypes.data, SIZE)])
        reader.connect("owner", owner.descriptor())
        order = np.random.default_rng(1).permutation(SIZE // (16 << 10))[:64]
        h = reader.post(Op.READ, "owner", _extents(dst.ctypes.data, order),
                        _extents(src.ctypes.data, order))
        st = reader.wait(h, 5)
        assert st.status is XferStatus.DONE, f"not DONE while its thread was held: {st.reason}"
        assert reader._xfers[h].state.status is XferStatus.DONE  # (finished by the poll)
        assert not let_go.is_set()
        for k in order:
            at = int(k) * (16 << 10)
            assert np.array_equal(dst[at:at + (16 << 10)], src[at:at + (16 << 10)])
    finally:
        let_go.set()
        reader.close()
        owner.close()


def _parked(t: TcpTransport, peer: str) -> None:
    """Wait until ``t``'s thread for ``peer`` parks in C (once its connection is open)."""
    p = t._peers[peer]
    with p.cv:
        assert p.cv.wait_for(lambda: p.parked, 10)


def _posted_and_polled_busy(t: TcpTransport, post: Any) -> tuple[list[Any], float]:
    """``post()``'s handles posted with the switch interval raised, then polled in a loop of
    Python that gives the GIL up nowhere (a serving loop's Python between polls): their
    states and the seconds until none was PENDING."""
    was = sys.getswitchinterval()
    sys.setswitchinterval(INTERVAL)
    try:
        t0 = time.perf_counter()
        hs = post()
        while (any(t.poll(h).status is XferStatus.PENDING for h in hs)
               and time.perf_counter() - t0 < 10):
            pass
        took = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(was)
    return [t.poll(h) for h in hs], took


def _same_blocks(got: np.ndarray, want: np.ndarray, blocks: Any) -> bool:
    return all(np.array_equal(got[k * (16 << 10):(k + 1) * (16 << 10)],
                              want[k * (16 << 10):(k + 1) * (16 << 10)])
               for k in map(int, blocks))


def test_reads_polled_by_a_busy_caller_need_no_thread_of_either_side_to_run_python() -> None:
    """Owner and reader in this process, whose main thread posts two READs and polls them in a
    loop of Python — holding the GIL, which it gives up only when another thread has waited
    a switch interval (0.25 s here) for it. The owner serves each READ in C
    (``serve_frames``); the reader's thread, parked in C on its inbox once the connection is
    open, takes both answers and their bytes there (both headers sent by the caller as it
    posted) and marks each READ landed; the poll finishes them. So the READs take
    milliseconds. On the code before, the reader's thread came back to Python between the
    two READs (to send the second's header) and each of the owner's requests did: a quarter
    second at least, each time."""
    src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    owner = TcpTransport(TransportContext("owner", require_grants=True))
    reader = TcpTransport(TransportContext("reader"), {"reader_in_c": True})
    try:
        owner.register([Region(src.ctypes.data, SIZE)])
        owner.grant(TICKET, Op.READ, make_extents(src.ctypes.data, SIZE))
        reader.register([Region(dst.ctypes.data, SIZE)])
        reader.connect("owner", owner.descriptor())
        order = np.random.default_rng(2).permutation(SIZE // (16 << 10))[:64]
        warm = reader.post(Op.READ, "owner", _extents(dst.ctypes.data, order[:1]),
                           _extents(src.ctypes.data, order[:1]), ticket=TICKET)
        assert reader.wait(warm, 10).status is XferStatus.DONE  # (the connection opened)
        _parked(reader, "owner")
        dst[:] = 0
        states, took = _posted_and_polled_busy(reader, lambda: [
            reader.post(Op.READ, "owner", _extents(dst.ctypes.data, part),
                        _extents(src.ctypes.data, part), ticket=TICKET)
            for part in (order[:32], order[32:])])
        assert all(st.status is XferStatus.DONE for st in states), states
        assert took < INTERVAL / 2, f"{took:.3f} s: a thread waited for the GIL ({INTERVAL} s)"
        assert _same_blocks(dst, src, order)
    finally:
        reader.close()
        owner.close()


def test_a_push_posted_by_a_busy_caller_needs_no_thread_to_run_python() -> None:
    """A prefill pushing: two WRITEs (the second with its notification) and a READ of what
    the first wrote, posted back to back by this process's main thread, which then polls in a
    loop of Python (the GIL given up only to a thread that waited a switch interval, 0.25 s
    here, for it). The writer's thread, parked in C on its inbox, sends each WRITE's header
    and bytes and takes its answer there, then sends the READ's header (queued behind them)
    and takes its bytes; the owner serves all three in C. So the push takes milliseconds. On
    the code before, the WRITEs were the writer's thread's Python: a quarter second at least.
    The READ sees the first WRITE's bytes: a peer's transfers run in the order posted."""
    src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    back = np.zeros(SIZE, dtype=np.uint8)
    far = np.zeros(SIZE, dtype=np.uint8)
    owner = TcpTransport(TransportContext("decode", require_grants=True))
    writer = TcpTransport(TransportContext("prefill"), {"reader_in_c": True})
    try:
        owner.register([Region(far.ctypes.data, SIZE)])
        owner.grant(TICKET, Op.WRITE, make_extents(far.ctypes.data, SIZE))
        owner.grant(TICKET + b"-read", Op.READ, make_extents(far.ctypes.data, SIZE))
        writer.register([Region(src.ctypes.data, SIZE), Region(back.ctypes.data, SIZE)])
        writer.connect("decode", owner.descriptor())
        warm = writer.post(Op.WRITE, "decode", make_extents(src.ctypes.data, 16 << 10),
                           make_extents(far.ctypes.data, 16 << 10), ticket=TICKET)
        assert writer.wait(warm, 10).status is XferStatus.DONE  # (the connection opened)
        _parked(writer, "decode")
        far[:] = 0
        order = np.random.default_rng(3).permutation(SIZE // (16 << 10))[:64]
        first, second = order[:32], order[32:]
        states, took = _posted_and_polled_busy(writer, lambda: [
            writer.post(Op.WRITE, "decode", _extents(src.ctypes.data, first),
                        _extents(far.ctypes.data, first), ticket=TICKET),
            writer.post(Op.WRITE, "decode", _extents(src.ctypes.data, second),
                        _extents(far.ctypes.data, second), notify=b"pushed", ticket=TICKET),
            writer.post(Op.READ, "decode", _extents(back.ctypes.data, first),
                        _extents(far.ctypes.data, first), ticket=TICKET + b"-read")])
        assert all(st.status is XferStatus.DONE for st in states), states
        assert took < INTERVAL / 2, f"{took:.3f} s: a thread waited for the GIL ({INTERVAL} s)"
        assert _same_blocks(far, src, order)
        assert _same_blocks(back, src, first)  # read back after the WRITE that put them there
        assert owner.notifications() == [("prefill", b"pushed")]
    finally:
        writer.close()
        owner.close()


def _decode(q: Any, go: Any) -> None:
    """A decode taking a push: its memory granted to the writer's ticket for WRITEs, then its
    main thread in Python, looking for the push's notification between slices (a step loop
    that polls): when it saw it (``time.monotonic``, one clock for both processes) and
    whether the bytes were in by then."""
    dst = np.zeros(SIZE, dtype=np.uint8)
    t = TcpTransport(TransportContext("decode", require_grants=True))
    t.register([Region(dst.ctypes.data, SIZE)])
    t.grant(TICKET, Op.WRITE, make_extents(dst.ctypes.data, SIZE))
    q.put((t.descriptor(), dst.ctypes.data))
    go.get()
    notes: list[tuple[str, bytes]] = []
    while not notes:  # the warm-up WRITE's note
        notes = t.notifications()
    sys.setswitchinterval(INTERVAL)
    q.put("busy")
    end, seen = time.monotonic() + BUSY, 0.0
    while time.monotonic() < end and not seen:
        notes = t.notifications()  # (a C call: holds the GIL throughout)
        seen = time.monotonic() if notes else 0.0
    want = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    q.put((seen, notes, bool(np.array_equal(dst, want))))
    go.get()
    t.close()


def test_a_busy_decode_takes_a_push_and_its_notification_without_waiting_for_the_gil() -> None:
    """A WRITE with its notification (a push's last) into a decode whose main thread runs
    Python: the decode's serving thread takes the bytes, answers and queues the notification
    in C (``serve_frames``, kvlink/_notes.c), so the writer's WRITE is DONE, and the decode's
    own loop sees the notification, within milliseconds rather than the quarter second of a
    wait for its GIL. On the code before, WRITEs and notifications were served in Python:
    the writer waited for that thread's GIL, and the decode's loop for the note."""
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_decode, args=(q, go), daemon=True)
    child.start()
    src = (np.arange(SIZE, dtype=np.uint64) % 251).astype(np.uint8)
    writer = TcpTransport(TransportContext("writer"))
    try:
        desc, far = q.get(timeout=60)
        writer.register([Region(src.ctypes.data, SIZE)])
        writer.connect("decode", desc)
        whole = make_extents(src.ctypes.data, 16 << 10)
        warm = writer.post(Op.WRITE, "decode", whole, make_extents(far, 16 << 10),
                           notify=b"warm", ticket=TICKET)  # (the connection opened)
        assert writer.wait(warm, 30).status is XferStatus.DONE
        writer.release(warm)
        go.put("go")
        assert q.get(timeout=30) == "busy"
        before, t_post = writer.stats.xfer_seconds, time.monotonic()
        h = writer.post(Op.WRITE, "decode", make_extents(src.ctypes.data, SIZE),
                        make_extents(far, SIZE), notify=b"pushed", ticket=TICKET)
        assert writer.wait(h, 30).status is XferStatus.DONE
        took = writer.stats.xfer_seconds - before
        seen, notes, landed = q.get(timeout=30)
        assert notes == [("writer", b"pushed")] and landed
        assert took < INTERVAL / 2, f"WRITE {took:.3f} s: the decode waited for the GIL"
        assert seen - t_post < INTERVAL / 2, \
            f"note seen after {seen - t_post:.3f} s: the decode's thread waited for the GIL"
    finally:
        writer.close()
        go.put("stop")
        child.join(10)
        if child.is_alive():
            child.kill()
