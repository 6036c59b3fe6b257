"""Which UCX lanes carry a pair's bytes, and what kvlink does about a slow GPU path (issue 22).

On CPU the real GPU check is scripts/gpu_nixl_check.py; here: the classification of measured
lanes, and that a GPU pair forced onto tcp is reported and its posts fail (not silent)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from kvlink_transports import _ucx

TCP = {"read": ["tcp/lo"], "write": ["52% on tcp/lo and 48% on tcp/eth0"]}


def test_gpu_pair_on_tcp_is_slow() -> None:
    v = _ucx.classify_lanes(TCP, vram=True, same_host=True)
    assert v.verdict == "slow" and "tcp" in v.reason and "cuda_ipc" in v.reason


def test_gpu_pair_on_cuda_ipc_is_fast_and_cuda_copy_is_staged() -> None:
    ok = {"read": ["cuda_ipc/cuda"], "write": ["cuda_ipc/cuda"]}
    assert _ucx.classify_lanes(ok, vram=True, same_host=True).verdict == "fast"
    staged = {"read": ["cuda_copy/cuda and tcp/lo"], "write": ["cuda_ipc/cuda"]}
    v = _ucx.classify_lanes(staged, vram=True, same_host=True)
    assert v.verdict == "slow" and "READ" in v.reason and "host buffers" in v.reason


def test_emulation_is_slow_and_host_pairs() -> None:
    v = _ucx.classify_lanes(TCP, vram=False, same_host=True,
                            protocols={"read": ["software emulation"], "write": ["zero-copy"]})
    assert v.verdict == "slow" and "emulates read" in v.reason
    cma = {"read": ["cma/memory"], "write": ["cma/memory"]}
    assert _ucx.classify_lanes(cma, vram=False, same_host=True).verdict == "fast"
    assert _ucx.classify_lanes(TCP, vram=False, same_host=False).verdict == "slow"
    rc = {"read": ["rc_mlx5/mlx5_0:1"], "write": ["rc_mlx5/mlx5_0:1"]}
    assert _ucx.classify_lanes(rc, vram=True, same_host=False).verdict == "fast"
    assert _ucx.classify_lanes({}, vram=True, same_host=True).verdict == "unknown"


def test_parse_proto_rows_keeps_the_protocol() -> None:
    text = """
