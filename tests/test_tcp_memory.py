"""The tcp transport's byte movers on a real socket pair: many scattered buffers, small socket
buffers (so every call moves part of its window and stops inside a buffer), each byte where
it belongs on the other side."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvlink import native
from kvlink.transport import Region, make_extents
from kvlink_transports.tcp import memory
from kvlink_transports.tcp.memory import _WINDOW, _recv_views, _send_views
from kvlink_transports.tcp.wire import _PeerGone


def _views(buf: np.ndarray, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    mv = buf.data  # a memoryview of the array
    for n in sizes:
        out.append(mv[at:at + n])
        at += n
    return out


def test_scattered_buffers_cross_windows_and_partial_calls() -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 9000, size=5 * _WINDOW + 3).tolist()
    total = sum(sizes)
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    # the receiver scatters into other cut points than the sender gathers from
    recv_sizes = rng.integers(1, 5000, size=2 * total // 5000 + 8).tolist()
    cut = np.cumsum(recv_sizes)
    recv_sizes = [int(x) for x in np.diff(np.concatenate(([0], cut[cut < total], [total])))]
    views = _views(dst, recv_sizes)
    _across(lambda a: _send_views(a, [_views(src, sizes)]),
            lambda b: _recv_views(b, [views[:len(views) // 2], views[len(views) // 2:]]))
    assert np.array_equal(src, dst)


def test_empty_extents_move_nothing_and_end() -> None:
    """Extents of 0 bytes (last, first, between) through the Python movers (where kvlink's C
    helpers are not built — the path they replace, not a fake): every byte of the others
    arrives and both sides end. Before, a batch of only empty buffers made the sender's
    sendmsg return 0 for ever (a thread spinning at 100 % until the connection closed; a
    WRITE past its timeout) and the receiver's a read of 0, taken as the peer's close."""
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    mems = []
    for buf in (src, dst):
        mem = memory._Memory([Region(buf.ctypes.data, buf.nbytes)])
        mem.native = None
        mems.append(mem)
    offsets, sizes = [0, 0, 16, 16, 48, 64], [0, 16, 0, 32, 16, 0]

    def ext(buf: np.ndarray) -> np.ndarray:
        return make_extents([buf.ctypes.data + o for o in offsets], sizes)

    stopped = threading.Event()
    a, b = socket.socketpair()
    try:
        b.settimeout(5)
        sender = threading.Thread(target=mems[0].move, args=(a, ext(src), True, stopped.is_set),
                                  daemon=True)
        sender.start()
        mems[1].move(b, ext(dst), False, None)
        sender.join(5)
        assert not sender.is_alive(), "the sender did not end"
    finally:
        stopped.set()  # (ends a spinning sender at its next call)
        a.close()
        b.close()
    assert np.array_equal(src, dst)


def _across(send: Callable[[socket.socket], None], recv: Callable[[socket.socket], None],
            timeout: float | None = None) -> None:
    """``send`` on one end of a socket pair (on a thread of its own), ``recv`` on the other;
    small socket buffers, so every call stops inside a buffer and windows move on."""
    a, b = socket.socketpair()
    try:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        b.settimeout(timeout)
        sender = threading.Thread(target=send, args=(a,))
        sender.start()
        recv(b)
        sender.join(10)
        assert not sender.is_alive()
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------ the C helper (kvlink.native)
def _helpers() -> Any:
    mod = native.load()
    if mod is None:
        pytest.skip(f"kvlink's C helpers are not built here: {native.why_not()}")
    return mod


def _extents(buf: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Extents of ``buf`` cut at ``sizes`` (zero sizes kept: empty extents)."""
    base = int(buf.__array_interface__["data"][0])
    off = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
    return make_extents(base + off, np.asarray(sizes, dtype=np.uint64))


@pytest.mark.parametrize("stop", [None, "never"], ids=["unbounded", "asks-stop"])
def test_the_c_mover_scatters_and_gathers_like_the_views(monkeypatch: pytest.MonkeyPatch,
                                                         stop: str | None) -> None:
    """Both sides through move_extents, with empty extents among them, small socket buffers
    and (asks-stop) a budget of a few KiB a call: each call stops inside an extent and the
    next resumes at its byte; a non-blocking socket (a Python timeout) waits in poll()."""
    _helpers()
    # not a fake: a smaller setting of kvlink's own budget, so one transfer takes many calls
    monkeypatch.setattr(memory, "_STOP_EVERY", 3000)
    rng = np.random.default_rng(11)
    sizes = rng.integers(0, 9000, size=3 * 1024 + 5).tolist()  # more than one iovec window
    sizes[0], sizes[-1] = 0, 0
    total = sum(sizes)
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    recv_sizes = [int(x) for x in np.diff(np.unique(np.concatenate((
        [0, total], rng.integers(0, total, size=total // 4000)))))]
    table = memory._Memory([Region(int(src.__array_interface__["data"][0]), total),
                            Region(int(dst.__array_interface__["data"][0]), total)])
    asks = (lambda: False) if stop else None
    _across(lambda a: table.move(a, _extents(src, sizes), True, asks),
            lambda b: table.move(b, _extents(dst, recv_sizes), False, asks), timeout=10.0)
    assert np.array_equal(src, dst)


def test_the_c_mover_says_closed_timed_out_and_stopped() -> None:
    """A peer that closes mid-transfer is _PeerGone (not a short read taken as done); a
    silent one is a TimeoutError after the socket's timeout; ``stop`` ends it between calls."""
    _helpers()
    dst = np.zeros(1 << 16, dtype=np.uint8)
    table = memory._Memory([Region(int(dst.__array_interface__["data"][0]), dst.nbytes)])
    ext = _extents(dst, [1 << 15, 1 << 15])
    a, b = socket.socketpair()
    try:
        a.sendall(b"x" * 100)
        a.close()
        with pytest.raises(_PeerGone, match="closed by peer"):
            table.move(b, ext, False, None)
        assert dst[:100].tolist() == [ord("x")] * 100
    finally:
        b.close()
    a, b = socket.socketpair()
    try:
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            table.move(b, ext, False, None)
        with pytest.raises(_PeerGone, match="revoked"):
            table.move(b, ext, False, lambda: True)
    finally:
        a.close()
        b.close()


def test_a_resumed_call_refuses_a_position_outside_the_extents() -> None:
    helpers = _helpers()
    buf = np.zeros(64, dtype=np.uint8)
    ext = _extents(buf, [32, 32])
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="outside"):
            helpers.move_extents(b.fileno(), False, ext, 1, 33, 1 << 20, 100)
        with pytest.raises(ValueError, match="outside"):
            helpers.move_extents(b.fileno(), False, ext, 3, 0, 1 << 20, 100)
        with pytest.raises(ValueError, match="pairs"):
            helpers.move_extents(b.fileno(), False, memoryview(b"x" * 24), 0, 0, 1 << 20, 100)
        assert helpers.move_extents(b.fileno(), False, ext, 2, 0, 1 << 20, 100) == (2, 0)
    finally:
        a.close()
        b.close()
