"""kvlink's vLLM stats and Prometheus metrics, fed by real transfers (issue 21).

Two worker-side ``KVLinkConnector`` objects (a prefill and a decode, built from vLLM's own
``KVTransferConfig``) move blocks over tcp on this host; the decode's stats then carry one
record per transfer it posted, by transport: what NixlConnector exports as
``vllm:nixl_xfer_time_seconds``, ``_post_time_seconds``, ``_bytes_transferred``,
``_num_descriptors`` and ``_num_failed_transfers``. The records go the way vLLM takes them —
its msgpack encoder (worker to frontend), ``build_kv_connector_stats`` + ``aggregate`` (TP
ranks, log intervals), ``reduce`` (the log line) and ``KVConnectorProm`` (vLLM's Prometheus
hook, with a registry of its own so the test leaves the global one alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_vllm_e2e import VLLM_MISSING, _packed, _remote_r1

from kvlink.demo.run import free_port_range
from kvlink.integrations.vllm.metadata import RecvReq, SendReq, StepPlan

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvlink.integrations.vllm import (
    KVConnectorRole,
    KVLinkConnector,
    KVLinkConnectorMetadata,
)

GENERATION = 7777  # the prefill's hold of r2, told to the decode with the block ids


def _ktc(engine_id: str, role: str, extra: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KVLinkConnector",
                            kv_connector_module_path="kvlink.integrations.vllm",
                            kv_role=role, engine_id=engine_id,
                            kv_connector_extra_config=extra)


def _connector(engine_id: str, role: str, extra: dict[str, Any],
               caches: list[torch.Tensor]) -> KVLinkConnector:
    """A worker-side connector as vLLM builds one (the parts of VllmConfig it reads), its
    caches registered through ``register_kv_caches``."""
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                        data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=4),  # _packed: 4 tokens a block
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2),
        kv_transfer_config=_ktc(engine_id, role, extra))
    conn = KVLinkConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches({f"l{i}": t for i, t in enumerate(caches)})
    return conn


def _start(conn: KVLinkConnector, plan: StepPlan) -> None:
    """One engine step's plan, as the model runner hands it to the connector."""
    conn.bind_connector_metadata(KVLinkConnectorMetadata(plan))
    conn.start_load_kv(SimpleNamespace(attn_metadata=None))
    conn.clear_connector_metadata()


