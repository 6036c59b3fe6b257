"""Everything that crosses a socket: versioned msgspec Structs, decoded strictly.

Nothing is pickled. Every message carries ``v`` (the wire version) and a ``type`` tag; decoding
first checks the size bound and the version, then decodes strictly (unknown fields, wrong types
and unknown tags are errors). Decoders raise only :class:`kvlink.errors.WireError` subclasses.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

from kvlink.compat import WIRE_VERSION as WIRE_VERSION
from kvlink.errors import WireError, WireVersionError
from kvlink.layout import KVCacheSpec, Layout
from kvlink.transport import EXTENT_DTYPE, Extents, Region

MAX_MESSAGE_BYTES = 16 << 20


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    v: int


class RegionMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: int
    nbytes: int
    device: str


class SpecMsg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    layout: str
    mla: bool
    total_kv_heads: int
    tp_size: int
    tp_rank: int
    regions: list[RegionMsg]
    plane_base: list[int]
    block_stride: list[int]

    @classmethod
    def of(cls, spec: KVCacheSpec) -> SpecMsg:
        return cls(
            num_layers=spec.num_layers, num_blocks=spec.num_blocks, block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
            itemsize=spec.itemsize, layout=spec.layout.value, mla=spec.mla,
            total_kv_heads=spec.total_kv_heads, tp_size=spec.tp_size, tp_rank=spec.tp_rank,
            regions=[RegionMsg(r.addr, r.nbytes, r.device) for r in spec.regions],
            plane_base=[int(x) for x in spec.plane_base.reshape(-1)],
            block_stride=[int(x) for x in spec.block_stride.reshape(-1)],
        )

    def to_spec(self) -> KVCacheSpec:
        """Rebuild the peer's spec; geometry errors surface as WireError (it came off a socket)."""
        try:
            kv = 1 if self.mla else 2
            shape = (self.num_layers, kv)
            base = np.array(self.plane_base, dtype=np.uint64)
            stride = np.array(self.block_stride, dtype=np.uint64)
            if base.size != self.num_layers * kv or stride.size != base.size:
                raise ValueError(f"plane arrays hold {base.size} entries, expected {shape}")
            return KVCacheSpec(
                num_layers=self.num_layers, num_blocks=self.num_blocks,
                block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, dtype=self.dtype, itemsize=self.itemsize,
                layout=Layout(self.layout), mla=self.mla,
                regions=tuple(Region(r.addr, r.nbytes, r.device) for r in self.regions),
                plane_base=base.reshape(shape), block_stride=stride.reshape(shape),
                total_kv_heads=self.total_kv_heads, tp_size=self.tp_size, tp_rank=self.tp_rank,
            )
        except (ValueError, OverflowError) as exc:
            raise WireError(f"invalid KV cache spec from peer: {exc}") from exc


class HandshakeRequest(_Msg, tag="hs_req", frozen=True):
    engine_id: str
    agent_name: str
    tp_rank: int
    tp_size: int
    host_id: str
    compat: str
    auth: bytes = b""


class HandshakeResponse(_Msg, tag="hs_resp", frozen=True):
    engine_id: str
    agent_name: str
    tp_rank: int
    tp_size: int
    host_id: str
    compat: str
    spec: SpecMsg
    transports: dict[str, bytes]
    #: random per process start: requests carry it back, so a peer restarted under the same
    #: engine id and address is detected (stale incarnation) instead of read through old state
    incarnation: int = 0
    #: where this rank takes kept-open sessions (plain TCP, see kvlink.channel); 0: none
    session_port: int = 0


class Notification(_Msg, tag="notify", frozen=True):
    """Push mode, prefill -> decode: "your blocks for this push are filled" (``ok``), or "they
    will not be / were not completely" (``ok=False``, the WRITE is quiescent either way)."""

    engine_id: str
    req_id: str
    tp_rank: int
    tp_size: int
    kind: str = "write"
    ok: bool = True
    detail: str = ""  # why not ok (human-readable only; nothing is parsed out of it)
    push_id: int = 0  # the PushRequest this answers (a stale push's note is ignored)


