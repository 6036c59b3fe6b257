"""Settings and the per-step plan shared by the scheduler and worker sides (no vLLM import).

The plan is what the scheduler-side connector hands the workers each step (wrapped in vLLM's
``KVConnectorMetadata``): requests to pull, prefill requests to hold for readers, and remote
requests to release without reading. It crosses a process boundary, so it is plain data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvlink import options
from kvlink.errors import ConfigError
from kvlink.integrity import Level

DEFAULT_SIDE_PORT = 5600
DEFAULT_LEASE_SECONDS = 120.0
DEFAULT_PUSH_TIMEOUT = 30.0
MODES = ("pull", "push")
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
#: default of ``layerwise_min_tokens``: below it a request is pushed whole after its prefill
#: (see docs/layerwise.md for the measurement behind it)
DEFAULT_LAYERWISE_MIN_TOKENS = 512
#: default of ``layerwise_wait_ms``: how long a prefill keeps a keyed request waiting for its
#: decode's block ids before it computes it anyway (then pushed whole)
DEFAULT_LAYERWISE_WAIT_MS = 50.0

#: kv_transfer_params keys vLLM's NixlConnector (0.32 and 0.33) uses, same names, same meaning.
PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
              "remote_host", "remote_port", "remote_request_id", "tp_size", "dcp_size",
              "pp_size", "remote_num_tokens", EXPIRY_PARAM, REGISTRATION_PARAM,
              TRANSFER_MODE_PARAM)


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            try:
                return int(v)
            except ValueError:
                raise ConfigError(f"environment variable {n}={v!r} is not an integer") from None
    return None


_WHERE = "kv_connector_extra_config"


class ExtraConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Every key ``kv_connector_extra_config`` may hold (see :class:`Settings`); None: unset
    (the default, or an environment variable, applies)."""

    transport: str | list[str] | None = None
    transports: str | list[str] | None = None  # alias of transport
    transport_options: dict[str, dict[str, Any]] | None = None
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    advertise_host: str | None = None
    kv_lease_duration: float | None = None
    lease_seconds: float | None = None  # alias of kv_lease_duration
    read_pin_seconds: float = 60.0
    handshake_timeout: float = 10.0
    read_intent_timeout: float = 10.0
    idle_yield_ms: float = 2.0
    secret: str | None = None
    allow_insecure: bool = False
    mode: str = "pull"
    push_timeout: float = DEFAULT_PUSH_TIMEOUT
    grants: bool = True  # least privilege on the data plane (WorkerConfig.grants)
    integrity: str = "off"  # end-to-end KV digests (WorkerConfig.integrity, docs/integrity.md)
    hold_board: bool = True  # same-host READs validated in shared memory (kvlink.holdboard)
    layerwise: bool = False  # prefill: stream keyed requests layer by layer (docs/layerwise.md)
    layerwise_min_tokens: int = DEFAULT_LAYERWISE_MIN_TOKENS
    layerwise_wait_ms: float = DEFAULT_LAYERWISE_WAIT_MS


#: other connectors' keys kvlink takes with the same meaning: key -> (connector, transport,
#: that transport's option)
TRANSLATED = {
    "backends": ("NixlConnector", "nixl", "backends"),
    "num_threads": ("NixlConnector", "nixl", "num_threads"),
    "mooncake_protocol": ("MooncakeConnector", "mooncake", "protocol"),
    "device_name": ("MooncakeConnector", "mooncake", "device_name"),
}

