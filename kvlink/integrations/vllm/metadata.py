"""What the scheduler side hands the workers, and what the prefill tells the decode (no vLLM
import).

The per-step plan is what the scheduler-side connector hands the workers each step (wrapped in
vLLM's ``KVConnectorMetadata``: ``connector.KVLinkConnectorMetadata``): requests to pull,
prefill requests to hold for readers, and remote requests to release without reading. It
crosses a process boundary, so it is plain data. The ``kv_transfer_params`` keys are
NixlConnector's with NixlConnector's meaning, plus kvlink's; :func:`parse_remote` reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvlink import wire
from kvlink.errors import ConfigError

#: kv_transfer_params key a router may set to pick the mode of one request (decode side)
MODE_PARAM = "kvlink_mode"
#: kv_transfer_params key: the prefill's hold generation, so the decode READs without asking
GENERATION_PARAM = "kvlink_generation"
#: vLLM >= 0.32's NixlConnector key (seconds on the prefill scheduler's ``time.perf_counter``):
#: the lease deadline of the blocks; the decode does not start a READ after it
EXPIRY_PARAM = "remote_blocks_expiry_time"
#: kvlink key: the prefill scheduler's ``time.perf_counter`` when it wrote the params, the
#: reference :data:`EXPIRY_PARAM` is relative to (clocks of two hosts are not comparable:
#: the decode rebases ``expiry - clock`` onto its own clock, as 0.33's workers rebase the
#: scheduler's deadlines with ``NixlConnectorMetadata.scheduler_clock``)
CLOCK_PARAM = "kvlink_clock"
#: vLLM 0.33's NixlConnector key: which registration of the prefill's KV cache the block ids
#: belong to; a decode whose handshake is of another one handshakes again. kvlink's is the
#: prefill ranks' incarnation (:func:`registration_generation`)
REGISTRATION_PARAM = "remote_registration_generation"
#: kvlink key: the incarnation of each prefill TP rank (the registration, per rank)
INCARNATIONS_PARAM = "kvlink_incarnations"
#: vLLM >= 0.32's NixlConnector key: "pull" (the decode READs) or "push" (the prefill WRITEs)
TRANSFER_MODE_PARAM = "transfer_mode"

#: kvlink key (layer-wise flow, docs/layerwise.md): the id a router minted for one request and
#: gave both sides: the prefill gets it in its kv_transfer_params, the decode as
#: ``remote_request_id`` (with no ``remote_block_ids``: the prefill WRITEs into the decode's
#: blocks as its forward reaches each layer, so the decode must ask before the prefill computes)
PUSH_KEY_PARAM = "kvlink_push_key"

#: the suffix vLLM's input processor appends to a request's external id (``-`` and 8 hex
#: digits of a random uuid: ``assign_request_id``), so that two requests sent the same
#: ``X-Request-Id`` stay apart inside the engine
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(req_id: str) -> str:
    """A vLLM request id without the random suffix its engine added: the id the client (or a
    router's ``X-Request-Id``) gave the request, the same on a prefill and a decode asked
    with one id — what vLLM 0.33's push proxy relies on to pair them (docs/vllm.md, "Push
    mode")."""
    return _RANDOM_SUFFIX.sub("", req_id)


#: kv_transfer_params keys vLLM's NixlConnector (0.32 and 0.33) uses, same names, same meaning.
PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
              "remote_host", "remote_port", "remote_request_id", "tp_size", "dcp_size",
              "pp_size", "remote_num_tokens", EXPIRY_PARAM, REGISTRATION_PARAM,
              TRANSFER_MODE_PARAM)


@dataclasses.dataclass(frozen=True)
class Remote:
    """Where a prefill's blocks live: the NixlConnector-style params, parsed."""

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[int, ...]
    block_size: int = 0  # the remote scheduler's block size in tokens (0: same as ours)
    generation: int = 0  # the prefill's hold (GENERATION_PARAM): READ at once, validate after
    #: REGISTRATION_PARAM (0: not given); for a one-rank prefill it is that rank's incarnation
    registration: int = 0
    incarnations: tuple[int, ...] = ()  # INCARNATIONS_PARAM, one per prefill TP rank
    expiry: float | None = None  # EXPIRY_PARAM, on the prefill scheduler's perf_counter
    clock: float | None = None  # CLOCK_PARAM: that clock when the params were written

    def incarnation_of(self, rank: int) -> int | None:
        """The incarnation the params say ``rank`` of the prefill had when it held the
        request (None: they do not say)."""
        if len(self.incarnations) == self.tp_size:
            return self.incarnations[rank] or None
        if self.tp_size == 1 and self.registration:
            return self.registration  # one rank: the registration is its incarnation
        return None