class PushRequest(_Msg, tag="push", frozen=True):
    """Push mode: a decode rank asks the prefill to WRITE a request's blocks into its own.

    ``push_id`` names this attempt (a retry of the same request is another transfer);
    ``ttl_ms``: the prefill must not post the WRITE later than this after it got the request
    (the decode may have given up on it and sent a :class:`PushCancel`)."""

    engine_id: str
    agent_name: str
    req_id: str
    tp_rank: int
    tp_size: int
    host: str  # the decode rank's side channel, where the prefill handshakes back
    port: int  # base port (rank r at port + r)
    block_ids: list[int]
    push_id: int = 0
    ttl_ms: int = 0
    incarnation: int = 0  # the decode's: a prefill with older handshake state re-handshakes


class PushCancel(_Msg, tag="push_cancel", frozen=True):
    """Decode -> prefill: my push timed out; do not post it. Answered by :class:`PushState`."""

    engine_id: str
    req_id: str
    tp_rank: int
    push_id: int


class PushState(_Msg, tag="push_state", frozen=True):
    """The prefill's answer to a cancel: ``cancelled`` (never posted and never will be),
    ``in_flight`` (posted; its "written" notification follows once it is quiescent), ``done``
    (fully written) or ``failed`` (quiescent, not completely written)."""

    state: str
    reason: str = ""


class ReadIntent(_Msg, tag="read_intent", frozen=True):
    """Pull mode: "I am about to READ these blocks of req_id" — answered by :class:`ReadGrant`
    or an :class:`ErrorReply` (``not_yet``, ``released``, ``blocks``, ``stale``).

    ``incarnation`` is the producer's as the reader's handshake saw it: a mismatch means the
    producer restarted and the reader's metadata (mappings, keys) is stale."""

    engine_id: str
    req_id: str
    tp_rank: int
    incarnation: int = 0
    block_ids: list[int] = []


class ReadGrant(_Msg, tag="read_grant", frozen=True):
    """The lease generation the READ runs under and how long the lease holds from now."""

    generation: int
    expires_in: float


class ReadDone(_Msg, tag="read_done", frozen=True):
    """Reader -> producer after its READ (validate-after-read): was the lease of
    ``generation`` intact the whole time? Answered by :class:`ReadVerdict`.

    ``ok=False``: the READ failed or was never posted (release now, nothing to validate).
    ``generation=0``: a replica this reader did not read (heterogeneous TP): release only.
    ``block_ids``: a READ posted without an intent (the reader got the generation with the
    block ids): the blocks it read, checked against the hold here, after the fact."""

    engine_id: str
    req_id: str
    tp_rank: int
    tp_size: int
    incarnation: int = 0
    generation: int = 0
    ok: bool = True
    block_ids: list[int] | None = None


class ReadVerdict(_Msg, tag="read_verdict", frozen=True):
    intact: bool
    reason: str = ""


class ErrorReply(_Msg, tag="error", frozen=True):
    code: str
    message: str


class Ack(_Msg, tag="ack", frozen=True):
    pass


class Challenge(_Msg, tag="challenge", frozen=True):
    """Asks for (empty nonce) or hands out (server) a single-use nonce for :class:`Signed`."""

    nonce: bytes


class Signed(_Msg, tag="signed", frozen=True):
    """Another message, authenticated: HMAC-SHA256(secret, nonce || body)."""

    nonce: bytes
    mac: bytes
    body: bytes


class Hello(_Msg, tag="hello", frozen=True):
    """Client -> server, first on a kept-open connection: opens an authenticated session.
    Answered by :class:`Welcome`; the session key is HMAC-SHA256(secret, label || client nonce
    || server nonce), so neither side alone picks it and no two sessions share one."""

    nonce: bytes


class Welcome(_Msg, tag="welcome", frozen=True):
    nonce: bytes


class Hold(_Msg, tag="hold", frozen=True):
    """A producer's scheduler -> its own workers, the moment it keeps a finished request's
    blocks: hold them now, under this generation (the one handed to the decode), instead of at
    the engine's next step — an idle engine takes its next step much later (about 0.5 s on a
    2-core host), and the decode's READ report waits for the hold. Block ids are the
    scheduler's; the worker maps them to its kernel blocks. Only from its own engine id."""

    engine_id: str
    req_id: str
    block_ids: list[int]
    generation: int