#: other connectors' keys kvlink has no equivalent for: key -> why / what to use instead
REFUSED = {
    "kv_recompute_threshold": "NixlConnector's kv_recompute_threshold has no kvlink equivalent",
    "bidirectional_kv_xfer": "NixlConnector's bidirectional_kv_xfer has no kvlink equivalent "
                             "(for the prefill to WRITE into the decode set mode: \"push\" "
                             "on the decode)",
    "decoder_kv_blocks_ttl": "NixlConnector's decoder_kv_blocks_ttl has no kvlink equivalent "
                             "(a push-mode decode's reservation is push_timeout)",
    "engine_ttl": "NixlConnector's engine_ttl has no kvlink equivalent",
    "enforce_handshake_compat": "NixlConnector's enforce_handshake_compat has no kvlink "
                                "equivalent (kvlink always checks the layouts it is handed)",
    "num_workers": "MooncakeConnector's num_workers has no kvlink equivalent",
    "bootstrap_server_address": "MooncakeConnector's bootstrap_server_address has no kvlink "
                                "equivalent (decodes dial the prefill's side_channel_host / "
                                "side_channel_port, from kv_transfer_params)",
    "preferred_segment": "MooncakeConnector's preferred_segment has no kvlink equivalent",
}


def _names(key: str, raw: Any) -> tuple[str, ...]:
    names = tuple(raw.split(",") if isinstance(raw, str) else raw)
    if not names or not all(isinstance(x, str) and x for x in names):
        raise ConfigError(f"{_WHERE}.{key} must name transports, got {raw!r}")
    return names


