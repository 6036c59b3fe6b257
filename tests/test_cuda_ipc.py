"""cuda_ipc: the handshake policy and the copy plan run here; the copy itself needs a GPU.

The GPU half (two processes sharing an H200, bytes verified, ratio to a device copy) is
scripts/gpu_cuda_ipc_check.py, run through the device tool.
"""

from __future__ import annotations

import logging

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


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 20_000),
       st.integers(1, 20_000))
def test_piece_cuts_cover_every_extent_once(n: int, rows: int, first: int, piece: int) -> None:
    cuts = _gpucopy.piece_cuts(n, rows, first, piece)
    assert cuts[-1] == n and all(a < b for a, b in zip([0, *cuts], cuts))
    assert all(c % rows == 0 for c in cuts[:-1]), "a program's rows straddle two launches"
    assert cuts[0] <= max(first, rows) + rows or cuts[0] == n  # the GPU starts early
    assert len(cuts) <= 2 + n // max(piece, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50_000), st.integers(16, 1 << 30))
def test_launch_shape_fills_the_gpu_and_bounds_program_work(n: int, first_len: int) -> None:
    small, large = (4, 1024, 4), (1, 8192, 16)
    (rows, _, _), g = _gpucopy.launch_shape(n, first_len, 256 << 10, 528, small, large)
    assert rows == (4 if first_len <= _gpucopy.SMALL else 1)
    assert 1 <= g <= 65535
    programs = -(-n // rows) * g
    # enough programs to fill the GPU, unless the extents are too short to split further
    assert programs >= 528 or g >= max(1, first_len // 16384)
    assert -(-first_len // g) <= max(256 << 10, 16384 * 2) or g == 65535


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50_000), st.integers(16, 1 << 30), st.sampled_from([16 << 10, 64 << 10]),
       st.integers(1, 20_000))
def test_cuda_parts_fill_the_gpu_and_bound_part_size(n: int, first_len: int, chunk: int,
                                                     min_parts: int) -> None:
    g = _gpucopy.parts_per_extent(n, first_len, chunk, min_parts)
    assert g >= 1
    assert -(-first_len // g) <= chunk  # parts of at most chunk bytes
    # enough parts to fill the GPU, unless parts would drop under 16 KiB
    assert n * g >= min_parts or g >= max(1, first_len // 16384)
    assert -(-first_len // g) >= min(first_len, 16384) // 2  # and never tiny ones


def test_copy_kernel_choice_is_checked_and_falls_back_without_nvrtc(
        caplog: pytest.LogCaptureFixture) -> None:
    """A bad kernel name is a ConfigError naming it (before any device is touched); where the
    CUDA C kernel can't be built (here: no CUDA at all) "auto" gets None, with one warning."""
    import torch

    from kvlink.errors import ConfigError
    from kvlink.transport import TransportContext
    from kvlink_transports import _cudamove
    from kvlink_transports.cuda_ipc import CudaIpcTransport

    with pytest.raises(ConfigError, match="'ptx'"):
        CudaIpcTransport(TransportContext(agent_name="k"), {"kernel": "ptx"})
    with pytest.raises(ConfigError, match="'ptx'"):
        _gpucopy.BatchCopier("cuda:0", kernel="ptx")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible, so the CUDA C kernel builds and there is no "
                    "fallback to see; CI (no CUDA) runs this check")
    _cudamove.load._warned = False  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="kvlink.cuda_ipc"):
        assert _cudamove.load(torch.device("cuda", 0)) is None
        assert _cudamove.load(torch.device("cuda", 0)) is None
    warned = [r for r in caplog.records if "CUDA C copy kernel unavailable" in r.getMessage()]
    assert len(warned) == 1


def test_pinned_records_are_recognised_only_where_the_kernel_may_read_them() -> None:
    """Records built by host_extents (and contiguous views of them) are read in place by the
    kernel; any other array (a copy, a strided view, ordinary memory) must be copied first —
    the kernel reading pageable memory would fault the GPU context. The registry forgets the
    memory once no array over it is left."""
    import gc

    import numpy as np

    from kvlink.transport import EXTENT_DTYPE

    known = len(_gpucopy._HOST_EXTENTS)
    ext = _gpucopy.adopt_host_extents(np.zeros(16 * 12, np.uint8), 10)  # bytes stand in for
    assert ext.shape == (10,) and ext.dtype == EXTENT_DTYPE           # pinned ones here
    at = int(ext.ctypes.data)
    assert _gpucopy._pinned_address(ext) == at
    assert _gpucopy._pinned_address(ext[3:7]) == at + 3 * 16
    assert _gpucopy._pinned_address(ext[::2]) == 0
    assert _gpucopy._pinned_address(ext.copy()) == 0
    assert _gpucopy._pinned_address(np.empty(10, EXTENT_DTYPE)) == 0
    view = ext[2:]
    del ext
    gc.collect()
    assert _gpucopy._pinned_address(view) == at + 2 * 16  # the view keeps the memory alive
    del view
    gc.collect()
    assert len(_gpucopy._HOST_EXTENTS) == known and at not in _gpucopy._HOST_ADDRESS.values()


def test_copy_kernel_in_the_triton_interpreter() -> None:
    """The kernel's byte movement, device-side bounds check and address translation, run by
    Triton's interpreter on CPU tensors (random lengths, alignments, pieces, rows per program,
    programs per extent; a refused extent fails the post and is not copied)."""
    pytest.importorskip("triton", reason="triton is not installed here (CPU CI): the same "
                        "kernel is checked on the GPU by scripts/gpu_copy_probe.py and "
                        "scripts/gpu_cuda_ipc_check.py")
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("gpucopy_interp.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interp ok" in out.stdout


def test_gpu_copy_needs_a_gpu() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: the IPC copy runs in "
                                "scripts/gpu_cuda_ipc_check.py on the device machine")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the IPC copy runs in scripts/gpu_cuda_ipc_check.py "
                    "on the device machine")