@dataclasses.dataclass
class _Pair:
    prod: KVLinkConnector
    cons: KVLinkConnector
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    port: int
    sent: set[str] = dataclasses.field(default_factory=set)

    def step(self) -> Any:
        self.sent |= self.prod.get_transfer_results(set()).finished_sending
        return self.cons.get_transfer_results(set())

    def received(self, req_id: str, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.step()
            if req_id in res.finished_recving:
                return res
            time.sleep(0.005)
        raise AssertionError(f"{req_id} was never received")

    def wait_sent(self, req_id: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while req_id not in self.sent:
            assert time.monotonic() < deadline, f"{req_id} was never released"
            self.step()
            time.sleep(0.005)


@contextlib.contextmanager
def _make_pair(monkeypatch: pytest.MonkeyPatch, **prod_extra: Any) -> Iterator[_Pair]:
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)  # no TP group here
    port = free_port_range(1)
    src = [_packed((0, 1, 2, 3)) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    extra = {"side_channel_port": port, "kv_lease_duration": 0.5}
    prod = _connector("P", "kv_producer", {**extra, **prod_extra}, src)
    cons = _connector("D", "kv_consumer", extra, dst)
    try:
        yield _Pair(prod, cons, src, dst, port)
    finally:
        prod.shutdown()
        cons.shutdown()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Pair]:
    with _make_pair(monkeypatch) as p:
        yield p


def _over_the_wire(data: dict[str, Any]) -> dict[str, Any]:
    """The stats payload as the frontend gets it: through vLLM's msgpack encoder."""
    out = MsgpackDecoder().decode(MsgpackEncoder().encode(data))
    assert isinstance(out, dict)
    return out


def _isolated_prom(ktc: KVTransferConfig) -> tuple[KVConnectorProm, CollectorRegistry]:
    """vLLM's Prometheus hook for this connector, on a registry of its own."""
    reg = CollectorRegistry()

    class Prom(KVConnectorProm):  # type: ignore[misc]
        _gauge_cls = functools.partial(Gauge, registry=reg)
        _counter_cls = functools.partial(Counter, registry=reg)
        _histogram_cls = functools.partial(Histogram, registry=reg)

    prom = Prom(SimpleNamespace(kv_transfer_config=ktc), ["model_name", "engine"],
                {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    return prom, reg


def test_transfers_reach_the_stats_log_line_and_prometheus_by_transport(pair: _Pair) -> None:
    # A pull of two blocks: one transfer posted by the decode (TP 1 to 1), over tcp.
    _start(pair.prod, StepPlan(send=[SendReq("r1", (1, 3))]))
    _start(pair.cons, StepPlan(recv=[RecvReq("d1", _remote_r1(pair.port, [1, 3]), (4, 0), 8)]))
    res = pair.received("d1")
    assert not res.failed_recving
    assert torch.equal(pair.dst[0][4], pair.src[0][1])
    block_bytes = sum(t[0].numel() * t.element_size() for t in pair.src)

    stats = pair.cons.get_kv_connector_stats()
    assert stats is not None
    (name,) = stats.data["transfers"]
    ok = stats.data["transfers"][name]
    assert name == "tcp" and ok["failed"] == 0
    assert ok["xfer_bytes"] == [2 * block_bytes]
    (descs,) = ok["xfer_descriptors"]
    assert 1 <= descs <= 2 * len(pair.src)  # at most one extent per block and layer
    (post,), (xfer,) = ok["xfer_post_seconds"], ok["xfer_seconds"]
    assert 0 < post < 5 and 0 < xfer < 5
    assert stats.data["counters"]["recv_requests"] == 1
    again = pair.cons.get_kv_connector_stats()  # drained: each transfer is reported once
    assert again is None or not again.data["transfers"]
    kv = pair.cons._worker.worker if pair.cons._worker is not None else None
    assert kv is not None and not kv.transfers
    pair.wait_sent("r1")
    sender = pair.prod.get_kv_connector_stats()
    assert sender is not None and not sender.data["transfers"]  # the decode posted it

    # A READ told a hold that expired before it: the tcp transport refuses it (grants), so
    # it is a failed transfer of the decode, and the request fails, nothing written.
    _start(pair.prod, StepPlan(send=[SendReq("r2", (2,), generation=GENERATION)]))
    pair.wait_sent("r2")  # the lease expired
    stale = dataclasses.replace(_remote_r1(pair.port, [2]), request_id="r2",
                                generation=GENERATION)
    pair.dst[0][3].fill_(-1.0)
    _start(pair.cons, StepPlan(recv=[RecvReq("d2", stale, (3,), 4)]))
    res = pair.received("d2")
    assert "d2" in res.failed_recving
    assert bool((pair.dst[0][3] == -1.0).all())
    failed = pair.cons.get_kv_connector_stats()
    assert failed is not None
    assert failed.data["transfers"]["tcp"]["failed"] == 1
    assert not failed.data["transfers"]["tcp"]["xfer_seconds"]

    # vLLM's path: worker -> frontend (msgpack), build + aggregate (ranks, intervals), reduce.
    cls = KVLinkConnector
    total = cls.build_kv_connector_stats(_over_the_wire(stats.data))
    total = total.aggregate(cls.build_kv_connector_stats(_over_the_wire(failed.data)))
    only_failed = cls.build_kv_connector_stats(_over_the_wire(failed.data))
    assert not only_failed.is_empty()  # a failure alone is worth a log line
    line = total.reduce()
    assert line["tcp_transfers"] == 1 and line["tcp_failed_transfers"] == 1
    assert line["tcp_avg_xfer_ms"] == line["tcp_p90_xfer_ms"] == round(1e3 * xfer, 3)
    assert line["tcp_avg_post_ms"] == round(1e3 * post, 3)
    assert line["tcp_avg_mb"] == round(2 * block_bytes / 2**20, 3)
    assert line["tcp_avg_descriptors"] == descs and line["avg_xfer_ms"] > 0
    two_ranks = cls.build_kv_connector_stats(stats.data).aggregate(
        cls.build_kv_connector_stats(stats.data))
    assert two_ranks.reduce()["tcp_transfers"] == 2
    assert stats.data["transfers"]["tcp"]["xfer_seconds"] == [xfer]  # copies, not aliases

    # vLLM's Prometheus hook: histograms and the failure counter, labelled by transport.
    prom, reg = _isolated_prom(_ktc("D", "kv_consumer", {}))
    prom.observe(total.data, 0)
    labels = {"model_name": "tiny", "engine": "0", "transport": "tcp"}

    def value(metric: str, **extra: str) -> float | None:
        return reg.get_sample_value(metric, {**labels, **extra})

    assert value("kvlink_xfer_seconds_count") == 1
    assert value("kvlink_xfer_seconds_sum") == pytest.approx(xfer)
    assert value("kvlink_xfer_post_seconds_count") == 1
    assert value("kvlink_xfer_post_seconds_sum") == pytest.approx(post)
    assert value("kvlink_xfer_bytes_sum") == 2 * block_bytes
    assert value("kvlink_xfer_descriptors_sum") == descs
    assert value("kvlink_xfer_failed_total") == 1
    engine = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("kvlink_recv_requests_total", engine) == 1
    assert reg.get_sample_value("kvlink_recv_failed_requests_total", engine) == 1


def test_a_read_reported_after_its_lease_ended_is_counted_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NixlConnector's ``vllm:nixl_num_notifications_after_expiry``: with grants off the
    stale READ moves its bytes (a finished transfer of the decode), and its report reaches a
    prefill whose lease ended under it — counted there as ``reads_not_intact``, per interval
    (the core worker keeps a total since start)."""
    with _make_pair(monkeypatch, grants=False) as pair:
        _start(pair.prod, StepPlan(send=[SendReq("r3", (2,), generation=GENERATION)]))
        pair.wait_sent("r3")
        stale = dataclasses.replace(_remote_r1(pair.port, [2]), request_id="r3",
                                    generation=GENERATION)
        _start(pair.cons, StepPlan(recv=[RecvReq("d3", stale, (3,), 4)]))
        res = pair.received("d3")
        assert res.failed_recving == {"d3"}  # not intact: its bytes are not trusted
        moved = pair.cons.get_kv_connector_stats()
        assert moved is not None and len(moved.data["transfers"]["tcp"]["xfer_seconds"]) == 1
        told = pair.prod.get_kv_connector_stats()
        assert told is not None and told.data["counters"]["reads_not_intact"] == 1
        later = pair.prod.get_kv_connector_stats()
        assert later is None or "reads_not_intact" not in later.data["counters"]
        prom, reg = _isolated_prom(_ktc("P", "kv_producer", {}))
        prom.observe(told.data, 0)
        assert reg.get_sample_value("kvlink_reads_not_intact_total",
                                    {"model_name": "tiny", "engine": "0"}) == 1