def parse_extra(extra: Mapping[str, Any] | None) -> ExtraConfig:
    """``kv_connector_extra_config`` checked key by key, other connectors' keys translated
    (:data:`TRANSLATED`) or refused (:data:`REFUSED`), transport options checked against
    their schemas (kvlink.options)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"{_WHERE} must be a mapping, got {extra!r}")
    raw = dict(extra or {})
    fields = options.field_types(ExtraConfig)
    vals: dict[str, Any] = {}
    foreign: dict[str, Any] = {}
    for key, value in raw.items():
        if key in TRANSLATED:
            foreign[key] = value
        elif key in REFUSED:
            raise ConfigError(f"{_WHERE}: {key!r} is not a kvlink key: {REFUSED[key]}")
        elif key not in fields:
            raise ConfigError(f"{_WHERE}: unknown key {key!r}"
                              f"{options.did_you_mean(str(key), fields)}")
        else:
            vals[key] = options.convert(key, value, fields[key])
    for a, b in (("transport", "transports"), ("kv_lease_duration", "lease_seconds")):
        if a in vals and b in vals and vals[a] != vals[b]:
            raise ConfigError(f"{_WHERE}: {a}={vals[a]!r} and its alias {b}={vals[b]!r} "
                              f"disagree; set {a} only")
    named = "transport" if "transport" in vals else "transports"
    given = _names(named, vals[named]) if vals.get(named) is not None else None
    opts: dict[str, dict[str, Any]] = {str(k): dict(v) for k, v in
                                       (vals.get("transport_options") or {}).items()}
    implied: list[str] = []
    for key, value in foreign.items():
        connector, transport, option = TRANSLATED[key]
        if given is not None and transport not in given:
            raise ConfigError(
                f"{_WHERE}: {key!r} is {connector}'s key for kvlink's {transport} transport, "
                f"but transport is {list(given)}; use transport: {transport!r} with "
                f"transport_options: {{{transport!r}: {{{option!r}: {value!r}}}}}")
        mine = opts.setdefault(transport, {})
        value = options.convert(key, value, options.field_types(options.SCHEMAS[transport])[
            option])
        if option in mine and options.check_options(transport, {option: mine[option]}) != {
                option: value}:
            raise ConfigError(f"{_WHERE}: {key}={value!r} ({connector}'s key) disagrees with "
                              f"transport_options.{transport}.{option}={mine[option]!r}; "
                              f"set the latter only")
        mine[option] = value
        if transport not in implied:
            implied.append(transport)
    transports = given if given is not None else tuple(implied) or ("tcp",)
    for name, o in opts.items():
        if name not in options.SCHEMAS and name not in transports:
            known = set(options.SCHEMAS) | set(transports)
            raise ConfigError(f"{_WHERE}.transport_options: {name!r} is neither a transport in "
                              f"use ({list(transports)}) nor a built-in one"
                              f"{options.did_you_mean(name, known)}")
        opts[name] = options.check_options(name, o)
    vals["transport"] = list(transports)
    vals.pop("transports", None)
    vals["transport_options"] = opts
    if "lease_seconds" in vals:
        vals.setdefault("kv_lease_duration", vals.pop("lease_seconds"))
        vals.pop("lease_seconds", None)
    return ExtraConfig(**vals)


@dataclasses.dataclass(frozen=True)
class Settings:
    """``kv_transfer_config`` as kvlink reads it (``kv_connector_extra_config`` keys below,
    checked by :func:`parse_extra`: an unknown key or a value of the wrong type fails at
    startup naming the key).

    ``transport`` (str or list, default "tcp"), ``transport_options`` ({name: {...}}, checked
    against kvlink.options), ``side_channel_host`` / ``side_channel_port`` (else env
    ``KVLINK_SIDE_CHANNEL_HOST|PORT``, then ``VLLM_NIXL_SIDE_CHANNEL_HOST|PORT``; rank r of DP
    rank d listens on ``port + d * tp + r``), ``advertise_host``, ``kv_lease_duration`` (seconds
    a prefill holds blocks for readers), ``read_pin_seconds``, ``handshake_timeout``,
    ``read_intent_timeout``, ``idle_yield_ms``, ``secret`` (side channel HMAC; else env
    ``KVLINK_SECRET``), ``allow_insecure``, ``mode`` ("pull" or "push": how a consumer gets the
    KV; see docs/vllm.md), ``push_timeout`` (seconds a consumer keeps blocks reserved for a
    push), ``grants`` (least privilege on the data plane, default true) and ``integrity``
    ("off", "sample", "full": end-to-end KV digests, pull and push), ``hold_board`` (same-host
    READs validated in shared memory instead of a round trip, default true), ``layerwise``
    (prefill: push requests that carry a router's ``kvlink_push_key`` layer by layer during
    their forward, default false; docs/layerwise.md), ``layerwise_min_tokens`` (prompts shorter
    than this are pushed whole after the forward) and ``layerwise_wait_ms`` (how long a keyed
    request waits for its decode's block ids before it is computed and pushed whole).
    NixlConnector's ``backends`` / ``num_threads`` and MooncakeConnector's ``mooncake_protocol`` /
    ``device_name`` become the nixl / mooncake transport's options.
    """

    engine_id: str
    producer: bool
    consumer: bool
    transports: tuple[str, ...] = ("tcp",)
    transport_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    side_port: int = DEFAULT_SIDE_PORT
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    pin_seconds: float = 60.0
    handshake_timeout: float = 10.0
    intent_timeout: float = 10.0
    idle_yield_s: float = 0.002  # sleep of an idle step while transfers are outstanding
    secret: str | None = None  # side-channel HMAC secret (default: env KVLINK_SECRET)
    allow_insecure: bool = False
    mode: str = "pull"  # consumer: "pull" (READ from the prefill) or "push" (prefill WRITEs)
    push_timeout: float = DEFAULT_PUSH_TIMEOUT  # consumer: blocks reserved for a push at most
    grants: bool = True  # WorkerConfig.grants: serve a peer only what was granted to it
    integrity: str = "off"  # WorkerConfig.integrity: "off", "sample" or "full"
    hold_board: bool = True  # WorkerConfig.hold_board
    layerwise: bool = False  # prefill: layer-wise pushes of keyed requests
    layerwise_min_tokens: int = DEFAULT_LAYERWISE_MIN_TOKENS
    layerwise_wait_s: float = DEFAULT_LAYERWISE_WAIT_MS / 1e3

    @property
    def serves(self) -> bool:
        """Runs a side channel: producers (answering readers and pushers' requests) and push
        consumers (the prefill handshakes back to write into them)."""
        return self.producer or (self.consumer and self.mode == "push")

    @classmethod
    def from_config(cls, engine_id: str, kv_role: str, extra: Mapping[str, Any] | None
                    ) -> Settings:
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, "
                              f"got {kv_role!r}")
        x = parse_extra(extra)
        host = str(x.side_channel_host or os.environ.get("KVLINK_SIDE_CHANNEL_HOST")
                   or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1")
        if host == "localhost":
            host = "127.0.0.1"
        port = x.side_channel_port
        if port is None:
            port = _env_int("KVLINK_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")
        if x.mode not in MODES:
            raise ConfigError(f"{_WHERE}.mode must be one of {list(MODES)}, got {x.mode!r}")
        Level.parse(x.integrity, f"{_WHERE}.integrity")
        assert isinstance(x.transport, list)
        s = cls(
            engine_id=engine_id, producer=kv_role in ("kv_producer", "kv_both"),
            consumer=kv_role in ("kv_consumer", "kv_both"), transports=tuple(x.transport),
            transport_options=x.transport_options or {}, host=host,
            advertise_host=x.advertise_host,
            side_port=port if port is not None else DEFAULT_SIDE_PORT,
            lease_seconds=(x.kv_lease_duration if x.kv_lease_duration is not None
                           else DEFAULT_LEASE_SECONDS),
            pin_seconds=x.read_pin_seconds, handshake_timeout=x.handshake_timeout,
            intent_timeout=x.read_intent_timeout, idle_yield_s=x.idle_yield_ms / 1e3,
            secret=x.secret, allow_insecure=x.allow_insecure, mode=x.mode,
            push_timeout=x.push_timeout, grants=x.grants, integrity=x.integrity,
            hold_board=x.hold_board, layerwise=x.layerwise,
            layerwise_min_tokens=x.layerwise_min_tokens,
            layerwise_wait_s=x.layerwise_wait_ms / 1e3,
        )
        if s.layerwise and not s.producer:
            raise ConfigError(f"{_WHERE}.layerwise is a prefill setting (kv_role kv_producer or "
                              f"kv_both); a decode takes layer-wise pushes in mode push")
        if s.layerwise and s.integrity != "off":
            raise ConfigError(f"{_WHERE}.layerwise with integrity {s.integrity!r}: kvlink's "
                              "digests do not cover layer-wise pushes yet (integrity off, or "
                              "layerwise false)")
        if x.layerwise_min_tokens < 0:
            raise ConfigError(f"layerwise_min_tokens must be >= 0, got {x.layerwise_min_tokens}")
        if not x.layerwise_wait_ms >= 0:
            raise ConfigError(f"layerwise_wait_ms must be >= 0, got {x.layerwise_wait_ms}")
        for key, value in (("kv_lease_duration", s.lease_seconds),
                           ("push_timeout", s.push_timeout),
                           ("read_pin_seconds", s.pin_seconds),
                           ("handshake_timeout", s.handshake_timeout),
                           ("read_intent_timeout", s.intent_timeout)):
            if not value > 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        if not s.idle_yield_s >= 0:
            raise ConfigError(f"idle_yield_ms must be >= 0, got {x.idle_yield_ms}")
        if not 0 < s.side_port < 65536:
            raise ConfigError(f"side_channel_port {s.side_port} out of range")
        return s

    def to_config(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` that reads back (:meth:`from_config`) as these
        settings, every key explicit."""
        out = {
            "transport": list(self.transports),
            "transport_options": {k: dict(v) for k, v in self.transport_options.items()},
            "side_channel_host": self.host, "side_channel_port": self.side_port,
            "advertise_host": self.advertise_host, "kv_lease_duration": self.lease_seconds,
            "read_pin_seconds": self.pin_seconds, "handshake_timeout": self.handshake_timeout,
            "read_intent_timeout": self.intent_timeout, "idle_yield_ms": self.idle_yield_s * 1e3,
            "secret": self.secret, "allow_insecure": self.allow_insecure, "mode": self.mode,
            "push_timeout": self.push_timeout, "grants": self.grants,
            "integrity": self.integrity, "hold_board": self.hold_board,
            "layerwise": self.layerwise, "layerwise_min_tokens": self.layerwise_min_tokens,
            "layerwise_wait_ms": self.layerwise_wait_s * 1e3,
        }
        return out

    def rank_port(self, dp_rank: int, tp_size: int) -> int:
        """Base side-channel port of this DP rank's TP group (TP rank r adds r)."""
        return self.side_port + dp_rank * tp_size

    @property
    def public_host(self) -> str:
        """The address decoders dial (``remote_host``)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.host


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


#: KV cache group kinds (vLLM's ``KVCacheSpecKind`` values) whose blocks kvlink moves: every
#: layer's page of a block id holds the same tokens, and a finished request keeps all of them
MOVED_KINDS = ("full_attention", "mla_attention")
_WINDOWED = ("sliding_window", "sliding_window_mla", "chunked_local_attention")


def kv_groups_refusal(kinds: Sequence[str]) -> str:
    """Why kvlink cannot move a model whose KV cache groups are of these kinds ("": it can).

    kvlink moves one block table: the block ids of group 0, in every registered layer. A
    second group (vLLM's hybrid KV cache manager gives each attention type its own, with its
    own block ids over the same memory) would have group 0's ids written into its layers'
    pages; a windowed group's table drops the blocks it no longer attends to, and Mamba state
    is no KV at all. So one group of a kind in :data:`MOVED_KINDS`, or a refusal that says
    what to do."""
    kinds = [str(k) for k in kinds]
    if len(kinds) == 1 and kinds[0] in MOVED_KINDS:
        return ""
    what = (f"kvlink moves one full-attention KV cache group; this model's KV cache has "
            f"{len(kinds)} group(s): {', '.join(kinds) or 'none'}")
    if any(k.startswith("mamba") for k in kinds):
        todo = ("kvlink does not move Mamba (SSM) state: serve this model with a connector "
                "that does (NixlConnector moves hybrid Mamba models)")
    elif any(k in _WINDOWED for k in kinds) and any(k in MOVED_KINDS for k in kinds):
        todo = ("start vLLM with --disable-hybrid-kv-cache-manager: every attention layer then "
                "shares one full-attention group (sliding-window layers keep the whole prompt), "
                "which kvlink moves")
    elif kinds and all(k in MOVED_KINDS for k in kinds):
        todo = ("several full-attention groups (block ids per group) are not supported yet; "
                "start vLLM with --disable-hybrid-kv-cache-manager to have one")
    else:
        todo = (f"kvlink cannot move {', '.join(sorted(set(kinds) - set(MOVED_KINDS)))} "
                "caches (a windowed block table drops the blocks the model no longer attends "
                "to)")
    return f"{what}: {todo}"


def parse_remote(params: Mapping[str, Any]) -> Remote | None:
    """The remote prefill named by a request's kv_transfer_params, or None if incomplete."""
    try:
        ids = flat_block_ids(params.get("remote_block_ids"))
        engine, req = params.get("remote_engine_id"), params.get("remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        if ids is None or not engine or not req or not host or port is None:
            return None
        return Remote(engine_id=str(engine), request_id=str(req), host=str(host),
                      port=int(port), tp_size=int(params.get("tp_size") or 1), block_ids=ids,
                      block_size=int(params.get("kvlink_block_size") or 0),
                      generation=_generation(params.get(GENERATION_PARAM)),
                      registration=_generation(params.get(REGISTRATION_PARAM)),
                      incarnations=_incarnations(params.get(INCARNATIONS_PARAM)),
                      expiry=_seconds(params.get(EXPIRY_PARAM)),
                      clock=_seconds(params.get(CLOCK_PARAM)))
    except (TypeError, ValueError):
        return None
