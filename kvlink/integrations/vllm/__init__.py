"""kvlink's vLLM v1 KV connector: ``"kv_connector": "KVLinkConnector"`` with
``"kv_connector_module_path": "kvlink.integrations.vllm"`` (docs/vllm.md).

The package follows the seam of vLLM's own connectors (``kv_connector/v1/nixl/``), each module
a thin adapter over kvlink's core:

* ``connector``: :class:`KVLinkConnector`, the facade vLLM instantiates (one per role), and the
  metadata classes it hands vLLM (scheduler -> worker, worker -> scheduler, handshake);
* ``scheduler``: the scheduler side (what to pull, hold, tell the proxy; never touches memory);
* ``worker``: the worker side, one TP rank's transfers on :class:`kvlink.worker.KVWorker`
  (never decides policy), with ``layerwise``, the prefill's layer-wise streams;
* ``metadata``: the per-step plan the scheduler hands the workers, and the
  ``kv_transfer_params`` keys (NixlConnector's and kvlink's);
* ``config``: ``kv_connector_extra_config``, checked (``Settings``);
* ``metrics``: vLLM stats and Prometheus metrics;
* ``layout``: vLLM's KV cache tensors as a :class:`kvlink.layout.KVCacheSpec`.

Only ``connector`` and ``metrics`` import vLLM. The names below are imported on first use, so
that the others import (and are tested) without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvlink.integrations.vllm.connector import (
        KVLinkConnector,
        KVLinkConnectorMetadata,
        KVLinkHandshakeMetadata,
        KVLinkWorkerMetadata,
    )
    from kvlink.integrations.vllm.metrics import (
        COUNTERS,
        XFER_HISTOGRAMS,
        KVLinkPromMetrics,
        KVLinkStats,
    )

__all__ = [
    "COUNTERS",
    "XFER_HISTOGRAMS",
    "KVConnectorRole",
    "KVLinkConnector",
    "KVLinkConnectorMetadata",
    "KVLinkHandshakeMetadata",
    "KVLinkPromMetrics",
    "KVLinkStats",
    "KVLinkWorkerMetadata",
]

#: name -> the module of this package that defines it
_HOME = {
    "KVConnectorRole": "connector", "KVLinkConnector": "connector",
    "KVLinkConnectorMetadata": "connector", "KVLinkHandshakeMetadata": "connector",
    "KVLinkWorkerMetadata": "connector",
    "COUNTERS": "metrics", "XFER_HISTOGRAMS": "metrics", "KVLinkPromMetrics": "metrics",
    "KVLinkStats": "metrics",
}


def __getattr__(name: str) -> Any:
    """``kvlink.integrations.vllm.KVLinkConnector`` (what vLLM's connector factory looks up)
    and the other names of ``__all__``, imported from their module on first use."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
