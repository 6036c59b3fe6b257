"""Host-buffer staging: chunking, the bounded pool, and the pipeline over real tcp transfers.

Host memory stands in for device memory (``stage_host_memory``): the same cut/gather/send/
receive/scatter pipeline and pool run as for VRAM; the GPU half is scripts/gpu_staging_check.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink import staging
from kvlink.errors import TransferError
from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink_transports.tcp import TcpTransport


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(1, 3000))
def test_cut_stream_exact_chunks_same_bytes(lens: list[int], chunk: int) -> None:
    src = np.random.default_rng(len(lens)).integers(0, 256, sum(lens) * 2 + 16, dtype=np.uint8)
    base = int(src.__array_interface__["data"][0])
    offs = np.cumsum([0, *lens[:-1]]) * 2 if lens else np.zeros(0, dtype=np.int64)
    ext = make_extents(base + np.asarray(offs, dtype=np.uint64), np.asarray(lens, np.uint64))
    chunks = staging.cut_stream(ext, chunk)
    sizes = [int(c["len"].sum()) for c in chunks]
    total = sum(lens)
    assert sum(sizes) == total
    assert all(s == chunk for s in sizes[:-1]) and (not sizes or 0 < sizes[-1] <= chunk)
    want = b"".join(bytes(src[o : o + n]) for o, n in zip(offs, lens))
    got = b"".join(bytes(src[int(a) - base : int(a) - base + int(n)])
                   for c in chunks for a, n in zip(c["addr"], c["len"]))
    assert got == want


def test_pool_is_bounded_and_applies_backpressure() -> None:
    pool = staging.PinnedPool(2, 4096)
    a, b = pool.acquire(1), pool.acquire(1)
    with pytest.raises(TransferError, match=r"no staging buffer free within 0\.2s"):
        pool.acquire(0.2)
    pool.release(a)
    c = pool.acquire(1)
    assert c is a and pool.high_water == 2 and pool.in_use == 2
    pool.release(b)
    pool.release(c)
    assert pool.in_use == 0
    with pytest.raises(ValueError, match="at least 2 buffers"):
        staging.PinnedPool(1, 4096)


def _pair(chunk: int, buffers: int) -> tuple[TcpTransport, TcpTransport, np.ndarray, np.ndarray]:
    opts = {"stage_host_memory": True, "staging_chunk": chunk, "staging_buffers": buffers}
    a_buf = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    b_buf = np.zeros(4 << 20, dtype=np.uint8)
    a, b = TcpTransport(TransportContext("a"), opts), TcpTransport(TransportContext("b"), opts)
    a.register([Region(int(a_buf.__array_interface__["data"][0]), a_buf.nbytes)])
    b.register([Region(int(b_buf.__array_interface__["data"][0]), b_buf.nbytes)])
    b.connect("a", a.descriptor())
    return a, b, a_buf, b_buf


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_staged_transfer_bytes_chunk_boundaries_and_pool_bound(op: Op) -> None:
    chunk, buffers = 64 << 10, 3
    a, b, a_buf, b_buf = _pair(chunk, buffers)
    try:
        rng = np.random.default_rng(2)
        lens = rng.integers(1, 12_000, 300).astype(np.uint64)  # extents straddle chunk edges
        a0 = int(a_buf.__array_interface__["data"][0])
        b0 = int(b_buf.__array_interface__["data"][0])
        ra = np.uint64(a0) + np.arange(300, dtype=np.uint64) * np.uint64(13_000)
        lb = np.uint64(b0) + np.asarray(np.cumsum(np.append(0, lens[:-1])), np.uint64)
        if op is Op.WRITE:  # data flows b -> a
            b_buf[:] = rng.integers(0, 256, b_buf.shape, dtype=np.uint8)
        before_a = a_buf.copy()
        h = b.post(op, "a", make_extents(lb, lens), make_extents(ra, lens))
        st = b.wait(h, 30)
        assert st.status is XferStatus.DONE, st.reason
        for x, y, n in zip(lb.tolist(), ra.tolist(), lens.tolist()):
            src_b = b_buf[x - b0 : x - b0 + n]
            src_a = (before_a if op is Op.READ else a_buf)[y - a0 : y - a0 + n]
            assert np.array_equal(src_b, src_a)
        assert int(lens.sum()) > 10 * chunk  # many chunks, so the pipeline really cycled
        for t in (a, b):
            assert t._pool is not None and t._pool.in_use == 0
            assert 2 <= t._pool.high_water <= buffers  # overlapped, never past the bound
    finally:
        a.close()
        b.close()