[1.0] [vm:1 :0]   | a intra-node cfg#1                                  |
[1.0] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1 :0]   | 0..inf | software emulation | tcp/lo                        |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
"""
    rows = _ucx.parse_proto_rows(text)
    assert rows == [{"op": "read", "scope": "intra-node", "range": "0..inf",
                     "protocol": "software emulation", "config": "tcp/lo",
                     "local": "host", "remote": "host"}]


#: what UCX_PROTO_INFO printed for kvlink's NIXL VRAM probe on one H200 (nixl-cu13 1.5.1,
#: UCX 1.23): tables for host memory too (NIXL's own traffic: a host->host write over cma, a
#: host->GPU write emulated over tcp), and two tables of writes before the GPU's own
_H200 = Path(__file__).with_name("data") / "ucx_proto_info_vram_h200.txt"


def test_a_gpu_pairs_verdict_reads_only_the_gpu_memory_tables() -> None:
    text = _H200.read_text()
    lanes = _ucx.parse_proto_info(text, "cuda")
    assert lanes == {"read": ["cuda_ipc/cuda"], "write": ["cuda_ipc/cuda"]}
    rows = _ucx.rows_for(_ucx.parse_proto_rows(text), "cuda")
    protocols = {r["op"]: [r["protocol"]] for r in rows}
    v = _ucx.classify_lanes(lanes, vram=True, same_host=True, protocols=protocols)
    assert v.verdict == "fast", v
    # every table read, whatever its memory: the host tables' cma and emulated tcp were
    # taken for the GPU's WRITE — the pair judged slow and its posts FAILED (before this fix
    # the GPU's own WRITE table was not read at all: a second table of an op was cut off)
    every = _ucx.parse_proto_info(text)
    assert every["write"] == ["cma/memory", "tcp/lo", "cuda_ipc/cuda"]
    assert _ucx.parse_proto_info(text, "host") == {"write": ["cma/memory"]}


def test_apply_kvlink_env_keeps_the_users_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # faked: whether an NVIDIA driver is loaded (this CPU machine has none; the GPU machine
    # runs the real path in scripts/gpu_nixl_check.py)
    monkeypatch.setattr("kvlink_transports._ucx.env.cuda_driver_present", lambda: True)
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n", "UCX_KEEPALIVE_INTERVAL": "30s"}
    assert _ucx.apply_kvlink_env(env) == {} and env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"
    env = {}
    assert _ucx.apply_kvlink_env(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
                                          "UCX_KEEPALIVE_INTERVAL": "inf"}
    monkeypatch.setattr("kvlink_transports._ucx.env.cuda_driver_present", lambda: False)
    # no driver: UCX would warn "unused variable" of the CUDA one
    assert _ucx.apply_kvlink_env({}) == {"UCX_KEEPALIVE_INTERVAL": "inf"}


def _pair(opts: dict[str, object]) -> tuple[object, object, list[np.ndarray]]:
    pytest.importorskip("nixl")
    from kvlink.transport import Region, TransportContext
    from kvlink_transports.nixl import NixlTransport

    a = NixlTransport(TransportContext(agent_name=f"a-{uuid.uuid4().hex[:6]}"),
                      {"ucx_probe": False, **opts})
    b = NixlTransport(TransportContext(agent_name=f"b-{uuid.uuid4().hex[:6]}"),
                      {"ucx_probe": False})
    bufs = [np.zeros(1 << 16, np.uint8), np.ones(1 << 16, np.uint8)]
    a.register([Region(bufs[0].ctypes.data, bufs[0].nbytes)])
    b.register([Region(bufs[1].ctypes.data, bufs[1].nbytes)])
    a.connect("b", b.descriptor())
    return a, b, bufs


@pytest.mark.parametrize("allow", [False, True])
def test_gpu_pair_forced_onto_tcp_is_reported_not_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, allow: bool
) -> None:
    """The connect-time check of a GPU pair (what a VRAM peer runs on the probe thread) with
    the measured lanes forced to tcp: an error naming the lanes and the fix, and every post
    to that peer FAILED, unless allow_slow_gpu."""
    from kvlink.transport import Op, XferStatus, make_extents
    from kvlink_transports.nixl import agent as nixl_agent
    from kvlink_transports.nixl import lanes as nixl_lanes

    # faked: the VRAM probe's result (no GPU here): lanes forced to tcp, the fault under test;
    # the real probe runs on the GPU machine (scripts/gpu_nixl_check.py)
    probe = _ucx.NixlProbe("VRAM", True, TCP, {"read": ["zero-copy"]}, {"read": 0.5}, 1 << 20)
    monkeypatch.setattr(_ucx, "nixl_probe", lambda *a, **k: probe)
    monkeypatch.setattr(nixl_lanes, "_gpu_verdicts", {})
    nixl_agent._warned.clear()
    a, b, bufs = _pair({"allow_slow_gpu": allow})
    try:
        with caplog.at_level("INFO", logger="kvlink.nixl"):
            a._probe_ucx_path("b", True, True)  # type: ignore[attr-defined]
        msgs = [r.message for r in caplog.records if r.levelname in ("ERROR", "WARNING")]
        assert any("tcp" in m and "allow_slow_gpu" in m for m in msgs), msgs
        h = a.post(Op.READ, "b", make_extents(bufs[0].ctypes.data, 4096),  # type: ignore
                   make_extents(b._regions[0].addr, 4096))  # type: ignore[attr-defined]
        st = a.wait(h, 10)  # type: ignore[attr-defined]
        a.release(h)  # type: ignore[attr-defined]
        if allow:
            assert st.status is XferStatus.DONE and bufs[0][:4096].all()
        else:
            assert st.status is XferStatus.FAILED and "tcp" in st.reason
            assert "allow_slow_gpu" in st.reason
    finally:
        a.close()  # type: ignore[attr-defined]
        b.close()  # type: ignore[attr-defined]


def test_prepped_indices_and_unaligned_fallback() -> None:
    """Posts of whole prepped blocks go by index (no list built); others still move right."""
    from kvlink.transport import Op, XferStatus, make_extents

    a, b, bufs = _pair({"prep_block_bytes": 4096})
    try:
        base = b._regions[0].addr  # type: ignore[attr-defined]
        for off, n, path in [(0, 3 * 4096, "prepped"), (8192, 4096, "prepped"),
                             (100, 5000, "per-request")]:
            bufs[0][:] = 0
            h = a.post(Op.READ, "b", make_extents(bufs[0].ctypes.data + off, n),  # type: ignore
                       make_extents(base + off, n))
            assert a.wait(h, 10).status is XferStatus.DONE  # type: ignore[attr-defined]
            assert a.xfer_timing(h)["path"] == path  # type: ignore[attr-defined]
            assert a.xfer_timing(h)["pre_transfer_s"] > 0  # type: ignore[attr-defined]
            a.release(h)  # type: ignore[attr-defined]
            assert bufs[0][off:off + n].all() and not bufs[0][off + n:].any()
    finally:
        a.close()  # type: ignore[attr-defined]
        b.close()  # type: ignore[attr-defined]
