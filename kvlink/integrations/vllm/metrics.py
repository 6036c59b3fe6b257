"""What the connector reports: vLLM's stats (:class:`KVLinkStats`, per interval, from the
workers to the frontend) and Prometheus metrics (:class:`KVLinkPromMetrics`): the counters
:data:`COUNTERS`, pull durations, and per transfer and transport the histograms
:data:`XFER_HISTOGRAMS` (NixlConnector's ``vllm:nixl_*`` set for any transport; docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

try:  # stats and Prometheus hooks (vLLM >= 0.11)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorStats = None  # type: ignore[assignment,misc]
    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

#: whether this vLLM has connector stats / Prometheus hooks (:class:`KVLinkStats` and
#: :class:`KVLinkPromMetrics` exist only then)
HAS_STATS = KVConnectorStats is not None
HAS_PROM_METRICS = KVConnectorPromMetrics is not None

if TYPE_CHECKING:
    from kvlink.worker import KVWorker

#: Counters kvlink reports (stats dict keys -> Prometheus ``kvlink_<key>_total``).
COUNTERS = {
    "loaded_tokens": "Prompt tokens whose KV was loaded from a remote prefill (decode side).",
    "loaded_requests": "Requests whose prompt KV was loaded from a remote prefill.",
    "load_failed_requests": "Requests whose remote KV load failed (recomputed or failed by "
                            "kv_load_failure_policy).",
    "load_failed_tokens": "Prompt tokens of requests whose remote KV load failed.",
    "sync_loads": "Loads run inside the step that scheduled their request (sync_load_tokens): "
                  "that step's forward waited for them.",
    "sync_wait_seconds": "Seconds decode workers' forwards waited for synchronous loads to "
                         "settle (per TP rank).",
    "recv_requests": "Requests received (pulled or pushed) by the decode workers (per TP rank).",
    "recv_pushed_requests": "Requests the prefill pushed into the decode workers (mode push).",
    "recv_failed_requests": "Receives (pulls or pushes) that failed on a decode worker.",
    "recv_bytes": "Bytes received by the decode workers.",
    "recv_blocks": "Kernel blocks received by the decode workers.",
    "held_requests": "Finished prefills whose blocks were held for a remote reader.",
    "send_done_requests": "Held prefills released after all readers notified (per TP rank).",
    "send_expired_requests": "Held prefills released because their lease expired (per rank).",
    "send_aborted_requests": "Held prefills released because their request ended abnormally "
                             "while held (a layer-wise candidate; per rank).",
    "reads_refused": "Read intents refused because the request was no longer held.",
    "push_sent_requests": "Requests a prefill worker WROTE into a decode rank (mode push).",
    "push_failed_requests": "Pushes whose WRITE failed on a prefill worker (decode told).",
    "pushes_refused": "Push requests refused (request not held any more, or blocks not held).",
    "reads_not_intact": "READs reported after their lease ended under them (the reader was "
                        "told, its request failed: the blocks may have been reused).",
    "reports_failed": "Side-channel reports nobody waits for (releases, read reports, written "
                      "notes) that could not be delivered (per rank; each is logged).",
    "integrity_checked_blocks": "Blocks whose landed KV matched the prefill's digests "
                                "(integrity sample/full, decode workers).",
    "integrity_failures": "Receives failed because the landed KV differed from the prefill's "
                          "digests, or came without them (integrity on; each is logged).",
    "push_layer_ranges": "Layer ranges a prefill worker posted as their own WRITE during the "
                         "forward (layer-wise pushes, docs/layerwise.md).",
    "push_layerwise_requests": "Pushes a prefill worker streamed layer by layer, every range "
                               "posted (per decode rank).",
    "push_layerwise_fallbacks": "Layer-wise candidates whose decode's block ids were not there "
                                "when their forward started: pushed whole after it.",
    "layerwise_late_requests": "Layer-wise candidates the prefill scheduler stopped waiting for "
                               "(layerwise_wait_ms passed without their decode's block ids).",
}

#: Per-transfer series kept per transport (stats ``data["transfers"][name][key]``), each
#: exported as the histogram ``kvlink_<key>{transport=name}``: (documentation, buckets).
#: NixlConnector's ``vllm:nixl_*`` equivalents are in docs/vllm.md.
XFER_HISTOGRAMS: dict[str, tuple[str, list[float]]] = {
    "xfer_seconds": (
        "Duration of one transfer at the transport, post to completion (NIXL telemetry "
        "xferDuration with the nixl transport's telemetry option, as "
        "vllm:nixl_xfer_time_seconds), on the rank that posted it.",
        [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
         5.0]),
    "xfer_post_seconds": (
        "Host time inside the transport's post call of one transfer (planned extents in, "
        "handle out), on the rank that posted it.",
        [1e-5, 2.5e-5, 5e-5, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
         0.05, 0.1, 0.5, 1.0]),
    "xfer_bytes": (
        "Bytes moved by one transfer.",
        [float(2 ** (10 + i)) for i in range(1, 25, 2)]),  # 2 KiB to 8 GiB, as NixlConnector
    "xfer_descriptors": (
        "Extents (descriptors) posted in one transfer, after kvlink's coalescing.",
        [1, 2, 5, 10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]),
}


def _no_transfers() -> dict[str, Any]:
    """One transport's per-interval transfer data: a list per histogram, failures counted."""
    out: dict[str, Any] = {key: [] for key in XFER_HISTOGRAMS}
    out["failed"] = 0
    return out


