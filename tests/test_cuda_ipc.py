"""cuda_ipc: the handshake policy and the copy plan run here; the copy itself needs a GPU.

The GPU half (two processes sharing an H200, bytes verified, ratio to a device copy) is
scripts/gpu_cuda_ipc_check.py, run through the device tool.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.demo import data
from kvlink.hostid import host_id
from kvlink.transport import Capabilities, Op, register_transport
from kvlink.worker import KVWorker, WorkerConfig
from kvlink_transports import _gpucopy
from kvlink_transports.tcp import TcpTransport


class SameHostTcp(TcpTransport):
    """Real tcp, declared same-host-only: exercises the worker's IPC policy without a GPU."""

    name = "samehost_tcp"
    capabilities = Capabilities(ops=frozenset({Op.READ, Op.WRITE}),
                                memory_kinds=frozenset({"cpu"}), same_host_only=True)


register_transport("samehost_tcp", SameHostTcp)
GEO = data.Geometry(layers=2, kv_heads=2, head_dim=8, block_size=4)


def _worker(transports: list[str]) -> KVWorker:
    w = KVWorker(WorkerConfig(engine_id="p", transports=transports))
    _buf, layers = data.allocate(GEO, 8, 1, 0)
    w.register(data.spec_of(GEO, layers, 1, 0))
    w._keep = _buf  # type: ignore[attr-defined]
    return w


def _hs(host: str) -> wire.HandshakeRequest:
    return wire.HandshakeRequest(v=WIRE_VERSION, engine_id="d", agent_name="d/0", tp_rank=0,
                                 tp_size=1, host_id=host, compat="")


def test_same_host_only_descriptors_withheld_from_other_hosts() -> None:
    w = _worker(["samehost_tcp", "tcp"])
    try:
        other = w._answer_handshake(_hs("another-host"))
        mine = w._answer_handshake(_hs(host_id()))
        assert isinstance(other, wire.HandshakeResponse)
        assert isinstance(mine, wire.HandshakeResponse)
        assert sorted(other.transports) == ["tcp"]
        assert sorted(mine.transports) == ["samehost_tcp", "tcp"]
    finally:
        w.close()


def test_transport_refuses_peer_on_other_host() -> None:
    w = _worker(["samehost_tcp"])
    try:
        t = w.transports["samehost_tcp"]
        assert t.unreachable_reason(t.descriptor(), same_host=False) is not None
        assert t.unreachable_reason(t.descriptor(), same_host=True) is None
    finally:
        w.close()


def test_fallback_when_cuda_ipc_cannot_serve(caplog: pytest.LogCaptureFixture) -> None:
    """Config ["cuda_ipc", "tcp"]: on host memory (and without a GPU) tcp is chosen, logged."""
    from kvlink.worker import RemoteEngine

    producer = _worker(["cuda_ipc", "tcp"])
    with caplog.at_level(logging.INFO, logger="kvlink.worker"):
        consumer = _worker(["cuda_ipc", "tcp"])
    try:
        assert list(producer.transports) == ["tcp"]
        with caplog.at_level(logging.INFO, logger="kvlink.worker"):
            peer = consumer._handshake(RemoteEngine("p", "127.0.0.1", producer.side_port), 0)
        assert peer.transport.name == "tcp"
        assert any("transport tcp" in r.getMessage() for r in caplog.records)
        assert any("cuda_ipc" in r.getMessage() for r in caplog.records)
    finally:
        producer.close()
        consumer.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=0, max_size=40), st.integers(1, 5000),
       st.sampled_from([1, 2, 4, 8, 16]))
def test_chunk_table_covers_every_byte_once(lens: list[int], chunk: int, align: int) -> None:
    ln = np.array(lens, dtype=np.uint64) * np.uint64(align)
    src = (np.arange(len(lens), dtype=np.uint64) * np.uint64(1 << 20)) + np.uint64(align * 64)
    dst = src + np.uint64(1 << 40)
    s, d, n, w = _gpucopy.chunk_table(src, dst, ln, chunk)
    assert int(ln.sum()) == int(n.sum()) * w
    assert w >= 1 and all(int(x) % w == 0 for x in (*src, *ln))
    covered = sorted(zip(s.tolist(), (n * w).tolist()))
    expect = []
    for a, length in zip(src.tolist(), ln.tolist()):
        for off in range(0, length, max(w, chunk - chunk % w)):
            expect.append((a + off, min(max(w, chunk - chunk % w), length - off)))
    assert covered == sorted(expect)
    assert np.array_equal(d - s, np.full(s.shape, 1 << 40))


def test_gpu_copy_needs_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the IPC copy runs in scripts/gpu_cuda_ipc_check.py "
                    "on the device machine")
