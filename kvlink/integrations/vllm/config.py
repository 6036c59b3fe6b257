"""``kv_connector_extra_config`` as kvlink reads it: :class:`Settings`, checked key by key
(:func:`parse_extra`), and the startup refusal of KV caches kvlink cannot move (no vLLM import).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvlink import options
from kvlink.errors import ConfigError
from kvlink.integrity import Level
from kvlink.worker import DEFAULT_POLL_GRACE_US

DEFAULT_SIDE_PORT = 5600
DEFAULT_LEASE_SECONDS = 120.0
DEFAULT_PUSH_TIMEOUT = 30.0
MODES = ("pull", "push")
#: default of ``layerwise_min_tokens``: below it a request is pushed whole after its prefill
#: (see docs/layerwise.md for the measurement behind it)
DEFAULT_LAYERWISE_MIN_TOKENS = 512
#: default of ``layerwise_wait_ms``: how long a prefill keeps a keyed request waiting for its
#: decode's block ids before it computes it anyway (then pushed whole)
DEFAULT_LAYERWISE_WAIT_MS = 50.0


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
    kv_lease_renew_limit: float = 600.0
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
    landing_board: bool = True  # same-host pushes end without a message (kvlink.landing)
    poll_grace_us: float = DEFAULT_POLL_GRACE_US  # a poll waits this long for a copy about to end
    sync_load_tokens: int = 0  # decode: pulls this short load inside their request's step
    sync_load_ms: float = 2.0  # ... and this quick, at the rate the last such load moved
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
    READs validated in shared memory instead of a round trip, default true), ``landing_board``
    (same-host pushes end when the prefill's transport signals the decode's board, without the
    prefill's note, default true), ``poll_grace_us`` (microseconds ``get_finished`` may wait
    for a load its transport expects to end within them, so it is reported a step sooner;
    default 300, 0: never waits), ``sync_load_tokens`` (decode: a pull of at most this many
    tokens, from a prefill a load already came from, runs inside the step that schedules its
    request, whose forward waits for it: the request runs one engine step sooner; default 0,
    every load asynchronous as NixlConnector's; docs/vllm.md), ``sync_load_ms`` (such a load
    must also take at most this long at the rate the last one from that prefill moved;
    default 2), ``layerwise``
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
    #: prefill: a decode's renewals keep a hold at most this long (WorkerConfig.renew_limit)
    renew_limit: float = 600.0
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
    landing_board: bool = True  # WorkerConfig.landing_board
    poll_grace_us: float = DEFAULT_POLL_GRACE_US  # WorkerConfig.poll_grace_us
    sync_load_tokens: int = 0  # decode: pulls this short load inside their request's step
    sync_load_ms: float = 2.0  # ... and this quick, at the rate the last such load moved
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
            pin_seconds=x.read_pin_seconds, renew_limit=x.kv_lease_renew_limit,
            handshake_timeout=x.handshake_timeout,
            intent_timeout=x.read_intent_timeout, idle_yield_s=x.idle_yield_ms / 1e3,
            secret=x.secret, allow_insecure=x.allow_insecure, mode=x.mode,
            push_timeout=x.push_timeout, grants=x.grants, integrity=x.integrity,
            hold_board=x.hold_board, landing_board=x.landing_board,
            poll_grace_us=x.poll_grace_us, sync_load_tokens=x.sync_load_tokens,
            sync_load_ms=x.sync_load_ms,
            layerwise=x.layerwise,
            layerwise_min_tokens=x.layerwise_min_tokens,
            layerwise_wait_s=x.layerwise_wait_ms / 1e3,
        )
        if s.layerwise and not s.producer:
            raise ConfigError(f"{_WHERE}.layerwise is a prefill setting (kv_role kv_producer or "
                              f"kv_both); a decode takes layer-wise pushes in mode push")
        if x.sync_load_tokens < 0:
            raise ConfigError(f"sync_load_tokens must be >= 0 (0: every load asynchronous), "
                              f"got {x.sync_load_tokens}")
        if not x.sync_load_ms > 0:
            raise ConfigError(f"sync_load_ms must be > 0, got {x.sync_load_ms}")
        if x.layerwise_min_tokens < 0:
            raise ConfigError(f"layerwise_min_tokens must be >= 0, got {x.layerwise_min_tokens}")
        if not x.layerwise_wait_ms >= 0:
            raise ConfigError(f"layerwise_wait_ms must be >= 0, got {x.layerwise_wait_ms}")
        for key, value in (("kv_lease_duration", s.lease_seconds),
                           ("push_timeout", s.push_timeout),
                           ("read_pin_seconds", s.pin_seconds),
                           ("kv_lease_renew_limit", s.renew_limit),
                           ("handshake_timeout", s.handshake_timeout),
                           ("read_intent_timeout", s.intent_timeout)):
            if not value > 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        if not s.idle_yield_s >= 0:
            raise ConfigError(f"idle_yield_ms must be >= 0, got {x.idle_yield_ms}")
        if not 0 <= s.poll_grace_us <= 1e6:  # (as WorkerConfig says, but at startup)
            raise ConfigError(f"poll_grace_us must be 0 to 1e6 (a second), got "
                              f"{s.poll_grace_us!r}")
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
            "read_pin_seconds": self.pin_seconds, "kv_lease_renew_limit": self.renew_limit,
            "handshake_timeout": self.handshake_timeout,
            "read_intent_timeout": self.intent_timeout, "idle_yield_ms": self.idle_yield_s * 1e3,
            "secret": self.secret, "allow_insecure": self.allow_insecure, "mode": self.mode,
            "push_timeout": self.push_timeout, "grants": self.grants,
            "integrity": self.integrity, "hold_board": self.hold_board,
            "landing_board": self.landing_board, "poll_grace_us": self.poll_grace_us,
            "sync_load_tokens": self.sync_load_tokens, "sync_load_ms": self.sync_load_ms,
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
