"""A request's life: begin a READ or WRITE, step its parts, report it once nothing moves.

:meth:`_Requests.read` and :meth:`_Requests.write` (and both pushes, through
:meth:`_Requests._start`) check the block ids, map heads to remote ranks, make a part per rank
and post at once where the peer's handshake is cached. :meth:`_Requests._report` runs once
every part is settled: it releases the replicas not read, validates a push's WRITE against the
lease it ran under, tells a decode its push ended, and hands the request to the ledger
(:mod:`kvlink.worker.ledger`), which counts it off its path. Separate from the
per-part steps (:mod:`kvlink.worker.parts`) because this is where a request's outcome is
decided and counted, once; the push modules above begin their requests here.
"""

from __future__ import annotations

import array
import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import BlockIdOutOfRange, ConfigError
from kvlink.headmap import HeadRead, map_heads, notify_targets
from kvlink.integrity import RangeDigests
from kvlink.landing import LandingView
from kvlink.layout import check_in_range
from kvlink.leases import check_generation
from kvlink.peers import RemoteEngine
from kvlink.push import PushKey
from kvlink.transport import Op
from kvlink.worker.ledger import _Spent
from kvlink.worker.parts import _Parts
from kvlink.worker.records import (
    Moved,
    _Go,
    _Leg,
    _Part,
    _Request,
    _Route,
)

log = logging.getLogger("kvlink.worker")


