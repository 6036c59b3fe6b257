"""Worker side, prefill rank, the layer-wise flow (docs/layerwise.md): this forward's streams.

A layer-wise candidate of the step's plan (``LayerReq``) whose decode's push request is here
when its forward starts is held then (``begin_forward``), and each layer range the forward
completes is posted as one WRITE per decode rank (``save_layer``, from vLLM's
``save_kv_layer``; the rest at ``finish_forward``); the other candidates are pushed whole from
the hold after the forward. No vLLM import. A part of :class:`~.worker.PullWorker`, whose
state it uses.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.errors import KVLinkError, TransferCancelled
from kvlink.integrations.vllm.config import Settings
from kvlink.integrations.vllm.layout import expand_blocks
from kvlink.integrations.vllm.metadata import LayerReq, StepPlan
from kvlink.layout import KVCacheSpec
from kvlink.worker import KVWorker

log = logging.getLogger("kvlink.vllm")


@dataclasses.dataclass
class _Stream:
    """Prefill, one decode rank's layer-wise push of a request in this step's forward."""

    msg: wire.PushRequest
    req_id: str  # ours (the lease)
    local: npt.NDArray[np.int64]  # our kernel blocks it writes from (the prompt's tail)
    seen: set[int] = dataclasses.field(default_factory=set)  # kvlink layers the forward wrote
    next_layer: int = 0  # the first layer not posted yet
    ranges: int = 0  # WRITEs posted
    rid: str | None = None  # what KVWorker.push returned (after its first range)
    error: str | None = None  # no more ranges: it failed (the core tells the decode)


class LayerwisePushes:
    """The prefill's layer-wise streams of :class:`~.worker.PullWorker`: its state they use is
    declared here and set in its ``__init__``; the methods stubbed here are its own."""

    s: Settings
    worker: KVWorker | None
    tp_rank: int
    block_ratio: int
    _push_waiting: list[tuple[wire.PushRequest, float]]  # push requests not served yet
    _writes: set[str]  # push keys in flight
    _done_sending: set[str]
    _alias: collections.OrderedDict[str, str]
    _layer_of: dict[str, tuple[int, int]]
    _streams: list[_Stream]
    _early: set[str]
    _early_released: set[str]
    _finished_here: collections.OrderedDict[str, None]

    def _w(self) -> KVWorker:
        raise NotImplementedError

    def _spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def _count(self, key: str, n: float = 1) -> None:
        raise NotImplementedError

    def _take_push_requests(self) -> None:
        raise NotImplementedError

    def _poll(self) -> None:
        raise NotImplementedError

    def set_layer_names(self, ranges: dict[str, tuple[int, int]]) -> None:
        """vLLM layer name -> the kvlink layers ``[start, stop)`` its KV cache tensor is."""
        self._layer_of = dict(ranges)

    def arrived_keys(self) -> dict[str, list[int]]:
        """Push keys whose decode's push request waits here (for the scheduler's wait, in the
        workers' per-step metadata)."""
        if not self.s.layerwise or self.worker is None:
            return {}
        self._take_push_requests()
        return {m.req_id: [self.tp_rank] for m, _ in self._push_waiting}

    def begin_forward(self, plan: StepPlan) -> None:
        """Before this step's forward (vLLM binds the plan): for each layer-wise candidate
        whose decode's push request is here, hold its blocks now (under the generation the
        scheduler will hold it with at request_finished) and open one stream per decode rank;
        the others are pushed whole from the hold after the forward. Never blocks."""
        self._streams = []
        if self.worker is None:
            return
        for key, rid in plan.keys.items():
            if not rid:  # (a key two requests share: it names neither)
                self._alias.pop(key, None)
                continue
            self._alias[key] = rid
            while len(self._alias) > 8192:
                self._alias.popitem(last=False)
        if not plan.layerwise:
            return
        self._take_push_requests()
        for lr in plan.layerwise:
            self._open_streams(lr)

    def _open_streams(self, lr: LayerReq) -> None:
        w = self._w()
        mine = [(m, d) for m, d in self._push_waiting if m.req_id == lr.key]
        if not mine:
            self._count("push_layerwise_fallbacks")
            log.debug("request %s: no decode block ids at its forward: pushed whole after it",
                      lr.req_id)
            return
        held = expand_blocks(lr.block_ids, self.block_ratio)
        try:
            # (not final: the forward has not written it yet — with integrity on, its
            # pushes digest the blocks as they are written, kvlink.worker.prefill_push)
            w.hold(lr.req_id, held, generation=lr.generation, final=False)
        except ValueError as exc:  # held already (a request prefilled twice?): not streamed
            log.warning("request %s: not streamed layer by layer: %s", lr.req_id, exc)
            return
        self._early.add(lr.req_id)
        self._push_waiting = [(m, d) for m, d in self._push_waiting if m.req_id != lr.key]
        for msg, _ in mine:
            if not 0 < len(msg.block_ids) <= len(held):
                why = (f"{len(msg.block_ids)} blocks asked for but {len(held)} are held for "
                       f"{lr.req_id}")
                self._count("pushes_refused")
                log.warning("refused a push of %s to %s/%d: %s", lr.req_id, msg.engine_id,
                            msg.tp_rank, why)
                w.refuse_push(msg, why)
                continue
            # the decode's blocks hold the prompt's tail, as in a whole push
            self._streams.append(_Stream(msg, lr.req_id, held[len(held) - len(msg.block_ids):]))

    def save_layer(self, layer_name: str) -> None:
        """After ``layer_name``'s attention wrote its KV (vLLM's forward thread): post the
        layers that are now complete, in order, as one WRITE per stream. Never blocks: a post
        is queued with the transport (ordered after the current CUDA stream by the core)."""
        if not self._streams:
            return
        span = self._layer_of.get(layer_name)
        if span is None:
            return  # not a layer kvlink registered (the rest is pushed by finish_forward)
        for st in self._streams:
            if st.error is None:
                st.seen.update(range(*span))
                stop = st.next_layer
                while stop in st.seen:
                    stop += 1
                if stop > st.next_layer:
                    self._post_range(st, stop)

    def _post_range(self, st: _Stream, stop: int) -> None:
        w = self._w()
        try:
            st.rid = w.push(st.msg, st.local, lease=st.req_id, layers=(st.next_layer, stop))
        except KVLinkError as exc:
            st.error = str(exc)
            self._count("push_failed_requests" if st.rid is not None else "pushes_refused")
            log.warning("layer-wise push of %s to %s/%d stopped at layer %d: %s", st.req_id,
                        st.msg.engine_id, st.msg.tp_rank, st.next_layer, exc)
            if st.rid is None and not isinstance(exc, TransferCancelled):
                w.refuse_push(st.msg, st.error)  # nothing posted: the decode is told now
            return
        st.next_layer = stop
        st.ranges += 1
        self._count("push_layer_ranges")

    def finish_forward(self) -> None:
        """After the forward (wait_for_save): every layer is written, so post what the forward
        did not report (a layer whose save vLLM skipped), then poll once so the ranges that
        landed are told to the decode. Never waits for a transfer."""
        if not self._streams:
            return
        num_layers = self._spec().num_layers
        for st in self._streams:
            if st.error is None and st.next_layer < num_layers:
                self._post_range(st, num_layers)
            if st.rid is not None:
                self._writes.add(st.rid)
                if st.error is None:
                    self._count("push_layerwise_requests")
        self._streams = []
        self._poll()

    def _report_early(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """Requests held at their forward are reported sent only once the scheduler finished
        them too (they were in a plan's send or aborted list, or vLLM says so)."""
        for rid in finished_req_ids:
            self._mark_finished(rid)
        for rid in list(self._early_released):
            if rid in self._finished_here:
                self._early_released.discard(rid)
                self._done_sending.add(rid)

    def _mark_finished(self, rid: str) -> None:
        self._finished_here[rid] = None
        while len(self._finished_here) > 8192:
            self._finished_here.popitem(last=False)
