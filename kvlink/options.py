"""Option schemas of the built-in transports, and the strict checks config goes through.

Each built-in transport's options are a msgspec Struct below (names, types and defaults as the
transport reads them). :func:`check_options` validates a transport's option mapping: an unknown
key fails with a :class:`~kvlink.errors.ConfigError` naming the transport, the key and the
closest known key; a value of the wrong type names the key and the value. Transports call it in
their constructor, and ``Settings.from_config`` (kvlink.integrations.vllm.config) calls it for
every ``transport_options`` entry, so a typo fails at startup instead of being ignored.

A transport without a schema here (a third-party plugin) gets its options unchecked.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Union

import msgspec

from kvlink.errors import ConfigError

#: seconds that must be positive (a deadline of 0 or less fails every transfer, or the thread
#: that waits on it: tcp's peer thread died on a negative socket timeout, its READs hanging)
Seconds = Annotated[float, msgspec.Meta(gt=0)]
#: counts and sizes with a least sensible value (0 or less stopped a thread, refused every
#: connection, or divided by zero under a transfer)
AtLeast1 = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class _Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of the option schemas (defaults are what the transport uses when a key is absent)."""


class TcpOptions(_Options):
    timeout_s: Seconds = 30.0  # a transfer's deadline
    hello_timeout_s: Seconds = 5.0  # an accepted connection's hello must arrive within this
    max_unauthenticated: AtLeast1 = 64  # pending hellos kept (the oldest is dropped beyond)
    max_connections: AtLeast1 = 1024  # connections in all (a new one is closed beyond)
    stream_order: bool = True  # staged device memory waits for the caller's current stream
    port: Port = 0  # data-plane listen port (0: ephemeral)
    stage_host_memory: bool = False  # host memory through the staging pipeline (tests)
    staging_chunk: Annotated[int, msgspec.Meta(ge=4096)] = 4 << 20  # bytes per staging buffer
    staging_buffers: Annotated[int, msgspec.Meta(ge=2)] = 8  # pinned staging buffers
    #: a peer's thread waits in C on an inbox of plain READs and WRITEs (kvlink/_reader.c);
    #: false: in Python, as before it (a READ's answer, a WRITE's send then wait for the GIL
    #: where the caller is busy)
    reader_in_c: bool = True
    #: both socket buffers of each connection, bytes; 0: the kernel's autotuning; None: 4 MiB
    #: between two processes of one host, autotuning between hosts
    #: (kvlink_transports/tcp/wire.py, _tune)
    socket_buffer_bytes: int | None = None
    #: seconds a kept-open connection may be idle before the kernel probes its peer (every
    #: quarter of it, 4 probes: a vanished host's connection ends in ~2x this; 0: never).
    #: kvlink.sockets.keepalive
    keepalive_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0


class NixlOptions(_Options):
    backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    post_mode: Literal["prepped", "direct"] = "prepped"
    telemetry: bool = False
    ucx_probe: bool = True
    progress_thread: bool = False  # NIXL's own progress thread
    progress_interval: float = 0.001
    progress_fast_interval: float = 0.00005
    timeout_s: Seconds = 30.0
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # nixl_agent_config(num_threads=...)
    #: bytes per descriptor of the lists prepped once per peer (0: 4 KiB, doubled until the
    #: registered memory needs at most prep_max_descriptors); requests whose extents are not
    #: multiples of it build per-request lists (slower)
    prep_block_bytes: int = 0
    prep_max_descriptors: AtLeast1 = 1 << 22
    #: a GPU pair whose measured UCX lanes are tcp, cuda_copy or software emulation fails its
    #: posts (reason names the fix) unless this is set
    allow_slow_gpu: bool = False
    #: a post touching our VRAM goes to NIXL once the caller's current CUDA stream ran what
    #: it held at the post (checked at each poll); False: the caller synchronizes first
    stream_order: bool = True
    #: NIXL UCX backend parameter ("peer" | "none"; None: NIXL's default, peer)
    ucx_error_handling_mode: str | None = None


