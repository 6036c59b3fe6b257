"""Settings and the per-step plan shared by the scheduler and worker sides (no vLLM import).

The plan is what the scheduler-side connector hands the workers each step (wrapped in vLLM's
``KVConnectorMetadata``): requests to pull, prefill requests to hold for readers, and remote
requests to release without reading. It crosses a process boundary, so it is plain data.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

from kvlink.errors import ConfigError

DEFAULT_SIDE_PORT = 5600
DEFAULT_LEASE_SECONDS = 120.0
DEFAULT_PUSH_TIMEOUT = 30.0
MODES = ("pull", "push")
#: kv_transfer_params key a router may set to pick the mode of one request (decode side)
MODE_PARAM = "kvlink_mode"
#: kv_transfer_params key: the prefill's hold generation, so the decode READs without asking
GENERATION_PARAM = "kvlink_generation"

#: kv_transfer_params keys vLLM's NixlConnector uses (same names, same meaning).
PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
              "remote_host", "remote_port", "remote_request_id", "tp_size")


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            try:
                return int(v)
            except ValueError:
                raise ConfigError(f"environment variable {n}={v!r} is not an integer") from None
    return None


@dataclasses.dataclass(frozen=True)
class Settings:
    """``kv_transfer_config`` as kvlink reads it (``kv_connector_extra_config`` keys below).

    ``transport`` (str or list, default "tcp"), ``transport_options`` ({name: {...}}),
    ``side_channel_host`` / ``side_channel_port`` (else env ``KVLINK_SIDE_CHANNEL_HOST|PORT``,
    then ``VLLM_NIXL_SIDE_CHANNEL_HOST|PORT``; rank r of DP rank d listens on
    ``port + d * tp + r``), ``advertise_host``, ``kv_lease_duration`` (seconds a prefill holds
    blocks for readers), ``handshake_timeout``, ``read_intent_timeout``, ``idle_yield_ms``,
    ``secret`` (side channel HMAC; else env ``KVLINK_SECRET``), ``allow_insecure``,
    ``mode`` ("pull" or "push": how a consumer gets the KV; see docs/vllm.md) and
    ``push_timeout`` (seconds a consumer keeps blocks reserved for a push).
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

    @property
    def serves(self) -> bool:
        """Runs a side channel: producers (answering readers and pushers' requests) and push
        consumers (the prefill handshakes back to write into them)."""
        return self.producer or (self.consumer and self.mode == "push")

    @classmethod
    def from_config(cls, engine_id: str, kv_role: str, extra: Mapping[str, Any] | None
                    ) -> Settings:
        extra = dict(extra or {})
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, "
                              f"got {kv_role!r}")
        t = extra.get("transport", extra.get("transports", "tcp"))
        transports = tuple(t.split(",") if isinstance(t, str) else t)
        if not transports or not all(isinstance(x, str) and x for x in transports):
            raise ConfigError(f"kv_connector_extra_config.transport must name transports, "
                              f"got {t!r}")
        host = str(extra.get("side_channel_host") or os.environ.get("KVLINK_SIDE_CHANNEL_HOST")
                   or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1")
        if host == "localhost":
            host = "127.0.0.1"
        port = extra.get("side_channel_port")
        if port is None:
            port = _env_int("KVLINK_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")
        lease = extra.get("kv_lease_duration", extra.get("lease_seconds",
                                                        DEFAULT_LEASE_SECONDS))
        mode = extra.get("mode", "pull")
        if mode not in MODES:
            raise ConfigError(f"kv_connector_extra_config.mode must be one of {list(MODES)}, "
                              f"got {mode!r}")
        opts = extra.get("transport_options") or {}
        if not isinstance(opts, Mapping):
            raise ConfigError(f"transport_options must map transport names to options, "
                              f"got {opts!r}")
        s = cls(
            engine_id=engine_id, producer=kv_role in ("kv_producer", "kv_both"),
            consumer=kv_role in ("kv_consumer", "kv_both"), transports=transports,
            transport_options={str(k): dict(v) for k, v in opts.items()}, host=host,
            advertise_host=extra.get("advertise_host"),
            side_port=int(port) if port is not None else DEFAULT_SIDE_PORT,
            lease_seconds=float(lease),
            pin_seconds=float(extra.get("read_pin_seconds", 60.0)),
            handshake_timeout=float(extra.get("handshake_timeout", 10.0)),
            intent_timeout=float(extra.get("read_intent_timeout", 10.0)),
            idle_yield_s=float(extra.get("idle_yield_ms", 2.0)) / 1e3,
            secret=extra.get("secret"), allow_insecure=bool(extra.get("allow_insecure", False)),
            mode=str(mode), push_timeout=float(extra.get("push_timeout", DEFAULT_PUSH_TIMEOUT)),
        )
        if s.lease_seconds <= 0:
            raise ConfigError(f"kv_lease_duration must be positive, got {s.lease_seconds}")
        if s.push_timeout <= 0:
            raise ConfigError(f"push_timeout must be positive, got {s.push_timeout}")
        if not 0 < s.side_port < 65536:
            raise ConfigError(f"side_channel_port {s.side_port} out of range")
        return s

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


@dataclasses.dataclass(frozen=True)
class RecvReq:
    req_id: str  # local (decode) request id
    remote: Remote
    local_block_ids: tuple[int, ...]
    num_tokens: int
    push: bool = False  # the prefill WRITEs into local_block_ids (else we READ them)


@dataclasses.dataclass(frozen=True)
class SendReq:
    req_id: str
    block_ids: tuple[int, ...]
    generation: int = 0  # minted where the blocks were kept (request_finished); 0: the worker's


@dataclasses.dataclass
class StepPlan:
    recv: list[RecvReq] = dataclasses.field(default_factory=list)
    send: list[SendReq] = dataclasses.field(default_factory=list)
    release: list[Remote] = dataclasses.field(default_factory=list)  # notify without reading


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
                      generation=_generation(params.get(GENERATION_PARAM)))
    except (TypeError, ValueError):
        return None
