"""The tcp transport's byte movers on a real socket pair: many scattered buffers, small socket
buffers (so every call moves part of its window and stops inside a buffer), each byte where
it belongs on the other side."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvlink_transports.tcp.memory import _WINDOW, _recv_views, _send_views


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
    a, b = socket.socketpair()
    try:
        for s in (a, b):  # small buffers: calls stop inside a buffer, windows move on
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        # the receiver scatters into other cut points than the sender gathers from
        recv_sizes = rng.integers(1, 5000, size=2 * total // 5000 + 8).tolist()
        cut = np.cumsum(recv_sizes)
        recv_sizes = [int(x) for x in np.diff(np.concatenate(([0], cut[cut < total], [total])))]
        sender = threading.Thread(target=_send_views, args=(a, [_views(src, sizes)]))
        sender.start()
        views = _views(dst, recv_sizes)
        _recv_views(b, [views[:len(views) // 2], views[len(views) // 2:]])  # two batches
        sender.join(10)
        assert not sender.is_alive()
    finally:
        a.close()
        b.close()
    assert np.array_equal(src, dst)
