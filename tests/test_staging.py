"""Host-buffer staging: chunking, the bounded pool, and the pipeline over real tcp transfers.

Host memory stands in for device memory (``stage_host_memory``): the same cut/gather/send/
receive/scatter pipeline and pool run as for VRAM; the GPU half is scripts/gpu_staging_check.py
(throughput, and ``--stream-order``: the race with the caller's stream, through KVWorker).

Stream order (staging.py "Stream order"): the tests below that use ``_OrderLog`` run through a
FAKE copier — host memory, copies deferred to ``wait`` like an asynchronous device copy — and
check only the call sequence (mark on the posting thread, wait on the transfer's thread before
its first copy, every copy waited before DONE); ``StreamMarks`` is checked against a FAKE driver
(the calls it makes). The real CUDA behaviour is the GPU test at the end (skipped without a GPU)
and scripts/gpu_staging_check.py --stream-order.
"""

from __future__ import annotations

import threading
from typing import Any

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


class _OrderLog(staging.HostCopier):
    """FAKE copier, for the call sequence only: host memory, each gather/scatter deferred to its
    ``wait`` (as a device copy is only there once its event completed); logs every call with
    the thread it came from."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def _log(self, what: str, arg: Any = None) -> None:
        with self.lock:
            self.calls.append((what, threading.current_thread().name, arg))

    def mark(self) -> Any:
        token = object()
        self._log("mark", token)
        return token

    def after(self, mark: Any) -> None:
        self._log("after", mark)

    def drop(self, mark: Any) -> None:
        self._log("drop", mark)

    def gather(self, ext: Any, buf: staging.Buffer) -> Any:
        self._log("gather")
        return ("gather", lambda: staging.HostCopier.gather(self, ext, buf))

    def scatter(self, buf: staging.Buffer, ext: Any) -> Any:
        self._log("scatter")
        return ("scatter", lambda: staging.HostCopier.scatter(self, buf, ext))

    def wait(self, token: Any) -> None:
        kind, run = token
        run()
        self._log(f"wait_{kind}")

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _ordered_pair(stream_order: bool = True) -> tuple[TcpTransport, TcpTransport, np.ndarray,
                                                       np.ndarray, _OrderLog, _OrderLog]:
    a, b, a_buf, b_buf = _pair(64 << 10, 3)
    b.stream_order = stream_order
    a._copier, b._copier = _OrderLog(), _OrderLog()
    assert isinstance(a._copier, _OrderLog) and isinstance(b._copier, _OrderLog)
    return a, b, a_buf, b_buf, a._copier, b._copier


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_staged_copy_waits_for_the_mark_taken_at_post(op: Op) -> None:
    """FAKE copier (call sequence): post marks the caller's stream on the caller's thread; the
    peer's thread hands that very mark to ``after`` before the transfer's first scatter (READ
    destination) or gather (WRITE source); every copy is waited before DONE, so the bytes are
    there when poll says so; the serving side (the owner of the remote memory) takes no mark."""
    a, b, a_buf, b_buf, served, log = _ordered_pair()
    try:
        n = 300_000  # several 64 KiB chunks
        a0 = int(a_buf.__array_interface__["data"][0])
        b0 = int(b_buf.__array_interface__["data"][0])
        if op is Op.WRITE:
            b_buf[:n] = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        h = b.post(op, "a", make_extents(b0, n), make_extents(a0 + 1000, n))
        assert log.calls[0][:2] == ("mark", threading.current_thread().name)
        st = b.wait(h, 30)
        assert st.status is XferStatus.DONE, st.reason
        assert np.array_equal(b_buf[:n], a_buf[1000 : 1000 + n])  # deferred copies all ran
        names = log.names()
        first = "scatter" if op is Op.READ else "gather"
        assert names[1] == "after" and log.calls[1][2] is log.calls[0][2]
        assert log.calls[1][1] == "kvlink-tcp-a"  # the peer's thread, long after post
        assert names[2] == first and "drop" not in names
        assert names.count(first) == names.count(f"wait_{first}") >= 5
        assert not {"mark", "after", "drop"} & set(served.names())  # nothing to order after
        assert served.names().count("scatter" if op is Op.WRITE else "gather") >= 5
    finally:
        a.close()
        b.close()


def test_no_mark_without_stream_order_and_for_host_memory() -> None:
    """FAKE copier (call sequence): option stream_order=False takes no mark; unstaged host
    memory neither (nothing runs on a stream)."""
    a, b, a_buf, b_buf, _served, log = _ordered_pair(stream_order=False)
    try:
        a0 = int(a_buf.__array_interface__["data"][0])
        b0 = int(b_buf.__array_interface__["data"][0])
        assert b.wait(b.post(Op.READ, "a", make_extents(b0, 5000), make_extents(a0, 5000)),
                      30).status is XferStatus.DONE
        assert "mark" not in log.names() and "after" not in log.names()
        b.stream_order = True  # now not staged: plain host memory
        b.options = {**b.options, "stage_host_memory": False}
        assert b.wait(b.post(Op.READ, "a", make_extents(b0, 5000), make_extents(a0, 5000)),
                      30).status is XferStatus.DONE
        assert "mark" not in log.names()
    finally:
        a.close()
        b.close()


def test_mark_of_a_transfer_that_never_copies_is_handed_back() -> None:
    """FAKE copier (call sequence): a transfer that fails before its first copy (the peer's
    port refuses) drops its mark exactly once; a mark that CUDA refuses gives a FAILED handle,
    and post does not raise."""
    a, b, a_buf, b_buf, _served, log = _ordered_pair()
    try:
        a0 = int(a_buf.__array_interface__["data"][0])
        b0 = int(b_buf.__array_interface__["data"][0])
        a.close()  # the port now refuses
        st = b.wait(b.post(Op.READ, "a", make_extents(b0, 5000), make_extents(a0, 5000)), 30)
        assert st.status is XferStatus.FAILED
        assert log.names() == ["mark", "drop"] and log.calls[1][2] is log.calls[0][2]

        def refuse() -> Any:
            raise RuntimeError("stream order: cuStreamQuery(0x7) failed with CUDA error 700")

        log.mark = refuse  # type: ignore[method-assign]
        st = b.wait(b.post(Op.WRITE, "a", make_extents(b0, 5000), make_extents(a0, 5000)), 30)
        assert st.status is XferStatus.FAILED and "CUDA error 700" in st.reason
    finally:
        a.close()
        b.close()


class _FakeDriver:
    """FAKE libcuda, for the call sequence of StreamMarks only."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.query_rc = 0
        self.current = 0  # the thread's current context
        self.events = 0

    def _log(self, *c: Any) -> int:
        self.calls.append(c)
        return 0

    def cuDevicePrimaryCtxRetain(self, out: Any, dev: int) -> int:
        out._obj.value = 0x1000 + dev
        return 0

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = self.current or None
        return 0

    def cuCtxPushCurrent_v2(self, ctx: Any) -> int:
        return self._log("push", ctx.value)

    def cuCtxPopCurrent_v2(self, out: Any) -> int:
        return self._log("pop")

    def cuStreamQuery(self, stream: int) -> int:
        self._log("query", stream)
        return self.query_rc

    def cuEventCreate(self, out: Any, flags: int) -> int:
        self.events += 1
        out._obj.value = 0x100 + self.events
        return self._log("create", flags)

    def cuEventRecord(self, ev: Any, stream: int) -> int:
        return self._log("record", ev.value, stream)

    def cuStreamWaitEvent(self, stream: int, ev: Any, flags: int) -> int:
        return self._log("wait", stream, ev.value)

    def cuEventDestroy_v2(self, ev: Any) -> int:
        return self._log("destroy", ev.value)