#: what a client asks (inside a :class:`Batch`) and what a server answers (in :class:`Replies`)
Request = (HandshakeRequest | Notification | PushRequest | PushCancel | ReadIntent | ReadDone
           | Hold)
Reply = HandshakeResponse | PushState | ReadGrant | ReadVerdict | ErrorReply | Ack


class Call(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    id: int  # the client's, echoed in the answer: replies may come in any batch
    msg: Request


class Answer(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    id: int
    msg: Reply


class Batch(_Msg, tag="batch", frozen=True):
    """Every message one client step has for one peer, in one frame, answered in order."""

    calls: list[Call]


class Sealed(_Msg, tag="sealed", frozen=True):
    """A :class:`Batch` under a session: HMAC-SHA256(session key, counter || body); the
    counter only grows on one connection, so a replayed or reordered frame is refused."""

    counter: int
    mac: bytes
    body: bytes


class Replies(_Msg, tag="replies", frozen=True):
    answers: list[Answer]


Message = (
    HandshakeRequest | HandshakeResponse | Notification | PushRequest | PushCancel | PushState
    | ReadIntent | ReadGrant | ReadDone | ReadVerdict | ErrorReply | Ack | Challenge | Signed
    | Hello | Welcome | Batch | Sealed | Replies | Hold
)


class _Version(msgspec.Struct):
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Message)
_version_decoder = msgspec.msgpack.Decoder(_Version)

T = TypeVar("T")


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def _strict(buf: bytes | memoryview, decoder: msgspec.msgpack.Decoder[Any], version: int,
            what: str, max_bytes: int, label: str | None = None) -> Any:
    """Size bound, then the version, then the typed decode; every failure is a WireError."""
    if len(buf) > max_bytes:
        raise WireError(f"{what} of {len(buf)} B exceeds the {max_bytes} B bound")
    try:
        got = _version_decoder.decode(buf).v
        if got != version:
            raise WireVersionError(f"{label or what} version {got} is not supported (this "
                                   f"build speaks {version})")
        return decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireError(f"malformed {what}: {type(exc).__name__}: {exc}") from exc


def decode(buf: bytes | memoryview, expect: type[T] | None = None) -> T | Any:
    """Decode one side-channel message strictly; ``expect`` additionally pins its type."""
    msg = _strict(buf, _decoder, WIRE_VERSION, "message", MAX_MESSAGE_BYTES, label="wire")
    if expect is not None and not isinstance(msg, expect):
        raise WireError(f"expected {expect.__name__}, got {type(msg).__name__}")
    return msg


_plugin_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}


def decode_versioned(buf: bytes | memoryview, cls: type[T], version: int, what: str,
                     max_bytes: int = MAX_MESSAGE_BYTES) -> T:
    """Strictly decode a plugin's own versioned Struct (transport descriptors)."""
    dec = _plugin_decoders.get(cls)
    if dec is None:
        dec = _plugin_decoders[cls] = msgspec.msgpack.Decoder(cls)
    out: T = _strict(buf, dec, version, what, max_bytes)
    return out


def extents_to_bytes(ext: Extents) -> bytes:
    return np.ascontiguousarray(ext, dtype=EXTENT_DTYPE).tobytes()


def extents_from_bytes(buf: bytes | memoryview, max_count: int = 1 << 24) -> Extents:
    """Extent table off the wire: fixed little-endian (addr u64, len u64) records."""
    if len(buf) % EXTENT_DTYPE.itemsize:
        raise WireError(f"extent table of {len(buf)} B is not a multiple of "
                        f"{EXTENT_DTYPE.itemsize} B")
    if len(buf) // EXTENT_DTYPE.itemsize > max_count:
        raise WireError(f"extent table of {len(buf) // EXTENT_DTYPE.itemsize} entries exceeds "
                        f"{max_count}")
    return np.frombuffer(buf, dtype=EXTENT_DTYPE)