def _reduce_transport(name: str, col: Mapping[str, Any]) -> dict[str, int | float]:
    """NixlConnector's log line for one transport: count, avg/p90 transfer and post time,
    MB per transfer, throughput (bytes over the summed transfer times), descriptors."""
    p = f"{name}_"
    xfer = np.asarray(col.get("xfer_seconds") or (), dtype=np.float64)
    out: dict[str, int | float] = {f"{p}transfers": int(xfer.size)}
    if col.get("failed"):
        out[f"{p}failed_transfers"] = int(col["failed"])
    if not xfer.size:
        return out
    post = np.asarray(col.get("xfer_post_seconds") or (), dtype=np.float64)
    mb = np.asarray(col.get("xfer_bytes") or (), dtype=np.float64) / 2**20
    descs = np.asarray(col.get("xfer_descriptors") or (), dtype=np.float64)
    out[f"{p}avg_xfer_ms"] = round(1e3 * float(xfer.mean()), 3)
    out[f"{p}p90_xfer_ms"] = round(1e3 * float(np.percentile(xfer, 90)), 3)
    if post.size:
        out[f"{p}avg_post_ms"] = round(1e3 * float(post.mean()), 3)
        out[f"{p}p90_post_ms"] = round(1e3 * float(np.percentile(post, 90)), 3)
    if mb.size:
        out[f"{p}avg_mb"] = round(float(mb.mean()), 3)
        busy = float(xfer.sum())
        if busy > 0:
            out[f"{p}mb_per_s"] = round(float(mb.sum()) / busy, 3)
    if descs.size:
        out[f"{p}avg_descriptors"] = round(float(descs.mean()), 1)
    return out


