"""A request's life: begin a READ or WRITE, step its parts, report it once nothing moves.

:meth:`_Requests.read` and :meth:`_Requests.write` (and both pushes, through
:meth:`_Requests._start`) check the block ids, map heads to remote ranks, make a part per rank
and post at once where the peer's handshake is cached. :meth:`_Requests._report` runs once
every part is settled: it releases the replicas not read, validates a push's WRITE against the
lease it ran under, tells a decode its push ended, and keeps the accounting callers read
(:attr:`KVWorker.xfer_seconds`, :attr:`KVWorker.phases`, descriptor counts). Separate from the
per-part steps (:mod:`kvlink.worker.parts`) because this is where a request's outcome is
decided and counted, once; the push modules above begin their requests here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import ConfigError
from kvlink.headmap import HeadRead, map_heads, notify_targets
from kvlink.landing import LandingView
from kvlink.peers import RemoteEngine
from kvlink.push import PushKey
from kvlink.transport import Op
from kvlink.worker.parts import _Parts
from kvlink.worker.records import _XFER_SECONDS_KEPT, Phases, _Part, _Request

log = logging.getLogger("kvlink.worker")
V = TypeVar("V")


class _Requests(_Parts):
    """Requests begun, stepped and reported, as methods of the worker."""

    _requests: dict[str, _Request]  # in flight, by id
    finished_bytes: int
    raw_descriptors: int  # before coalescing, over finished requests
    descriptors: int
    xfer_seconds: dict[str, float]  # finished request id -> transport seconds
    phases: dict[str, Phases]  # finished request id -> where its time went
    #: one range of a layer-wise push ended (kvlink.worker.prefill_push, above this module)
    _report_layers: Callable[[_Request, set[str], dict[str, str]], None]

    # ------------------------------------------------------------------ transfers
    def read(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike, generation: int | None = None) -> None:
        """Pull a request's blocks (non-blocking); completion is reported by :meth:`poll`.

        Finished means the producer confirmed its lease was intact for the whole READ.
        ``generation``: the producer's hold (:meth:`hold`'s answer, passed along with the block
        ids): the READ is posted here, at once (once the peer's handshake is cached), and
        validated after; without it, a read intent asks the producer for the generation first
        (one more round trip)."""
        if generation is not None and not 0 < generation < 2**63:
            raise ConfigError(f"request {req_id}: generation must be a positive 63-bit "
                              f"integer, got {generation!r}")
        self._start(req_id, Op.READ, remote, local_ids, remote_ids, generation=generation)

    def write(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
              remote_ids: npt.ArrayLike) -> None:
        """Push a request's blocks into the remote's blocks (non-blocking)."""
        self._start(req_id, Op.WRITE, remote, local_ids, remote_ids)

    def _start(self, req_id: str, op: Op, remote: RemoteEngine, local_ids: npt.ArrayLike,
               remote_ids: npt.ArrayLike, reads: list[HeadRead] | None = None,
               push: wire.PushRequest | None = None, key: PushKey | None = None,
               generation: int | None = None, lease: tuple[str, int] | None = None,
               digests: tuple[list[int], bytes, bool] | None = None,
               layers: tuple[int, int] | None = None, layered: str | None = None,
               landing: tuple[LandingView, int, int] | None = None) -> None:
        spec = self._require_spec()
        wire.check_id(req_id if push is None else push.req_id, "request id")
        if req_id in self._requests:
            raise ConfigError(f"request {req_id!r} is already in flight")
        lids = spec.check_block_ids(local_ids, "local")
        rids = np.array(remote_ids, dtype=np.int64)  # ours: the caller may reuse theirs
        if rids.ndim != 1 or rids.shape != lids.shape:
            raise ConfigError(f"request {req_id}: {lids.shape[0]} local vs "
                              f"{np.shape(rids)} remote block ids")
        if reads is None:
            reads = map_heads(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        inc = push.incarnation if push is not None and push.incarnation else None
        req = _Request(req_id, op, remote, lids, rids,
                       [_Part(r, self._peer(remote, r.remote_rank, inc)) for r in reads],
                       time.perf_counter(), generation=generation, push=push, push_key=key,
                       lease=lease, digests=digests, layers=layers, layered=layered,
                       landing=landing)  # set before the first post: they decide how
        # "written" goes
        self._requests[req_id] = req
        self._step(req)  # a cached peer: posted now, on the caller's thread
        self._chan.flush()  # (not what earlier requests owe: see _tell_later)

    def _step(self, req: _Request) -> bool:
        """Advance every part of ``req``; True once all of them are settled."""
        for part in req.parts:
            try:
                self._advance(req, part)
            except Exception as exc:  # a transport's bug must not kill the caller's loop
                log.exception("request %s: advancing a part failed", req.req_id)
                self._part_failed(req, part, f"{type(exc).__name__}: {exc}")
        return all(p.settled for p in req.parts)

    def _report(self, req: _Request, finished: set[str], failed: dict[str, str]) -> None:
        del self._requests[req.req_id]
        if req.layered is not None:
            self._report_layers(req, finished, failed)
            return
        errors = [p.error for p in req.parts if p.error]
        if req.op is Op.READ:  # replicas holding our heads that we did not read: a producer
            # takes a release only with the hold's generation (the one we read under, where
            # the producer ranks share it, as a generation minted by the caller is shared)
            granted = [p.go.generation for p in req.parts if p.go is not None and
                       p.go.generation]
            rest = self._holders(req.remote, {p.read.remote_rank for p in req.parts})
            if rest:  # (none where the TP sizes are equal)
                self._tell_later(functools.partial(
                    self._release_at, req.req_id, req.remote, rest,
                    req.generation or (granted[0] if granted else None)))
        if req.lease is not None and req.push is not None:
            intact = self.leases.finish_read(
                req.lease[0], f"{req.push.engine_id}/{req.push.tp_rank}", req.lease[1],
                not errors, self.expected_readers(req.push.tp_size))
            if not errors and not intact:
                errors.append(f"the lease of {req.lease[0]} ended under the WRITE: the "
                              "written bytes are not trusted")
        if errors:
            failed[req.req_id] = "; ".join(errors)
            log.warning("request %s failed: %s", req.req_id, failed[req.req_id])
            if req.push is not None:  # the decode is waiting: tell it (quiescent now)
                self._notify_written(req, ok=False, detail=failed[req.req_id])
        else:
            finished.add(req.req_id)
            if req.op is Op.WRITE and not self._notes_natively(req):
                rank = req.parts[0].read.remote_rank
                host, port = ((req.push.host, req.push.port + req.push.tp_rank)
                              if req.push is not None else
                              (req.remote.host, req.remote.port + rank))
                self._tell(host, port, self._written(req, True))
            self.finished_bytes += req.nbytes
            self._remember(self.xfer_seconds, req.req_id,
                       max((p.xfer_seconds for p in req.parts), default=0.0))
            now = time.perf_counter()
            req.phases.verdict = max((now - p.t_done for p in req.parts if p.t_done),
                                     default=0.0)
            self._remember(self.phases, req.req_id, req.phases)
            self.raw_descriptors += sum(p.plan.raw_descriptors for p in req.parts if p.plan)
            self.descriptors += sum(p.plan.descriptors for p in req.parts if p.plan)
        if req.push_key is not None:
            with self._lock:
                self._push_slots.finish(req.push_key, not errors)

    @staticmethod
    def _remember(kept: dict[str, V], key: str, value: V) -> None:
        kept[key] = value
        if len(kept) > _XFER_SECONDS_KEPT:  # nobody reads them: bounded
            del kept[next(iter(kept))]

    def release(self, req_id: str, remote: RemoteEngine, skip: set[int] | None = None,
                generation: int | None = None) -> None:
        """Reader side: we are done with ``req_id`` without reading it (a full local prefix
        hit, an aborted request) from the producer ranks holding it for us, except ``skip``
        (those we read, or that wrote to us: they count us themselves). ``generation``: the
        hold's, where known (a producer ignores a release naming another hold of the same
        request id). Sent with the next frame to each peer (at the latest by the next
        :meth:`poll`)."""
        self._release_at(req_id, remote, self._holders(remote, skip or set()), generation)

    def _holders(self, remote: RemoteEngine, skip: set[int]) -> frozenset[int]:
        """The ranks of ``remote`` that hold heads of ours, except ``skip``."""
        spec = self._require_spec()
        return notify_targets(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla) - skip

    def _release_at(self, req_id: str, remote: RemoteEngine, ranks: frozenset[int],
                    generation: int | None) -> None:
        for rank in sorted(ranks):
            self._tell(remote.host, remote.port + rank,
                       wire.ReadDone(v=WIRE_VERSION, engine_id=self.config.engine_id,
                                     req_id=req_id, tp_rank=self.config.tp_rank,
                                     tp_size=self.config.tp_size, generation=generation or 0,
                                     ok=True))

    def _notify_written(self, req: _Request, ok: bool, detail: str = "") -> None:
        """A push that ended: say so to the decode rank (over the side channel)."""
        assert req.push is not None
        self._tell(req.push.host, req.push.port + req.push.tp_rank,
                   self._written(req, ok, detail))