class MooncakeOptions(_Options):
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    timeout_s: Seconds = 30.0
    #: default 1024, or env MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER with the tcp protocol
    max_inflight_per_peer: AtLeast1 | None = None
    sub_batch: AtLeast1 | None = None  # default max_inflight_per_peer // 4
    sub_batch_bytes: AtLeast1 = 256 << 20
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=30)] = 5
    retry_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    location: str = "*"
    probe: bool = True
    quiet: bool = True
    #: a post touching our VRAM is submitted once the caller's current CUDA stream ran what it
    #: held at the post (its peer's thread waits for it); False: the caller synchronizes first
    stream_order: bool = True


class CudaIpcOptions(_Options):
    chunk_bytes: int | None = None  # None: the kernel's own default
    piece_extents: AtLeast1 = 4096
    kernel: Literal["auto", "cuda", "triton"] = "auto"
    stream_order: bool = True
    #: plan a request as runs of consecutive blocks (True) or one extent per block (False: no
    #: run finding on the host; the kernel copies the blocks as they come). False by default:
    #: on an H200, two starts, the 70B TP8-rank pull was faster without (spin 0.575 against
    #: 0.779 ms, 0.75 against 0.85; bench/results/gpu_checks_2f20eb6, docs/e2e.md)
    coalesce_runs: bool = False


#: transport name -> its option schema
SCHEMAS: dict[str, type[_Options]] = {
    "tcp": TcpOptions,
    "nixl": NixlOptions,
    "mooncake": MooncakeOptions,
    "cuda_ipc": CudaIpcOptions,
}


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, else the list of known keys."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(known)}"


def describe(tp: Any) -> str:
    """An annotation in words, for error messages."""
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:  # a constrained value: what it must be, then its bound
        bounds = [f"{op} {getattr(m, name)}" for m in args[1:] if isinstance(m, msgspec.Meta)
                  for name, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                  if getattr(m, name, None) is not None]
        return f"{describe(args[0])} {' and '.join(bounds)}".rstrip()
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s" \
            if args else "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if origin is Union or origin is types.UnionType:
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts)  # None stands for "unset": not worth a mention
    return getattr(tp, "__name__", str(tp))


def _numeric(tp: Any) -> bool:
    if tp in (int, float):
        return True
    return any(a in (int, float) for a in typing.get_args(tp))


def convert(key: str, value: Any, tp: Any) -> Any:
    """``value`` as ``tp`` (msgspec, strict: a bool is no number, "false" no bool), accepting a
    numeric string for a number (``float("8")`` read it before) and 0/1 for a bool; else a
    ConfigError naming ``key`` and ``value``."""
    try:
        return msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError:
        pass
    if isinstance(value, str) and _numeric(tp):
        try:
            return msgspec.convert(value.strip(), tp, strict=False)
        except msgspec.ValidationError:
            pass
    if tp is bool and type(value) is int and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: expected {describe(tp)}, got {value!r}")


def field_types(schema: type[msgspec.Struct]) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(schema)}


def check_fields(where: str, schema: type[msgspec.Struct], values: Mapping[str, Any],
                 prefix: str = "") -> dict[str, Any]:
    """``values`` checked against ``schema``: unknown keys refused with a did-you-mean
    (``where`` names what is being configured), each value converted to its field's type
    (errors name ``prefix + key``). Returns only the keys given, converted."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping of options, got {values!r}")
    types_ = field_types(schema)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or key not in types_:
            raise ConfigError(f"{where}: unknown option {key!r}{did_you_mean(str(key), types_)}")
        out[key] = convert(prefix + key, value, types_[key])
    return out


def check_options(transport: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A transport's options, validated against its schema (unchecked for a transport without
    one); the keys given, their values converted (an option whose default is None and given as
    None is left out). Idempotent."""
    opts = dict(options or {})
    schema = SCHEMAS.get(transport)
    if schema is None:
        return opts
    out = check_fields(f"{transport} transport", schema, opts, prefix=f"{transport} option ")
    unset = {k for k, v in msgspec.structs.asdict(schema()).items() if v is None}
    # None where the default is None: "unset", so the transport computes its default
    return {k: v for k, v in out.items() if not (v is None and k in unset)}


def resolve(transport: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A built-in transport's options as it runs with them: every option, validated, its
    schema's default where not given (None: computed by the transport). The one place a
    transport reads its defaults from, so a default is said once, here."""
    return {**defaults(transport), **check_options(transport, options)}


def defaults(transport: str) -> dict[str, Any]:
    """Every option of a built-in transport with its default (None: computed by the transport)."""
    return msgspec.structs.asdict(SCHEMAS[transport]())