class Deltas:
    """The core worker's since-start totals as per-interval counts (what vLLM's stats carry)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def take(self, totals: Mapping[str, int]) -> dict[str, int]:
        out = {k: v - self._seen.get(k, 0) for k, v in totals.items()
               if v > self._seen.get(k, 0)}
        self._seen.update(totals)
        return out


def take_transfers(kv: KVWorker) -> dict[str, dict[str, Any]]:
    """The transfers this rank posted that ended since the last call
    (``KVWorker.take_transfers``; same step thread as the polls that fill it), by
    transport: finished ones as one list per histogram, failed ones counted."""
    out: dict[str, dict[str, Any]] = {}
    for t in kv.take_transfers():
        col = out.get(t.transport)
        if col is None:
            col = out[t.transport] = _no_transfers()
        if t.ok:
            col["xfer_seconds"].append(t.xfer_seconds)
            col["xfer_post_seconds"].append(t.post_seconds)
            col["xfer_bytes"].append(t.nbytes)
            col["xfer_descriptors"].append(t.descriptors)
        else:
            col["failed"] += 1
    return out


if KVConnectorStats is not None:

    @dataclasses.dataclass
    class KVLinkStats(KVConnectorStats):  # type: ignore[misc,valid-type]
        """``{"counters": {name: number}, "recv_seconds": [pull durations, read intent to last
        byte], "transfers": {transport: {"xfer_seconds" | "xfer_post_seconds" | "xfer_bytes" |
        "xfer_descriptors": [one per finished transfer posted], "failed": count}}}`` — plain
        dicts and lists, as vLLM serializes them from the workers to the frontend. Transfers
        are kept per transport because a worker picks one per peer."""

        def __post_init__(self) -> None:
            if not self.data:
                self.reset()
            self.data.setdefault("counters", {})
            self.data.setdefault("recv_seconds", [])
            self.data.setdefault("transfers", {})

        def reset(self) -> None:
            self.data = {"counters": {}, "recv_seconds": [], "transfers": {}}

        def aggregate(self, other: Any) -> Any:
            od = getattr(other, "data", None) or {}
            mine = self.data["counters"]
            for k, v in (od.get("counters") or {}).items():
                mine[k] = mine.get(k, 0) + v
            self.data["recv_seconds"].extend(od.get("recv_seconds") or [])
            for name, col in (od.get("transfers") or {}).items():
                acc = self.data["transfers"].setdefault(name, _no_transfers())
                for key in XFER_HISTOGRAMS:
                    acc[key].extend(col.get(key) or [])
                acc["failed"] += col.get("failed", 0)
            return self

        def reduce(self) -> dict[str, int | float]:
            out: dict[str, int | float] = dict(sorted(self.data["counters"].items()))
            secs = self.data["recv_seconds"]
            if secs:
                out["avg_recv_ms"] = round(1e3 * sum(secs) / len(secs), 3)
            transfers = self.data["transfers"]
            xfer = [s for col in transfers.values() for s in col.get("xfer_seconds") or ()]
            if xfer:  # over every transport (the key of kvlink before per-transport stats)
                out["avg_xfer_ms"] = round(1e3 * sum(xfer) / len(xfer), 3)
            for name in sorted(transfers):
                out.update(_reduce_transport(name, transfers[name]))
            return out

        def is_empty(self) -> bool:
            return (not any(self.data["counters"].values()) and not self.data["recv_seconds"]
                    and not any(col.get("failed") or col.get("xfer_seconds")
                                for col in self.data["transfers"].values()))


if KVConnectorPromMetrics is not None:

    class KVLinkPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
        """Prometheus counters ``kvlink_<name>_total`` (:data:`COUNTERS`), the histogram
        ``kvlink_recv_seconds``, and per transfer, with a ``transport`` label (a worker picks
        the transport per peer): the histograms :data:`XFER_HISTOGRAMS` and the counter
        ``kvlink_xfer_failed_total`` — NixlConnector's ``vllm:nixl_*`` set for any transport."""

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
            by_transport = [*labelnames, "transport"]
            self._xfer = {key: histogram(name=f"kvlink_{key}", documentation=doc,
                                         buckets=buckets, labelnames=by_transport)
                          for key, (doc, buckets) in XFER_HISTOGRAMS.items()}
            self._xfer_failed = self._counter_cls(
                name="kvlink_xfer_failed",
                documentation="Transfers the transport reported FAILED (refused ones "
                              "included), on the rank that posted them.",
                labelnames=by_transport)
            # (metric, engine, transport) -> labelled child: labels() is not free per sample
            self._children: dict[tuple[str, int, str], Any] = {}

        def _child(self, key: str, metric: Any, engine_idx: int, transport: str) -> Any:
            child = self._children.get((key, engine_idx, transport))
            if child is None:
                child = metric.labels(*self.per_engine_labelvalues[engine_idx], transport)
                self._children[(key, engine_idx, transport)] = child
            return child

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
            for name, col in (transfer_stats_data.get("transfers") or {}).items():
                for key, metric in self._xfer.items():
                    values = col.get(key)
                    if values:
                        child = self._child(key, metric, engine_idx, name)
                        for v in values:
                            child.observe(v)
                if col.get("failed"):
                    self._child("failed", self._xfer_failed, engine_idx,
                                name).inc(col["failed"])
