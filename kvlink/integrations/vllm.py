"""``KVLinkConnector``: a vLLM v1 KV connector, a drop-in for NixlConnector (pull or push mode).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVLinkConnector",
                           "kv_connector_module_path": "kvlink.integrations.vllm",
                           "kv_role": "kv_producer",            # or kv_consumer / kv_both
                           "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"transport": "tcp"}}'

``"mode": "push"`` in ``kv_connector_extra_config`` of the decode makes the prefill WRITE each
request into the decode's blocks (Mooncake style) instead of the decode READing them.

``kv_transfer_params`` carry NixlConnector's keys with NixlConnector's meaning, so proxies and
routers written for it (vLLM's toy proxy included) work unchanged. This is the only kvlink
module that imports vLLM; its logic lives in ``vllm_sched`` (scheduler side, never touches
memory), ``vllm_worker`` (worker side, never decides policy) and ``vllm_layout``. vLLM API
differences between versions are handled by feature detection, never by version checks.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import uuid
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvlink.errors import ConfigError
from kvlink.integrations.vllm_common import Settings, StepPlan
from kvlink.integrations.vllm_layout import detect
from kvlink.integrations.vllm_sched import PullScheduler
from kvlink.integrations.vllm_worker import PullWorker

try:  # vLLM >= 0.32: completions and receive failures reported together
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # stats and Prometheus hooks (vLLM >= 0.11)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorStats = None  # type: ignore[assignment,misc]
    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvlink.vllm")


def _share_vllm_logging() -> None:
    """Route kvlink's log records through vLLM's handlers (vLLM configures only "vllm")."""
    ours, theirs = logging.getLogger("kvlink"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


_share_vllm_logging()

_INIT_PARAMS = inspect.signature(KVConnectorBase_V1.__init__).parameters
_HAS_TRANSFER_RESULTS = (KVConnectorTransferResults is not None
                         and hasattr(KVConnectorBase_V1, "get_transfer_results")
                         and "failed_recving" in getattr(KVConnectorTransferResults,
                                                         "__dataclass_fields__", {}))

#: Counters kvlink reports (stats dict keys -> Prometheus ``kvlink_<key>_total``).
COUNTERS = {
    "loaded_tokens": "Prompt tokens whose KV was loaded from a remote prefill (decode side).",
    "loaded_requests": "Requests whose prompt KV was loaded from a remote prefill.",
    "load_failed_requests": "Requests whose remote KV load failed (recomputed or failed by "
                            "kv_load_failure_policy).",
    "load_failed_tokens": "Prompt tokens of requests whose remote KV load failed.",
    "recv_requests": "Requests received (pulled or pushed) by the decode workers (per TP rank).",
    "recv_pushed_requests": "Requests the prefill pushed into the decode workers (mode push).",
    "recv_failed_requests": "Receives (pulls or pushes) that failed on a decode worker.",
    "recv_bytes": "Bytes received by the decode workers.",
    "recv_blocks": "Kernel blocks received by the decode workers.",
    "held_requests": "Finished prefills whose blocks were held for a remote reader.",
    "send_done_requests": "Held prefills released after all readers notified (per TP rank).",
    "send_expired_requests": "Held prefills released because their lease expired (per rank).",
    "reads_refused": "Read intents refused because the request was no longer held.",
    "push_sent_requests": "Requests a prefill worker WROTE into a decode rank (mode push).",
    "push_failed_requests": "Pushes whose WRITE failed on a prefill worker (decode told).",
    "pushes_refused": "Push requests refused (request not held any more, or blocks not held).",
}


class KVLinkConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker: one step's :class:`StepPlan`."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _ktc_get(ktc: Any, key: str, default: Any = None) -> Any:
    return getattr(ktc, key, default)


class KVLinkConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Pull- or push-mode KV connector over kvlink's transports (``tcp`` works everywhere)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        par = vllm_config.parallel_config
        pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            # A stage's ports and geometry would match another stage's: its layers would get
            # the other stage's KV. Until layer identity is in the handshake, refuse.
            raise ConfigError(f"kvlink does not support pipeline parallelism yet: "
                              f"pipeline_parallel_size={pp} (use 1)")
        init: Any = super().__init__
        if "kv_cache_config" in _INIT_PARAMS:
            init(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - older vLLM
            init(vllm_config, role)
        ktc = vllm_config.kv_transfer_config
        engine_id = _ktc_get(ktc, "engine_id") or str(uuid.uuid4())
        self.settings = Settings.from_config(str(engine_id), str(_ktc_get(ktc, "kv_role")),
                                             _ktc_get(ktc, "kv_connector_extra_config"))
        par = vllm_config.parallel_config
        self._tp_size = int(par.tensor_parallel_size)
        self._dp_rank = int(getattr(par, "data_parallel_index",
                                    getattr(par, "data_parallel_rank", 0)) or 0)
        self._block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self._use_mla = bool(getattr(model, "use_mla", False))
        self._total_kv_heads = int(model.get_total_num_kv_heads())
        self._sched: PullScheduler | None = None
        self._worker: PullWorker | None = None
        self._results: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = PullScheduler(self.settings, self._tp_size, self._block_size,
                                        self._dp_rank)
        log.info("kvlink connector (%s) engine %s, role %s, mode %s, transports %s, side "
                 "channel %s:%d%s", role.name.lower(), self.settings.engine_id,
                 _ktc_get(ktc, "kv_role"), self.settings.mode,
                 ",".join(self.settings.transports), self.settings.host,
                 self.settings.rank_port(self._dp_rank, self._tp_size),
                 "" if self.settings.serves else " (not served)")

    # ================================================================ scheduler side
    def _s(self) -> PullScheduler:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVLinkConnectorMetadata(self._s().build_plan())

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_output(getattr(connector_output, "finished_recving", None),
                                getattr(connector_output, "failed_recving", None),
                                getattr(connector_output, "invalid_block_ids", None))

    def get_finished_count(self) -> int | None:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any layout: kvlink reads it from the tensors' strides

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
        found = detect(kv_caches, total_kv_heads=self._total_kv_heads, tp_size=self._tp_size,
                       tp_rank=tp_rank, use_mla=self._use_mla)
        kernel = found.spec.block_size
        if self._block_size % kernel:
            raise ValueError(f"kvlink: scheduler block size {self._block_size} is not a "
                             f"multiple of the KV cache page of {kernel} tokens")
        self._worker = PullWorker(self.settings, tp_rank, self._tp_size, self._dp_rank,
                                  self._block_size // kernel)
        self._worker.register(found.spec)
        log.info("kvlink rank %d: KV cache %s; %.1f MiB in %d region(s)", tp_rank,
                 found.description, sum(r.nbytes for r in found.spec.regions) / 2**20,
                 len(found.spec.regions))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVLinkConnectorMetadata):
            idle = getattr(forward_context, "attn_metadata", None) is None
            self._worker.start(meta.plan, idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests are loaded (pulled or pushed) before they are scheduled: nothing to
        wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing is saved per layer: with vLLM's sequential proxy flow the decode asks only
        after the prefill finished, so even a push starts from the finished, held blocks."""

    def wait_for_save(self) -> None:
        """Nothing to save (see :meth:`save_kv_layer`)."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to do: receives finish before their request runs, and prefill blocks are
        held only after their request finished, so preemption never frees a block in
        transfer."""

    def _collect(self) -> Any:
        return self._worker.results() if self._worker is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        res = self._collect()
        if res is None:
            return None, None
        self._results = res
        return res.finished_sending or None, res.finished_recving or None

    if _HAS_TRANSFER_RESULTS:
        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            res = self._collect()
            if res is None:
                return KVConnectorTransferResults()
            return KVConnectorTransferResults(finished_sending=res.finished_sending,
                                              finished_recving=res.finished_recving,
                                              failed_recving=set(res.failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        if _HAS_TRANSFER_RESULTS:
            return set()  # failures are reported per request (failed_recving)
        res, self._results = self._results, None
        return set(res.failed_blocks) if res is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._sched is not None:
            self._sched.close()

    # ================================================================ stats
    def get_kv_connector_stats(self) -> Any:
        if KVConnectorStats is None:
            return None
        xfer: list[float] = []
        if self._worker is not None:
            counters, durations = self._worker.take_stats()
            xfer = self._take_xfer_seconds()
        elif self._sched is not None:
            counters, durations = self._sched.take_counters(), []
        else:
            return None
        if not counters and not durations and not xfer:
            return None
        return KVLinkStats(data={"counters": counters, "recv_seconds": durations,
                                 "xfer_seconds": xfer})

    def _take_xfer_seconds(self) -> list[float]:
        """Transport post-to-completion seconds of the transfers this rank posted since the
        last call (``KVWorker.xfer_seconds``; same step thread as the polls that fill it)."""
        kv = self._worker.worker if self._worker is not None else None
        if kv is None or not kv.xfer_seconds:
            return []
        out = list(kv.xfer_seconds.values())
        kv.xfer_seconds.clear()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if KVConnectorStats is None:
            return None
        return KVLinkStats(data=copy.deepcopy(data)) if data is not None else KVLinkStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        if KVConnectorPromMetrics is None:
            return None
        return KVLinkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


if KVConnectorStats is not None:

    @dataclasses.dataclass
    class KVLinkStats(KVConnectorStats):  # type: ignore[misc,valid-type]
        """``{"counters": {name: number}, "recv_seconds": [pull durations, read intent to last
        byte], "xfer_seconds": [transport post to completion, per transfer posted]}``."""

        def __post_init__(self) -> None:
            if not self.data:
                self.reset()
            self.data.setdefault("counters", {})
            self.data.setdefault("recv_seconds", [])
            self.data.setdefault("xfer_seconds", [])

        def reset(self) -> None:
            self.data = {"counters": {}, "recv_seconds": [], "xfer_seconds": []}

        def aggregate(self, other: Any) -> Any:
            od = getattr(other, "data", None) or {}
            mine = self.data["counters"]
            for k, v in (od.get("counters") or {}).items():
                mine[k] = mine.get(k, 0) + v
            self.data["recv_seconds"].extend(od.get("recv_seconds") or [])
            self.data["xfer_seconds"].extend(od.get("xfer_seconds") or [])
            return self

        def reduce(self) -> dict[str, int | float]:
            out: dict[str, int | float] = dict(sorted(self.data["counters"].items()))
            secs = self.data["recv_seconds"]
            if secs:
                out["avg_recv_ms"] = round(1e3 * sum(secs) / len(secs), 3)
            xfer = self.data["xfer_seconds"]
            if xfer:
                out["avg_xfer_ms"] = round(1e3 * sum(xfer) / len(xfer), 3)
            return out

        def is_empty(self) -> bool:
            return (not any(self.data["counters"].values()) and not self.data["recv_seconds"]
                    and not self.data["xfer_seconds"])


if KVConnectorPromMetrics is not None:

    class KVLinkPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
        """Prometheus counters ``kvlink_<name>_total``, histograms ``kvlink_recv_seconds`` and
        ``kvlink_xfer_seconds``."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {
                key: self._per_engine(self._counter_cls(name=f"kvlink_{key}",
                                                        documentation=doc,
                                                        labelnames=labelnames))
                for key, doc in COUNTERS.items()
            }
            histogram: Any = self._histogram_cls
            self._recv_seconds = self._per_engine(histogram(
                name="kvlink_recv_seconds",
                documentation="Duration of one request's pull, read intent to last byte.",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames))
            self._xfer_seconds = self._per_engine(histogram(
                name="kvlink_xfer_seconds",
                documentation="Duration of one transfer at the transport, post to completion "
                              "(NIXL telemetry xferDuration with the nixl transport's "
                              "telemetry option, as vllm:nixl_xfer_time_seconds), on the "
                              "rank that posted it.",
                buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                         0.5, 1.0, 2.5, 5.0],
                labelnames=labelnames))

        def _per_engine(self, metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values)
                    for idx, values in self.per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in (transfer_stats_data.get("counters") or {}).items():
                per_engine = self._counters.get(key)
                if per_engine is not None and value:
                    per_engine[engine_idx].inc(value)
            for s in transfer_stats_data.get("recv_seconds") or ():
                self._recv_seconds[engine_idx].observe(s)
            for s in transfer_stats_data.get("xfer_seconds") or ():
                self._xfer_seconds[engine_idx].observe(s)