class _Requests(_Parts):
    """Requests begun, stepped and reported, as methods of the worker."""

    _requests: dict[str, _Request]  # in flight, by id
    _routes: dict[tuple[RemoteEngine, bool], _Route]  # (remote, digests) -> see _read_now
    _last_route: tuple[RemoteEngine | None, _Route | None]  # the last one _read_now took
    #: one range of a layer-wise push ended (kvlink.worker.prefill_push, above this module)
    _report_layers: Callable[[_Request, set[str], dict[str, str]], None]

    # ------------------------------------------------------------------ transfers
    def read(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike, generation: int | None = None, *,
             live: bool = False) -> None:
        """Pull a request's blocks (non-blocking); completion is reported by :meth:`poll`.

        Finished means the producer confirmed its lease was intact for the whole READ.
        ``generation``: the producer's hold (:meth:`hold`'s answer, passed along with the block
        ids): the READ is posted here, at once (once the peer's handshake is cached), and
        validated after; without it, a read intent asks the producer for the generation first
        (one more round trip). ``live``: the producer handed us this request itself (its
        answer carried the ids, as vLLM's params do), so it was serving: where nobody listens
        at its address any more, a first handshake with it fails at once rather than at
        ``handshake_timeout`` — leave it False where the producer may not have started yet."""
        if generation is not None:
            if type(generation) is not int or not 0 < generation < 2**63:
                try:  # (numpy's integers are taken too)
                    generation = int(check_generation(generation) or 0)
                except ConfigError as exc:
                    raise ConfigError(f"request {req_id}: {exc}") from None
            last, route = self._last_route  # (a RemoteEngine's hash is a Python call)
            digests = self.integrity.on
            if last is not remote or route is None or route.digests is not digests:
                route = self._routes.get((remote, digests))
            if route is not None and self._read_now(route, req_id, remote, local_ids,
                                                    remote_ids, generation, digests):
                self._last_route = (remote, route)
                return
        self._start(req_id, Op.READ, remote, local_ids, remote_ids, generation=generation,
                    live=live)

    def _read_now(self, route: _Route, req_id: str, remote: RemoteEngine,
                  local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike, generation: int,
                  digests: bool) -> bool:
        """A READ told its generation, from a remote whose last READ took a lane for every
        part (``route``): launched first, its records made while the bytes move. A request's
        latency is its host time before the launch, and on a serving host that time is cold
        (docs/e2e.md): the ids are converted once, straight into what the lanes take, and the
        lanes' kernels check their range. False where nothing was launched: the caller
        starts it the general way (which says what is wrong with it, if anything is)."""
        if (route.epoch != self.peers.epoch or route.digests is not digests
                or req_id in self._requests):
            return False
        wire.check_id(req_id, "request id")
        # a digest lane's kernel finds the hold's rows on the producer's board by generation,
        # and picks the blocks it checks as the producer did (sample: by the generation too)
        checked, sample = (generation, self.integrity.sampling) if digests else (0, False)
        t0 = time.perf_counter()
        handles = (self._post_as_given(route, local_ids, remote_ids, checked, sample)
                   if route.lists else None)
        if handles is None:  # converted first (our copies: the caller may reuse theirs)
            lids, rids = _int_ids(local_ids), _int_ids(remote_ids)
            if lids is None or rids is None or lids.shape[0] != rids.shape[0]:
                return False
            t0 = time.perf_counter()
            handles = [leg.lane.lane.post(lids, rids, checked, sample) for leg in route.legs]
        else:  # the lanes took the caller's ids as they came: what they launched with (int64,
            # theirs), or our copies, now that the bytes move
            lids, rids = _launched_ids(route, handles, local_ids, remote_ids)
        posted = time.perf_counter()
        # launched (a declined leg is posted the general way below): from here on nothing
        # may raise to the caller, whose blocks now take bytes. Its records are owed: made by
        # the first look at it (_record_launch), while the bytes move
        parts = [_Part(leg.read, leg.future) for leg in route.legs]
        req = _Request(req_id, Op.READ, remote, lids, rids, parts, t0, generation=generation,
                       others=route.others, route=route)
        self._requests[req_id] = req
        for part, leg, handle in zip(parts, route.legs, handles):
            if handle is not None:  # (None: no go yet, the step below posts it)
                part.go, part.handle, part.t_post = _Go(leg.peer, generation), handle, t0
                part.fusing, part.post_seconds = digests, posted - t0
        if None in handles:
            self._step(req)
            self._chan.flush()
        return True

    def _record_launch(self, req: _Request) -> None:
        """The records of a READ :meth:`_read_now` launched on a route: what each part moves,
        and its after-check's binding (board, generation, ids). Made by the first look at
        the request — a poll, while its copy runs — not by ``read()``. A caller that reads
        several requests at once then launches them back to back: made inside ``read()``,
        each one's records (~50 us cold on one H200 host: bench/results/gpu_stamps_flat/)
        stood between two launches, with the device idle. A fault here fails the part (as
        any fault of a step), never the caller."""
        route, req.route = req.route, None
        assert route is not None
        n = int(req.remote_ids.shape[0])
        for part, leg in zip(req.parts, route.legs):
            go = part.go
            if go is None or part.plan is not None:
                continue
            try:  # (as _step: a bug here fails the part, reported once its copy has ended)
                nbytes, descriptors, raw = leg.per_block
                part.plan = Moved(n * nbytes, n * descriptors, n * raw)
                self._posted(req, part, go, part.plan.nbytes, part.post_seconds)
            except Exception as exc:
                log.exception("request %s: recording a launched part failed", req.req_id)
                self._part_failed(req, part, f"{type(exc).__name__}: {exc}")

    def _bind_probes(self, req: _Request) -> None:
        """A READ launched on a route, its records made: each part's end probe (its
        transport's ``end_probe``), so a look that sees it end may take :meth:`_end_early`."""
        for part in req.parts:
            go = part.go
            make = (None if go is None or part.handle is None or part.check is None
                    or part.error is not None else getattr(go.peer.transport, "end_probe",
                                                           None))
            part.probe = None if make is None else make(part.handle)
            if part.probe is None:
                return
        req.early = True

    def _end_early(self, req: _Request, finished: set[str]) -> bool | None:
        """A READ launched on a route (:attr:`_Request.early`) that ended as nearly every one
        does — each part's copy DONE (a digest lane's kernel found every digest equal) and
        the hold still shown on the producer's board after it — reported on its transports'
        word and the after-check alone, with nothing else on its path: its records, the
        transports' bookkeeping of the ends and the producer's report are noted for the
        ledger to write (:meth:`_early_records`). On one H100 host those were ~25 us of the
        ~40 between the copy's end word seen and the poll's return, cold
        (bench/results/gpu_session_5dc24ba/stamps_e2e). None while a copy runs. False where
        the step must decide (a copy failed, a digest differed or was not compared, the hold
        is gone, integrity turned on or off since the launch): nothing was taken then."""
        checking = self.integrity.on
        rows = []  # each part's digest rows its kernel found equal (0: a plain lane)
        for part in req.parts:
            probe = part.probe
            if probe is None or part.fusing is not checking:
                return False
            got = probe()
            if got is None:
                return None
            if got < 0:
                return False
            rows.append(got)
        for part in req.parts:  # (after every end: validated after the READ)
            if part.check is None or not part.check():
                return False
        del self._requests[req.req_id]
        finished.add(req.req_id)
        self._ledger.later.append(functools.partial(self._early_records, req, rows,
                                                    time.perf_counter()))
        return True

    def _early_records(self, req: _Request, rows: list[int], t_done: float) -> None:
        """What the general step and report would have left of a READ :meth:`_end_early`
        reported at ``t_done``: each part DONE and held throughout (its transfer noted, the
        producer told later, ``rows``: the digest rows its kernel found equal), the replicas
        not read released, the request counted."""
        for part, equal in zip(req.parts, rows):
            go = part.go
            assert go is not None and part.handle is not None
            self._ledger.ended.append(_Spent(req, go.peer.transport, part.handle, True,
                                             part.t_post, t_done, part.post_seconds,
                                             part.nbytes, part.plan))
            part.handle, part.t_done, part.done = None, t_done, True
            self._held_throughout(req, part, equal)
        self._release_rest(req)
        self._ledger.reported.append((req, t_done))

    @staticmethod
    def _post_as_given(route: _Route, local_ids: object, remote_ids: object, checked: int,
                       sample: bool) -> list[int | None] | None:
        """Each leg's post with the caller's ids as they came, converted by the lanes' launch
        (:attr:`_Route.lists`): on a serving host converting them here first cost 31 us
        before the launch (bench/results/gpu_checks_61d7f7e_stamps). None where the first
        lane does not take them, and where no lane posted them (a lane that declines a
        request has not read its ids: nothing checked them): convert them and post again. A
        later leg that refuses what an earlier one took is posted the general way."""
        handles: list[int | None] = []
        for leg in route.legs:
            try:
                handles.append(leg.lane.lane.post(local_ids, remote_ids, checked, sample))
            except (TypeError, ValueError, OverflowError):
                if not handles:
                    return None
                handles.append(None)
        return handles if any(h is not None for h in handles) else None

    def _bind_route(self, req: _Request, epoch: int) -> None:
        """After a READ told its generation was posted the general way: where every part took
        its lane, the next READ from that remote launches first (:meth:`_read_now`)."""
        self._last_route = (None, None)  # (it may be the route this READ found stale)
        legs = []
        digests = self.integrity.on
        for part in req.parts:
            go = part.go
            if part.handle is None or go is None or not isinstance(part.plan, Moved):
                return
            lane = self._lanes.get((id(go.peer), part.read, req.op, digests))
            if lane is None or lane.lane is None or lane.peer is not go.peer:
                return
            assert lane.table is not None
            one = self._moved(lane.table, 1)
            legs.append(_Leg(part.read, part.peer, go.peer, lane,
                             (one.nbytes, one.descriptors, one.raw_descriptors)))
        if len(self._routes) > 1024:
            self._routes.clear()
        # (routes bound under other handshakes are stale, and hold their peers)
        self._routes = {k: r for k, r in self._routes.items() if r.epoch == epoch}
        lists = all(getattr(leg.lane.lane, "takes_lists", False) for leg in legs)
        others = self._holders(req.remote, {leg.read.remote_rank for leg in legs})
        route = self._routes[(req.remote, digests)] = _Route(epoch, digests, tuple(legs),
                                                             lists, others)
        self._last_route = (req.remote, route)

    def write(self, req_id: str, remote: RemoteEngine, local_ids: npt.ArrayLike,
              remote_ids: npt.ArrayLike) -> None:
        """WRITE a request's blocks into the remote's blocks (non-blocking); :meth:`poll`
        reports it. The remote must take WRITEs it did not ask for: with its
        :attr:`WorkerConfig.grants` on (the default), transports that enforce grants (tcp)
        refuse such a WRITE ("no grant for this transfer"). A decode that wants its blocks
        written asks for a push instead (:meth:`expect_push`; the producer's :meth:`push`)."""
        self._start(req_id, Op.WRITE, remote, local_ids, remote_ids)

    def _start(self, req_id: str, op: Op, remote: RemoteEngine, local_ids: npt.ArrayLike,
               remote_ids: npt.ArrayLike, reads: list[HeadRead] | None = None,
               push: wire.PushRequest | None = None, key: PushKey | None = None,
               generation: int | None = None, lease: tuple[str, int] | None = None,
               digests: tuple[list[int], bytes, bool] | RangeDigests | None = None,
               layers: tuple[int, int] | None = None, layered: str | None = None,
               landing: tuple[LandingView, int, int] | None = None,
               live: bool = False) -> None:
        spec = self._require_spec()
        wire.check_id(req_id if push is None else push.req_id, "request id")
        if req_id in self._requests:
            raise ConfigError(f"request {req_id!r} is already in flight")
        lids = spec.check_block_ids(local_ids, "local")
        rids = _remote_ids(req_id, remote_ids, lids.shape[0])
        if reads is None:
            reads = map_heads(self.config.tp_size, self.config.tp_rank, remote.tp_size,
                              spec.total_kv_heads, spec.mla)
        inc = push.incarnation if push is not None and push.incarnation else None
        # a peer that handed us the request (``live``), or a decode that asked for this push,
        # was serving: a handshake with it that finds nobody listening fails at once. (Not
        # inferred from a READ's generation: a caller may mint it before the producer
        # starts, as the demo does)
        live = live or push is not None
        req = _Request(req_id, op, remote, lids, rids,
                       [_Part(r, self._peer(remote, r.remote_rank, inc, live)) for r in reads],
                       time.perf_counter(), generation=generation, push=push, push_key=key,
                       lease=lease, digests=digests, layers=layers, layered=layered,
                       landing=landing)  # set before the first post: they decide how
        # "written" goes
        self._requests[req_id] = req
        epoch = self.peers.epoch  # (before the step: a handshake it starts makes it stale)
        self._step(req)  # a cached peer: posted now, on the caller's thread
        if generation is not None and op is Op.READ and push is None and lease is None:
            self._bind_route(req, epoch)
        self._chan.flush()  # (not what earlier requests owe: see _tell_later)

    def _step(self, req: _Request) -> bool:
        """Advance every part of ``req``; True once all of them are settled."""
        if req.route is not None:  # launched on a route: its records first
            self._record_launch(req)
        for part in req.parts:
            try:
                self._advance(req, part)
            except Exception as exc:  # a transport's bug must not kill the caller's loop
                log.exception("request %s: advancing a part failed", req.req_id)
                self._part_failed(req, part, f"{type(exc).__name__}: {exc}")
        for part in req.parts:  # noqa: SIM110 (not all() over a generator: the DONE poll)
            if not part.settled:
                return False
        return True

    def _report(self, req: _Request, finished: set[str], failed: dict[str, str]) -> None:
        del self._requests[req.req_id]
        if req.layered is not None:
            self._report_layers(req, finished, failed)
            return
        errors = [p.error for p in req.parts if p.error]
        if req.op is Op.READ:
            self._release_rest(req)
        if req.lease is not None and req.push is not None:
            intact = self.leases.finish_read(
                req.lease[0], f"{req.push.engine_id}/{req.push.tp_rank}", req.lease[1],
                not errors, self.expected_readers(req.push.tp_size))
            if not errors and not intact:
                errors.append(f"the lease of {req.lease[0]} ended under the WRITE: the "
                              "written bytes are not trusted")
        if not errors and isinstance(req.digests, RangeDigests):  # taken as it was pushed
            try:  # (its WRITE waited for them: they are there)
                req.digests = req.digests.wire(req.digests.upto)
            except Exception as exc:
                log.exception("push %s: its digests", req.req_id)
                errors.append(f"integrity: the pushed blocks' digests: "
                              f"{type(exc).__name__}: {exc}")
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
            self._ledger.reported.append((req, time.perf_counter()))  # counted off its path
        if req.push_key is not None:
            with self._lock:
                self._push_slots.finish(req.push_key, not errors)

    def _release_rest(self, req: _Request) -> None:
        """A READ ended: the replicas holding our heads that it did not read are told later. A
        producer takes a release only with the hold's generation (the one we read under,
        where the producer ranks share it, as a generation minted by the caller is shared)."""
        rest = (req.others if req.others is not None else
                self._holders(req.remote, {p.read.remote_rank for p in req.parts}))
        if rest:  # (none where the TP sizes are equal)
            granted = [p.go.generation for p in req.parts if p.go is not None and
                       p.go.generation]
            self._tell_later(functools.partial(
                self._release_at, req.req_id, req.remote, rest,
                req.generation or (granted[0] if granted else None)))

    def release(self, req_id: str, remote: RemoteEngine, skip: set[int] | None = None,
                generation: int | None = None) -> None:
        """Reader side: we are done with ``req_id`` without reading it (a full local prefix
        hit, an aborted request) from the producer ranks holding it for us, except ``skip``
        (those we read, or that wrote to us: they count us themselves). ``generation``: the
        hold's, where known (a producer ignores a release naming another hold of the same
        request id). Sent with the next frame to each peer (at the latest by the next
        :meth:`poll`). Raises ConfigError for an id a peer would refuse (with every other
        message of the frame it travels in)."""
        wire.check_id(req_id, "request id")
        self._release_at(req_id, remote, self._holders(remote, skip or set()), generation)

    def renew(self, req_ids: list[str], remote: RemoteEngine) -> None:
        """Reader side: ``req_ids`` of ``remote`` still wait for us (a decode's queue, before
        their READ): the producer ranks holding them for us renew their leases, up to their
        ``renew_limit`` (:meth:`kvlink.leases.BlockLeases.renew`). Fire and forget: sent
        with the next frame to each peer (at the latest by the next :meth:`poll`); ids not
        held there are skipped. Renew well within the producer's lease (vLLM's connector:
        every quarter of it)."""
        if isinstance(req_ids, str) or not all(isinstance(r, str) for r in req_ids):
            raise ConfigError(f"renew takes a list of request ids (str), got {req_ids!r:.80}")
        ids = [wire.check_id(r, "request id") for r in req_ids]
        if not ids:
            return
        ranks = sorted(self._holders(remote, set()))
        for start in range(0, len(ids), wire.MAX_CALLS):
            msg = wire.Renew(v=WIRE_VERSION, engine_id=self.config.engine_id,
                             req_ids=ids[start:start + wire.MAX_CALLS])
            for rank in ranks:
                self._tell(remote.host, remote.port + rank, msg, quiet=True)

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