@dataclasses.dataclass(frozen=True)
class RecvReq:
    req_id: str  # local (decode) request id
    remote: Remote
    local_block_ids: tuple[int, ...]
    num_tokens: int
    push: bool = False  # the prefill WRITEs into local_block_ids (else we READ them)
    #: seconds left until the prefill's lease deadline (EXPIRY_PARAM), as the scheduler saw it
    #: when it planned the receive (None: not known). The worker rebases it onto its clock on
    #: arrival, which only lengthens it: never refuses a READ the lease still covers. A local,
    #: time-dependent hint, not part of what the receive is (compare=False)
    expires_in: float | None = dataclasses.field(default=None, compare=False)
    #: why the scheduler refuses this receive ("": it does not): the workers report it failed
    #: without moving anything, so vLLM recomputes or fails it (kv_load_failure_policy)
    refused: str = ""
    #: vLLM's synchronous load (``sync_load_tokens``): the request runs in this very step, so
    #: the workers settle the READ before the forward and report a failure as invalid blocks
    #: (the step's output is then dropped and the blocks recomputed or the request failed),
    #: never as a finished receive
    sync: bool = False


@dataclasses.dataclass(frozen=True)
class SendReq:
    req_id: str
    block_ids: tuple[int, ...]
    generation: int = 0  # minted where the blocks were kept (request_finished); 0: the worker's


@dataclasses.dataclass(frozen=True)
class LayerReq:
    """Prefill, layer-wise flow: a keyed request whose (last) prefill chunk runs this step.

    The worker streams it layer by layer if its decode's push request is there when the
    forward starts (it holds ``block_ids`` under ``generation`` then, the generation the
    scheduler's hold at request_finished uses too); else it is pushed whole after the forward.
    """

    req_id: str
    key: str  # PUSH_KEY_PARAM: the req_id of the decode's push request
    block_ids: tuple[int, ...]  # the request's (scheduler) blocks, the whole prompt
    generation: int


@dataclasses.dataclass
class Renewal:
    """Decode: requests of one prefill that still wait in our queue; the workers ask each
    prefill rank holding heads of theirs to renew the leases (KVWorker.renew)."""

    remote: Remote  # (one of them: the prefill's address)
    request_ids: tuple[str, ...]  # the prefill's request ids


@dataclasses.dataclass
class StepPlan:
    recv: list[RecvReq] = dataclasses.field(default_factory=list)
    send: list[SendReq] = dataclasses.field(default_factory=list)
    release: list[Remote] = dataclasses.field(default_factory=list)  # notify without reading
    #: prefill, layer-wise flow: candidates of this step's forward (see LayerReq)
    layerwise: list[LayerReq] = dataclasses.field(default_factory=list)
    #: prefill: PUSH_KEY_PARAM -> our request id, for push requests named by the key
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    #: prefill: layer-wise candidates that finished otherwise (aborted, stopped early): a
    #: worker that held them early releases them; either way they are reported sent
    aborted: list[str] = dataclasses.field(default_factory=list)
    #: whether this step runs a forward (the scheduler scheduled tokens); None where its
    #: output did not say, and then the forward context does (see KVLinkConnector
    #: .start_load_kv: vLLM's GPU model runner V2 calls it outside any forward's context)
    forward: bool | None = None
    #: decode: leases to renew for requests still waiting to be scheduled (Renewal)
    renew: list[Renewal] = dataclasses.field(default_factory=list)


def flat_block_ids(raw: Any) -> tuple[int, ...] | None:
    """``remote_block_ids`` as a flat tuple: accepts a flat list or one list per KV group
    (vLLM 0.32's NixlConnector sends ``[[...]]``); several non-empty groups are unsupported."""
    if not isinstance(raw, (list, tuple)):
        return None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return tuple(int(x) for x in raw)
    groups = [g for g in raw if isinstance(g, (list, tuple))]
    if len(groups) != len(raw):
        return None
    nonempty = [g for g in groups if g]
    if len(nonempty) > 1:
        return None
    ids = nonempty[0] if nonempty else []
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        return None
    return tuple(int(x) for x in ids)


