"""Scheduler side of the vLLM connector: what to pull, what to hold, what to tell the proxy.

Never touches memory. Requests and block lists are vLLM's objects, read duck-typed (this module
does not import vLLM). The lease itself lives with the worker that receives the readers'
notifications (see ``worker``); the scheduler only delays the free and says for how long.

Per-request flags decide, not ``kv_role`` (as NixlConnector): ``do_remote_prefill`` is loaded
on any instance, ``do_remote_decode`` is held on any instance that runs a side channel for its
readers (producers, ``kv_both`` and push-mode consumers: :attr:`Settings.serves`). The role
only sets that default, and a flag served against its role is logged once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from kvlink import localkey, wire
from kvlink.channel import Channels, Pending
from kvlink.compat import WIRE_VERSION
from kvlink.integrations.vllm.config import MODES, Settings
from kvlink.integrations.vllm.metadata import (
    CLOCK_PARAM,
    EXPIRY_PARAM,
    GENERATION_PARAM,
    INCARNATIONS_PARAM,
    MODE_PARAM,
    PUSH_KEY_PARAM,
    REGISTRATION_PARAM,
    TRANSFER_MODE_PARAM,
    LayerReq,
    RecvReq,
    Remote,
    Renewal,
    SendReq,
    StepPlan,
    base_request_id,
    parse_remote,
    registration_generation,
    size_refusal,
)
from kvlink.leases import new_generation
from kvlink.sidechannel import secret_from_env

log = logging.getLogger("kvlink.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def _prompt_len(request: Any) -> int:
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    return int(getattr(request, "num_prompt_tokens", 0))


def _unhashed_block_ids(blocks: Any) -> tuple[int, ...]:
    """The request's blocks not hit in the local prefix cache (group 0: kvlink refuses models
    with more groups at startup)."""
    if hasattr(blocks, "get_unhashed_block_ids"):
        return tuple(blocks.get_unhashed_block_ids())
    return tuple(blocks.get_block_ids()[0])


@dataclasses.dataclass(frozen=True, slots=True)
class _Load:
    """A planned receive, until its outcome is reported (finished or failed receive, or the
    workers' verdict on a synchronous load)."""

    tokens: int  # the prompt tokens it covers
    blocks: tuple[int, ...]  # local (scheduler) block ids
    engine: str  # the prefill's engine id


@dataclasses.dataclass(slots=True)
class _Waiting:
    """Decode: a request in our queue whose prefill's lease we renew until its receive is
    planned (or it ends)."""

    remote: Remote
    lease: float  # the prefill's lease, as its params say (expiry - clock)
    last: float  # perf_counter of the last renewal (of the arrival, before the first)

    @property
    def every(self) -> float:
        """Seconds between renewals."""
        return self.lease * RENEW_EVERY


#: renewals come at this fraction of the prefill's lease (its params say how long it is):
#: three chances before it would end, one message per prefill engine each time
RENEW_EVERY = 0.25


class PullScheduler:
    """``sync_loads``: whether this decode may load synchronously at all (vLLM's per-step
    worker metadata carries each outcome, vLLM >= 0.32; a decode of TP 1: see
    :meth:`KVLinkConnector._sync_loads`); without it every load is asynchronous."""

    def __init__(self, settings: Settings, tp_size: int, block_size: int,
                 dp_rank: int = 0, *, sync_loads: bool = True) -> None:
        self.s = settings
        self.tp_size = tp_size
        self.block_size = block_size
        self.side_port = settings.rank_port(dp_rank, tp_size)
        self._plan = StepPlan()
        self._loading: dict[str, _Load] = {}  # by request id
        # decode, synchronous loads: the most tokens one may load (0: none), the prefill
        # engines whose last load here finished (a load from any other is asynchronous: its
        # handshake, or a dead peer, must not hold up a forward), and the local prefix hit
        # each matched request was offered (where its loaded blocks start)
        self._sync_tokens = settings.sync_load_tokens if sync_loads else 0
        self._warm: set[str] = set()
        self._sync_hit: dict[str, int] = {}
        # seconds per token the last synchronous load from each prefill engine took: what
        # keeps the next ones within sync_load_ms on a slower link
        self._per_token: dict[str, float] = {}
        self.counters: dict[str, float] = {}
        # decode: when a request's params were first seen here (perf_counter), the point the
        # prefill's remaining lease is counted from (see _expires_in)
        self._seen: dict[str, float] = {}
        # decode: requests waiting to be scheduled whose prefill's lease we renew, from
        # their arrival (on_new_request) until their receive is planned or they end
        self._waiting: dict[str, _Waiting] = {}
        self._next_renewal = math.inf  # perf_counter of the first one due
        # prefill: our workers' incarnations by TP rank (vLLM's handshake metadata)
        self._incarnations: dict[int, int] = {}
        self._warned: set[str] = set()
        # serving: holds go to our own workers the moment the blocks are kept (wire.Hold)
        secret = secret_from_env(settings.secret)
        self._chan = Channels(secret) if settings.serves else None
        # holds are signed: a hold names the generation that lets a reader in (kvlink.grants)
        self._key = localkey.engine_key(settings.engine_id, secret) if settings.serves else b""
        self._sent: list[Pending] = []
        # prefill, layer-wise flow: keyed requests seen (req id -> (key, request)), when each
        # was first asked about (the wait for its decode's ids starts then), the keys whose
        # push request some worker rank reported (key -> ranks), and the candidates handed to
        # the workers with the generation minted for them
        self._keyed: dict[str, tuple[str, Any]] = {}
        # prefill: live requests by base id (base_request_id), where no router keyed them
        self._bases: dict[str, set[str]] = {}
        self._asked: dict[str, float] = {}
        self._arrived: collections.OrderedDict[str, set[int]] = collections.OrderedDict()
        self._streamed: dict[str, int] = {}

    def _count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def set_incarnations(self, incarnations: Mapping[int, int]) -> None:
        """Our workers' incarnations by TP rank (from vLLM's handshake metadata): what the
        params' registration generation names, so that a decode holding an older handshake
        handshakes again."""
        self._incarnations = {int(r): int(i) for r, i in incarnations.items() if int(i) > 0}

    def _registration(self) -> tuple[int, list[int] | None]:
        """(REGISTRATION_PARAM, INCARNATIONS_PARAM) of this prefill: (0, None) until every TP
        rank's incarnation is known."""
        incs = [self._incarnations.get(r, 0) for r in range(self.tp_size)]
        if not all(incs):
            return 0, None
        return registration_generation(incs), incs

    # ------------------------------------------------------------------ decode side
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                               ) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None)
        if params and params.get("do_remote_decode") and not params.get("do_remote_prefill"):
            self._key_by_base(request, params)
            return (None, False) if self._wait_for_decode(request, params) else (0, False)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        # only this answer's decision counts: vLLM may ask again before it allocates (no
        # blocks this step), and an earlier "in this step" must not outlive an asynchronous
        # answer (its load then planned synchronous: never reported, the request never woken)
        self._sync_hit.pop(request.request_id, None)
        self._adopt_push_proxy(request, params)
        if parse_remote(params) is None:
            return 0, False
        self._seen.setdefault(request.request_id, time.perf_counter())
        if not self.s.consumer:
            self._warn_once("prefill-on-producer", "request %s asks to load its KV "
                            "(do_remote_prefill) from a remote prefill on this kv_producer "
                            "instance: loading it, as NixlConnector does (logged once)",
                            request.request_id)
        count = _prompt_len(request) - num_computed_tokens
        if self._loads_in_step(request, params, count):
            # vLLM computes at least one token of a request it schedules: the last one's KV
            # is loaded with its block all the same, then computed again by the forward
            self._sync_hit[request.request_id] = num_computed_tokens
            return count - 1, False
        return (count, True) if count > 0 else (0, False)

    def _loads_in_step(self, request: Any, params: Mapping[str, Any], count: int) -> bool:
        """Whether this load runs inside the step that schedules its request (vLLM's
        synchronous load): a pull of at most ``sync_load_tokens`` tokens from a prefill whose
        last load here finished. The forward waits for it (every running request's step
        grows by the transfer), and in exchange the request runs at once rather than one
        engine step after its KV arrived. Also at most ``sync_load_ms`` long at the rate the
        last synchronous load from that prefill moved (a slow link shortens the loads that
        qualify). A push, or a first load from a prefill (its handshake), stays
        asynchronous."""
        if not 1 < count <= self._sync_tokens:
            return False
        remote = parse_remote(params)
        if (remote is None or remote.engine_id not in self._warm or not remote.block_ids
                or self._push(request.request_id, params)):
            return False
        per_token = self._per_token.get(remote.engine_id, 0.0)
        return count * per_token <= self.s.sync_load_ms / 1e3

    def _adopt_push_proxy(self, request: Any, params: dict[str, Any]) -> None:
        """vLLM 0.33's push proxy (its NixlPushConnector example) asks the decode and the
        prefill at once, with one ``X-Request-Id``, and gives the decode the prefill's address
        but no ``remote_block_ids`` — the prefill WRITEs into our blocks, so we never need its
        own. Taken as the keyed push flow (docs/layerwise.md, "The router contract"): the push
        request is named by our request's base id, which the prefill finds its request by
        (:meth:`_key_by_base`). Nothing can be pulled without block ids, so a decode that runs
        no side channel to be pushed through (``mode`` pull) computes such a request itself,
        saying why once."""
        if "remote_block_ids" in params:
            return
        if not self.s.serves:
            self._warn_once("push-proxy-pull", "request %s came without remote_block_ids, as "
                            "vLLM 0.33's push proxy sends it: only a decode with mode push can "
                            "take it (the prefill writes into its blocks); computed locally "
                            "(logged once)", request.request_id)
            return
        params["remote_block_ids"] = []
        params["remote_request_id"] = base_request_id(request.request_id)
        params[MODE_PARAM] = "push"

    # ------------------------------------------------------------------ prefill: keys
    def _key_by_base(self, request: Any, params: Mapping[str, Any]) -> None:
        """A prefill request no router keyed (no ``kvlink_push_key``) is found by its base id
        too (:func:`base_request_id`): vLLM 0.33's push proxy names the decode's push request
        by the id both sides were given (:meth:`_adopt_push_proxy`). Two live requests of one
        base id (a client that reused an ``X-Request-Id``) are found by neither: their
        decodes' pushes wait out their time to live and fail, never taking the other one's
        KV."""
        rid = request.request_id
        base = base_request_id(rid)
        if PUSH_KEY_PARAM in params or base == rid or rid in self._keyed:
            return
        owners = self._bases.setdefault(base, set())
        owners.add(rid)
        if len(owners) == 1:
            self._keyed[rid] = (base, request)
            return
        for other in owners:
            self._keyed.pop(other, None)
        self._plan.keys[base] = ""  # (the workers drop what they were told of it)
        self._warn_once(f"base-{base}", "requests %s share the id %s: a decode's push "
                        "request named by it finds neither", sorted(owners), base)

    def _forget_base(self, rid: str) -> None:
        base = base_request_id(rid)
        owners = self._bases.get(base)
        if owners is not None:
            owners.discard(rid)
            if not owners:
                del self._bases[base]

    # ------------------------------------------------------------------ prefill: layer-wise
    def _layerwise_candidate(self, request: Any, params: Mapping[str, Any]) -> str:
        """The request's push key if it is to be streamed layer by layer ("": not): keyed by
        the router, layer-wise on, a prompt of at least ``layerwise_min_tokens``, and one
        output token (the proxy's prefill request), so that its blocks stay what the forward
        wrote until the push ends (a running request could be preempted under it)."""
        key = params.get(PUSH_KEY_PARAM)
        if not isinstance(key, str) or not key:
            return ""
        self._keyed.setdefault(request.request_id, (key, request))
        if not self.s.layerwise or _prompt_len(request) < self.s.layerwise_min_tokens:
            return ""
        if getattr(request, "max_tokens", 1) != 1:
            self._warn_once("layerwise-max-tokens", "request %s has a push key but max_tokens="
                            "%r (not 1): pushed whole after it finishes (logged once)",
                            request.request_id, getattr(request, "max_tokens", None))
            return ""
        return key

    def _wait_for_decode(self, request: Any, params: Mapping[str, Any]) -> bool:
        """Whether a layer-wise candidate waits (vLLM asks again next step) for its decode's
        block ids: until every worker rank reported the decode's push request, at most
        ``layerwise_wait_ms`` from the first time vLLM asked. Past it, it is computed and
        pushed whole once finished (counted ``layerwise_late_requests``)."""
        key = self._layerwise_candidate(request, params)
        if not key or len(self._arrived.get(key, ())) >= self.tp_size:
            return False
        now = time.monotonic()
        first = self._asked.setdefault(request.request_id, now)
        if first < 0:  # decided already: it waits no more
            return False
        if now - first < self.s.layerwise_wait_s:
            return True
        self._asked[request.request_id] = -1.0
        self._count("layerwise_late_requests")
        log.info("request %s: its decode's block ids did not come within %.0f ms: pushed whole "
                 "after its prefill", request.request_id, 1e3 * self.s.layerwise_wait_s)
        return False

    def arrived(self, keys: Mapping[str, Collection[int]]) -> None:
        """Worker ranks that hold a decode's push request, by key (the workers' per-step
        metadata): a candidate waiting for them is scheduled on its next step."""
        for key, ranks in keys.items():
            got = self._arrived.get(key)
            if got is None:
                got = self._arrived[key] = set()
                while len(self._arrived) > 4096:  # keys of requests never sent here
                    self._arrived.popitem(last=False)
            got.update(int(r) for r in ranks)

    def plan_layerwise(self, scheduled: Mapping[str, int],
                       block_ids_of: Callable[[str], tuple[int, ...]] | None) -> None:
        """Prefill: the layer-wise candidates whose prompt's last token is computed in this
        step go to the workers with their blocks and a generation, before the forward; every
        keyed request's key goes once, for its decode's push request to find it."""
        for req_id, (key, request) in list(self._keyed.items()):
            n = scheduled.get(req_id)
            if n is None:
                continue
            self._plan.keys[key] = req_id
            if req_id in self._streamed or block_ids_of is None:
                continue
            params = getattr(request, "kv_transfer_params", None) or {}
            if not self._layerwise_candidate(request, params):
                continue
            if int(getattr(request, "num_computed_tokens", 0)) + n < _prompt_len(request):
                continue  # an earlier chunk: streamed at its last one
            ids = tuple(int(b) for b in block_ids_of(req_id))
            if not ids:
                continue
            generation = new_generation()
            self._streamed[req_id] = generation
            self._plan.layerwise.append(LayerReq(req_id, key, ids, generation))
            self._arrived.pop(key, None)
            self._asked.pop(req_id, None)

    def on_new_request(self, request: Any) -> None:
        """Decode (vLLM >= 0.32 calls it as a request arrives): a request to load from a
        prefill whose params give its lease is renewed while it waits in our queue, every
        :data:`RENEW_EVERY` of that lease (:meth:`_plan_renewals`), so a busy decode does not
        lose the prefill's blocks to the lease before it schedules the request. NixlConnector
        renews by heartbeats the same way."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not params.get("do_remote_prefill"):
            return
        remote = parse_remote(params)
        if remote is None or remote.expiry is None or remote.clock is None:
            return
        lease = remote.expiry - remote.clock
        if lease > 0:
            now = time.perf_counter()
            self._seen.setdefault(request.request_id, now)
            self._waiting[request.request_id] = _Waiting(remote, lease, now)
            self._next_renewal = min(self._next_renewal, now + lease * RENEW_EVERY)

    def _plan_renewals(self) -> None:
        """The waiting requests due a renewal go in this step's plan, one per prefill; from
        now on the lease left is counted from now (:meth:`_expires_in`): the prefill renews
        it on the message's arrival, later. Were it lost (the prefill restarted, the cap of
        its ``renew_limit``), the READ is refused or told not intact: a failed receive."""
        now = time.perf_counter()
        if now < self._next_renewal:
            return
        due: dict[tuple[str, str, int], tuple[Remote, list[str]]] = {}
        self._next_renewal = math.inf
        for req_id, w in list(self._waiting.items()):
            if now - w.last >= w.every:
                if self._seen.get(req_id, w.last) + w.lease <= now:
                    # over by our count already (no step came within the lease): the prefill
                    # may have released it, and no renewal makes that good: refused when
                    # its blocks come (_expires_in)
                    del self._waiting[req_id]
                    continue
                w.last = self._seen[req_id] = now
                r = w.remote
                due.setdefault((r.engine_id, r.host, r.port), (r, []))[1].append(r.request_id)
            self._next_renewal = min(self._next_renewal, w.last + w.every)
        self._plan.renew.extend(Renewal(r, tuple(ids)) for r, ids in due.values())

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None)
        self._waiting.pop(request.request_id, None)
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        seen = self._seen.pop(request.request_id, None)
        remote = parse_remote(params)
        if remote is None:
            log.warning("request %s: incomplete kv_transfer_params %s; computing locally",
                        request.request_id, {k: params.get(k) for k in params})
            return
        hit = self._sync_hit.pop(request.request_id, None)
        if num_external_tokens <= 0:
            # Full local prefix hit: nothing to read, but the prefill holds blocks for us.
            self._plan.release.append(remote)
            return
        sync = hit is not None
        # a synchronous load's blocks are cached (hashed) as they are allocated: the blocks
        # past the local prefix hit are the prompt's tail, the last one included
        local = (tuple(blocks.get_block_ids()[0][hit // self.block_size:]) if hit is not None
                 else _unhashed_block_ids(blocks))
        expires_in = self._expires_in(request.request_id, remote, params, seen)
        refused = size_refusal(params)
        if not refused and expires_in is not None and expires_in <= 0:
            refused = (f"{EXPIRY_PARAM} passed {-expires_in:.3f}s before the READ could "
                       "start (the prefill's lease of the blocks is over): not started")
        push = not sync and self._push(request.request_id, params)
        self._plan.recv.append(RecvReq(request.request_id, remote, local, num_external_tokens,
                                       push, expires_in=expires_in, refused=refused, sync=sync))
        # counted as the prompt tokens it covers: a synchronous load's last one is loaded too
        self._loading[request.request_id] = _Load(num_external_tokens + (1 if sync else 0),
                                                  local, remote.engine_id)
        if sync:
            self._count("sync_loads")

    def _expires_in(self, req_id: str, remote: Remote, params: Mapping[str, Any],
                    seen: float | None) -> float | None:
        """Seconds left of the prefill's lease, on our clock: ``expiry - clock`` (both on the
        prefill's clock) counted from when the params were first seen here, which is later
        than when they were written, so it never ends before the prefill's lease does. None
        when the params carry no deadline, or one that cannot be related to our clock (no
        ``kvlink_clock``: NixlConnector relates it by a clock sample in its handshake, which
        kvlink's handshake has not; its validate-after-read still guards the bytes)."""
        if remote.expiry is None:
            return None
        if remote.clock is None:
            self._warn_once("expiry-no-clock", "request %s: %s=%r without %s: the deadline "
                            "cannot be related to this host's clock and is not enforced "
                            "(logged once)", req_id, EXPIRY_PARAM, params.get(EXPIRY_PARAM),
                            CLOCK_PARAM)
            return None
        now = time.perf_counter()
        return (seen if seen is not None else now) + (remote.expiry - remote.clock) - now

    def _push(self, req_id: str, params: Mapping[str, Any]) -> bool:
        """Pull or push for this request: what its params name (``kvlink_mode``, else the
        prefill's ``transfer_mode``), else the ``mode`` setting. Push needs this instance's side
        channel, which a consumer runs only with ``mode: push``; without it, it is pulled."""
        wanted = params.get(MODE_PARAM) or params.get(TRANSFER_MODE_PARAM) or self.s.mode
        if wanted not in MODES:
            self._warn_once("mode-invalid", "request %s: %s=%r / %s=%r is not one of %s; "
                            "using %s (logged once)", req_id, MODE_PARAM,
                            params.get(MODE_PARAM), TRANSFER_MODE_PARAM,
                            params.get(TRANSFER_MODE_PARAM), list(MODES), self.s.mode)
            wanted = self.s.mode
        if wanted == "push" and not self.s.serves:
            self._warn_once("push-unserved", "request %s asks for push but this instance runs "
                            "no side channel for the prefill to write through (mode pull); "
                            "pulling (logged once)", req_id)
            return False
        return bool(wanted == "push")

    # ------------------------------------------------------------------ prefill side
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any]
                                                                            | None]:
        params = getattr(request, "kv_transfer_params", None)
        self._seen.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._sync_hit.pop(request.request_id, None)
        self._keyed.pop(request.request_id, None)
        self._forget_base(request.request_id)
        self._asked.pop(request.request_id, None)
        streamed = self._streamed.pop(request.request_id, None)
        status = getattr(getattr(request, "status", None), "name", "")
        if streamed is not None and (status not in _FINISHED_OK or not block_ids
                                     or not params or not params.get("do_remote_decode")):
            # a worker may have held it at its forward and be writing from its blocks: they
            # are freed once the workers say so (finished sending), never under a WRITE
            self._plan.aborted.append(request.request_id)
            return True, None
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: release the prefill's lease.
            params["do_remote_prefill"] = False
            remote = parse_remote(params)
            if remote is not None:
                self._plan.release.append(remote)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if status not in _FINISHED_OK or not block_ids:
            return False, None  # aborted, or nothing computed: free now
        if not self._may_serve(request.request_id):
            return False, None
        ids = tuple(int(b) for b in block_ids)
        # minted here, where the blocks are kept from now on: the decode READs them at once
        # and the worker's hold (next step) validates it after the READ. A layer-wise
        # candidate's was minted at its forward, where a worker may have held it already
        generation = streamed if streamed is not None else new_generation()
        self._plan.send.append(SendReq(request.request_id, ids, generation))
        self._hold_now(request.request_id, ids, generation)
        self._count("held_requests")
        return True, self._params(request, ids, generation)

    def _may_serve(self, req_id: str) -> bool:
        """A request asking for ``do_remote_decode`` is held on any instance whose workers
        serve readers (a side channel), whatever its kv_role."""
        if not self.s.serves:
            self._warn_once("decode-unserved", "request %s asks for do_remote_decode but this "
                            "kv_consumer instance (mode pull) runs no side channel for readers: "
                            "its blocks are freed now and no kv_transfer_params are returned; "
                            "use kv_role kv_both (or mode push) to serve prefills too (logged "
                            "once)", req_id)
            return False
        if not self.s.producer:
            self._warn_once("decode-on-consumer", "request %s asks for do_remote_decode on this "
                            "kv_consumer instance: holding its blocks for a reader, as "
                            "NixlConnector does (logged once)", req_id)
        return True

    def _params(self, request: Any, ids: tuple[int, ...], generation: int) -> dict[str, Any]:
        """The kv_transfer_params a decode needs: vLLM 0.33's NixlConnector keys with their
        meaning, plus kvlink's (block size, hold generation, clock, per-rank incarnations)."""
        now = time.perf_counter()
        registration, incarnations = self._registration()
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids)],
            "remote_engine_id": self.s.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.s.public_host,
            "remote_port": self.side_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": int(getattr(request, "num_computed_tokens", 0)),
            # the worker's lease starts at its hold, after this: the deadline is conservative
            EXPIRY_PARAM: now + self.s.lease_seconds,
            REGISTRATION_PARAM: registration,
            TRANSFER_MODE_PARAM: self.s.mode,
            "kvlink_block_size": self.block_size,
            GENERATION_PARAM: generation,
            CLOCK_PARAM: now,
        }
        if incarnations is not None:
            out[INCARNATIONS_PARAM] = incarnations
        return out

    def _hold_now(self, req_id: str, ids: tuple[int, ...], generation: int) -> None:
        """Tell every local worker rank to hold now (the step's plan carries the same hold, for
        a worker that did not get this: whichever comes first holds). Never blocks."""
        if self._chan is None:
            return
        host = self.s.host if self.s.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        body = wire.hold_body(self.s.engine_id, req_id, list(ids), generation)
        msg = wire.Hold(v=WIRE_VERSION, engine_id=self.s.engine_id, req_id=req_id,
                        block_ids=list(ids), generation=generation,
                        mac=localkey.sign(self._key, body))
        self._sent += [self._chan.call(host, self.side_port + r, msg, 2.0)
                       for r in range(self.tp_size)]
        self._chan.flush()

    # ------------------------------------------------------------------ every step
    def build_plan(self) -> StepPlan:
        if self._chan is not None and self._sent:
            self._chan.pump()
            for p in [p for p in self._sent if p.done()]:
                self._sent.remove(p)
                if p.exception() is not None:
                    log.info("a hold did not reach its worker now (the step's plan carries "
                             "it): %s", p.exception())
        if self._waiting:
            self._plan_renewals()
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_output(self, finished_recving: set[str] | None, failed_recving: set[str] | None,
                      invalid_block_ids: set[int] | None,
                      synced: Mapping[str, float] | None = None) -> None:
        """One step's receive outcomes: asynchronous loads finished (``failed_recving`` or
        ``invalid_block_ids`` say which failed) and synchronous ones settled before that
        step's forward (``synced``: request -> the seconds the slowest worker rank took, or a
        negative number where one failed)."""
        failed = set(failed_recving or ())
        bad = set(invalid_block_ids or ())
        outcomes: list[tuple[str, bool, float | None]] = [
            (req, req not in failed, None) for req in finished_recving or ()]
        outcomes += [(req, took >= 0, took) for req, took in (synced or {}).items()]
        for req, ok, took in outcomes:
            load = self._loading.pop(req, None)
            if load is None:
                continue
            if ok and not bad.intersection(load.blocks):
                self._count("loaded_requests")
                self._count("loaded_tokens", load.tokens)
                self._warm.add(load.engine)
                if took is not None and load.tokens:
                    self._per_token[load.engine] = took / load.tokens
            else:
                self._count("load_failed_requests")
                self._count("load_failed_tokens", load.tokens)
                self._warm.discard(load.engine)  # its next load waits for nobody's forward

    def take_counters(self) -> dict[str, float]:
        out, self.counters = self.counters, {}
        return out

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