def test_stream_marks_event_per_pending_post_and_nothing_for_an_idle_stream() -> None:
    """StreamMarks against a FAKE driver (call sequence): an idle caller's stream costs one
    query and gives no mark; a busy one (CUDA_ERROR_NOT_READY) an event recorded on it; two
    marks outstanding are two events (the waits happen later on another thread); a wait is
    enqueued on the staging stream and the event recycled; the device's context is pushed only
    where the calling thread has another one current; driver errors raise."""
    drv = _FakeDriver()
    sm = staging.StreamMarks(2, lib=drv, current_stream=lambda d: 0x50 + d)
    drv.current = 0x1002  # the device's primary context is current
    assert sm.take() is None and drv.calls == [("query", 0x52)]
    drv.query_rc, drv.calls = 600, []
    m1, m2 = sm.take(), sm.take()
    assert m1.value != m2.value and sm.created == 2
    assert drv.calls == [("query", 0x52), ("create", 2), ("record", m1.value, 0x52),
                         ("query", 0x52), ("create", 2), ("record", m2.value, 0x52)]
    drv.calls = []
    sm.wait(0x77, m1)
    assert drv.calls == [("wait", 0x77, m1.value)]
    m3 = sm.take()
    assert m3 is m1 and sm.created == 2  # recycled once its wait was enqueued
    drv.current, drv.calls = 0, []  # a thread with no context current
    sm.drop(sm.take())
    assert [c[0] for c in drv.calls] == ["push", "query", "create", "record", "pop"]
    assert drv.calls[0] == ("push", 0x1002)
    drv.current, drv.query_rc = 0x1002, 700
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        sm.take()


def test_staged_read_and_write_wait_for_the_callers_stream_on_a_gpu() -> None:
    """Real CUDA, one process: the caller's current stream is still busy (a long kernel, then
    a fill of the memory involved) when a staged READ or WRITE is posted; after DONE no element
    may be wrong. The two-process check through KVWorker is scripts/gpu_staging_check.py
    --stream-order."""
    torch = pytest.importorskip("torch", reason="torch is not installed: the GPU half of "
                                "staging runs in scripts/gpu_staging_check.py --stream-order")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: staging's stream order is checked on a GPU by this "
                    "test and scripts/gpu_staging_check.py --stream-order")
    n = 64 << 20
    torch.cuda.set_device(0)
    src = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    opts = {"staging_chunk": 4 << 20}
    a, b = TcpTransport(TransportContext("a"), opts), TcpTransport(TransportContext("b"), opts)
    try:
        a.register([Region(src.data_ptr(), n, "cuda:0")])
        b.register([Region(dst.data_ptr(), n, "cuda:0")])
        b.connect("a", a.descriptor())
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)
        dst.fill_(1)  # must land before the READ's scatter
        h = b.post(Op.READ, "a", make_extents(dst.data_ptr(), n), make_extents(src.data_ptr(), n))
        assert b.wait(h, 60).status is XferStatus.DONE
        assert int((dst != 7).sum().item()) == 0
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)
        dst.fill_(9)  # the WRITE's source, still being written at post
        h = b.post(Op.WRITE, "a", make_extents(dst.data_ptr(), n), make_extents(src.data_ptr(), n))
        assert b.wait(h, 60).status is XferStatus.DONE
        torch.cuda.synchronize()
        assert int((src != 9).sum().item()) == 0
    finally:
        a.close()
        b.close()