def _launched_ids(route: _Route, handles: list[int | None], local_ids: object,
                  remote_ids: object) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The (local, remote) ids a READ handed as given was launched with, as the first lane
    that took them keeps them (``posted_ids``: one copy, made by its launch), else ours."""
    for leg, handle in zip(route.legs, handles):
        if handle is not None:
            got = getattr(leg.lane.lane, "posted_ids", lambda h: None)(handle)
            if got is not None:
                return got  # type: ignore[no-any-return]
            break
    return _own_ids(local_ids), _own_ids(remote_ids)


def _own_ids(ids: object) -> npt.NDArray[np.int64]:
    """Our int64 copy of ids a lane was handed as they came: a list of ints or an int64 array
    (what :func:`_int_ids` takes), or another buffer of int64 (array.array('q')). Empty where
    they are none of these: then no launch took them (its copy failed before one, and its
    handle says why), and nothing may raise now that a part is posted."""
    got = _int_ids(ids)
    if got is not None:
        return got
    try:
        return np.frombuffer(ids, dtype=np.int64).copy()  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return np.zeros(0, dtype=np.int64)


def _remote_ids(req_id: str, ids: npt.ArrayLike, n: int) -> npt.NDArray[np.int64]:
    """The remote block ids as int64 of our own (the caller may reuse theirs), checked as far
    as this side can: integers (a float was truncated), one per local id, each one a block id
    the wire carries; the producer's cache bounds them further (a READ past it fails, naming
    the id). A negative one used to fail the READ, and the report of that failure, carrying
    it, then broke the producer's whole frame of messages (other requests' with it)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ConfigError(f"request {req_id}: {n} local vs {arr.shape} remote block ids")
    if arr.size and arr.dtype.kind not in "iu":
        raise BlockIdOutOfRange(f"remote block ids must be integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64)  # (a uint64 past 2**63 turns negative: out of range below)
    # one reduction on every general post: a negative id wraps to a huge unsigned one
    if out.size and int(out.view(np.uint64).max()) > wire.MAX_BLOCK_ID:
        check_in_range(out, wire.MAX_BLOCK_ID + 1, "remote")
    return out


def _int_ids(ids: object) -> npt.NDArray[np.int64] | None:
    """The caller's block ids as an int64 array of our own (the caller may reuse theirs): a
    1-D integer array, or a list of ints (converted in C, where numpy would truncate a float);
    None for anything else — the general path checks it and says what is wrong."""
    if type(ids) is np.ndarray:
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            return None
        return ids.astype(np.int64)  # (a uint64 past 2**63 turns negative: out of range)
    if type(ids) is list:
        try:
            return np.frombuffer(array.array("q", ids), dtype=np.int64)
        except (TypeError, OverflowError):
            return None
    return None