def _generation(raw: Any) -> int:
    """A hold generation off the params, or 0 (ask with a read intent) when absent or bad."""
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 < raw < 2**63:
        return raw
    return 0


def _seconds(raw: Any) -> float | None:
    """A finite number of seconds off the params, or None (not given, or not a number: the
    deadline is then not enforced, as 0.33's NixlConnector reads a missing one)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    value = float(raw)
    return value if math.isfinite(value) else None


def _incarnations(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        return ()
    out = tuple(_generation(x) for x in raw)
    return out if all(out) else ()


def registration_generation(incarnations: Sequence[int]) -> int:
    """:data:`REGISTRATION_PARAM` for a prefill whose TP ranks have these incarnations (by
    rank): the incarnation itself for one rank, else a 63-bit digest of them; 0 if unknown.
    It changes exactly when a rank restarts (kvlink registers its KV cache once per process,
    and refuses vLLM's sleep mode, which would register it again)."""
    if not incarnations:
        return 0
    if len(incarnations) == 1:
        return int(incarnations[0])
    raw = b"".join(int(x).to_bytes(8, "little") for x in incarnations)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1 or 1


def size_refusal(params: Mapping[str, Any]) -> str:
    """Why a receive with these params is refused for its parallel layout ("": it is not):
    kvlink moves the KV of one pipeline stage and of whole (not context-sharded) sequences."""
    for key, what in (("pp_size", "pipeline stages"), ("dcp_size", "decode context shards")):
        raw = params.get(key, 1)
        if raw is None or (isinstance(raw, int) and not isinstance(raw, bool) and raw == 1):
            continue
        return (f"kv_transfer_params {key}={raw!r}: kvlink moves the KV of one prefill without "
                f"{what} ({key} must be 1)")
    return ""


def parse_remote(params: Mapping[str, Any]) -> Remote | None:
    """The remote prefill named by a request's kv_transfer_params, or None if incomplete or
    out of bounds — what a client sent, checked here, on the scheduler's path: a value the
    rest cannot take (a port of 1e400, a block id past int64, an id with a newline, which
    the prefill's side channel would refuse with every message in its frame) makes the
    request compute locally, never an exception in vLLM's scheduler or worker."""
    ids = flat_block_ids(params.get("remote_block_ids"))
    engine, req = _text(params.get("remote_engine_id")), _text(params.get("remote_request_id"))
    host = _text(params.get("remote_host"), wire.MAX_HOST_LEN)
    port = _bounded(params.get("remote_port"), 1, wire.MAX_PORT)
    tp_size = _bounded(params.get("tp_size") or 1, 1, wire.MAX_TP)
    block_size = _bounded(params.get("kvlink_block_size") or 0, 0, wire.MAX_BLOCK_SIZE)
    if (ids is None or len(ids) > wire.MAX_BLOCK_IDS
            or not all(0 <= b <= wire.MAX_BLOCK_ID for b in ids) or engine is None
            or req is None or host is None or port is None or tp_size is None
            or block_size is None):
        return None
    return Remote(engine_id=engine, request_id=req, host=host, port=port, tp_size=tp_size,
                  block_ids=ids, block_size=block_size,
                  generation=_generation(params.get(GENERATION_PARAM)),
                  registration=_generation(params.get(REGISTRATION_PARAM)),
                  incarnations=_incarnations(params.get(INCARNATIONS_PARAM)),
                  expiry=_seconds(params.get(EXPIRY_PARAM)),
                  clock=_seconds(params.get(CLOCK_PARAM)))


def _bounded(raw: Any, lo: int, hi: int) -> int | None:
    """An integer in ``[lo, hi]`` off the params (an int, an integral float or a numeral, as
    ``int()`` took them before), else None."""
    if isinstance(raw, bool):
        return None
    try:
        value = int(raw)
    except (TypeError, ValueError, OverflowError):
        return None
    if isinstance(raw, float) and raw != value:
        return None
    return value if lo <= value <= hi else None


def _text(raw: Any, limit: int = wire.MAX_ID_LEN) -> str | None:
    """A non-empty id or host off the params that a peer's side channel takes
    (:func:`kvlink.wire.check_id`, and at most ``limit`` characters), else None."""
    if raw is None or isinstance(raw, (bool, list, tuple, dict)):
        return None
    text = str(raw)
    if not text or len(text) > limit:
        return None
    try:
        return wire.check_id(text, "kv_transfer_params value")
    except ConfigError:
        return None
