"""Everything that crosses a socket: versioned msgspec Structs, decoded strictly.

Nothing is pickled. Every message carries ``v`` (the wire version) and a ``type`` tag; decoding
first checks the size bound and the version, then decodes strictly (unknown fields, wrong types
and unknown tags are errors). Decoders raise only :class:`kvlink.errors.WireError` subclasses.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

from kvlink.compat import WIRE_VERSION as WIRE_VERSION
from kvlink.errors import ConfigError, WireError, WireVersionError
from kvlink.layout import KVCacheSpec, Layout
from kvlink.transport import EXTENT_DTYPE, Extents, Region

MAX_MESSAGE_BYTES = 16 << 20

# ----------------------------------------------------------------------------- field bounds
# Every field of every message is checked against these while it is decoded (msgspec
# constraints, plus ``__post_init__`` for what spans fields, e.g. tp_rank < tp_size): a peer's
# number never reaches a loop, an allocation or a lock unchecked. A violation is a WireError
# that names the field (msgspec's "- at `$.tp_size`"), answered ``ErrorReply(code=
# "bad_message")`` by a side-channel server. Constraints hold at decode time only: building a
# message breaks nothing but its cross-field checks (tests build hostile messages freely).
MAX_TP = 4096  #: tp_size in 1..MAX_TP, tp_rank in 0..tp_size-1
MAX_ID_LEN = 256  #: engine and request ids (vLLM: "cmpl-<uuid>-0" and suffixes, under 100)
MAX_NAME_LEN = 512  #: agent names (an engine id, a rank, a pid and a clock), host ids, hashes
MAX_HOST_LEN = 255  #: a host to dial back: a DNS name (253) or an IPv6 literal with its zone
MAX_TAG_LEN = 64  #: short words: kinds, states, error codes, dtypes, layouts, transport names
MAX_TEXT_LEN = 1 << 16  #: human-readable details, reasons and error messages
MAX_BLOCK_IDS = 1 << 20  #: block ids in one list (16 M tokens at 16 tokens a block)
MAX_DIGEST_BYTES = 4 << 20  #: a verdict's digests (kvlink.integrity folds larger ones)
MAX_BLOCK_ID = 2**31 - 1  #: vLLM's block tables are int32; so is any sane cache
#: incarnations, generations, push ids, call ids, session counters, and addresses and byte
#: counts (user-space and device addresses fit in 63 bits; msgspec bounds stop at int64)
MAX_U63 = 2**63 - 1
MAX_PORT = 65535
MAX_NONCE_BYTES = 64  #: nonces and MACs (HMAC-SHA256 is 32 B, nonces 16 B)
MAX_AUTH_BYTES = 4096  #: HandshakeRequest.auth
MAX_CALLS = 4096  #: calls in one Batch, answers in one Replies (kvlink.channel sends <= 512)
MAX_TRANSPORTS = 32  #: descriptors in one handshake answer
MAX_LAYERS = 4096
MAX_REGIONS = 4 * MAX_LAYERS  #: registered regions in one spec (one or two a layer in practice)
MAX_HEADS = 1 << 16  #: KV heads (total and per rank)
MAX_HEAD_DIM = 1 << 16
MAX_BLOCK_SIZE = 1 << 20  #: tokens per block
MAX_ITEMSIZE = 16
MAX_SECONDS = 1e9  #: ReadGrant.expires_in (finite; negative only when a lease just ran out)
MAX_TTL_MS = 7 * 86_400_000  #: PushRequest.ttl_ms: a week (0: no ttl)

_NO_CONTROL = r"^[^\x00-\x1f\x7f]*\Z"  # ids end up in logs and keys: no control characters
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN, pattern=_NO_CONTROL)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN, pattern=_NO_CONTROL)]
# a host name, an IPv4 or a bare IPv6 literal (with its %zone): what a peer dials back
Host = Annotated[str, msgspec.Meta(max_length=MAX_HOST_LEN, pattern=r"^[A-Za-z0-9._:%-]+\Z")]
Tag = Annotated[str, msgspec.Meta(max_length=MAX_TAG_LEN, pattern=_NO_CONTROL)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_LEN)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
TpRank = Annotated[int, msgspec.Meta(ge=0, le=MAX_TP - 1)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_U63)]
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
BlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=MAX_NONCE_BYTES)]
Body = Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)]


def check_id(value: str, what: str) -> str:
    """A caller's id, checked against what a peer will accept before it leaves (one id out
    of bounds would make the peer refuse the whole frame it travels in)."""
    if len(value) > MAX_ID_LEN or not (
            # ASCII and printable is exactly "no control character" for ASCII, in C; the
            # pattern decides only the rest (a regex match costs ~10 us on a request's cold path)
            (value.isascii() and value.isprintable()) or re.match(_NO_CONTROL, value)):
        raise ConfigError(f"{what} {value[:40]!r}{'...' if len(value) > 40 else ''}: at most "
                          f"{MAX_ID_LEN} characters, no control characters")
    return value


def _check_rank(tp_rank: int, tp_size: int) -> None:
    """Cross-field: raised in ``__post_init__``, which msgspec turns into a ValidationError."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"`tp_rank` {tp_rank} out of range for `tp_size` {tp_size}")


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    v: int


class RegionMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: U63
    nbytes: U63
    device: Tag


class SpecMsg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_ID + 1)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEAD_DIM)]
    dtype: Tag
    itemsize: Annotated[int, msgspec.Meta(ge=1, le=MAX_ITEMSIZE)]
    layout: Tag
    mla: bool
    total_kv_heads: Annotated[int, msgspec.Meta(ge=0, le=MAX_HEADS)]  # 0: num_kv_heads
    tp_size: TpSize
    tp_rank: TpRank
    regions: Annotated[list[RegionMsg], msgspec.Meta(max_length=MAX_REGIONS)]
    plane_base: Annotated[list[U63], msgspec.Meta(max_length=2 * MAX_LAYERS)]
    block_stride: Annotated[list[U63], msgspec.Meta(max_length=2 * MAX_LAYERS)]
    kv_packed: bool = False

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)

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
            kv_packed=spec.kv_packed,
        )

    def to_spec(self) -> KVCacheSpec:
        """Rebuild the peer's spec; geometry errors surface as WireError (it came off a socket)."""
        try:
            kv = 1 if self.mla or self.kv_packed else 2
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
                kv_packed=self.kv_packed,
            )
        except (ValueError, OverflowError) as exc:
            raise WireError(f"invalid KV cache spec from peer: {exc}") from exc


class HandshakeRequest(_Msg, tag="hs_req", frozen=True):
    engine_id: Id
    agent_name: Name
    tp_rank: TpRank
    tp_size: TpSize
    host_id: Name
    compat: Name
    auth: Annotated[bytes, msgspec.Meta(max_length=MAX_AUTH_BYTES)] = b""

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)


class BoardMsg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a same-host reader finds the producer's hold board (:mod:`kvlink.holdboard`)."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_TAG_LEN, pattern=r"^[a-z0-9-]+\Z")]
    token: Annotated[bytes, msgspec.Meta(max_length=MAX_NONCE_BYTES)]


class HandshakeResponse(_Msg, tag="hs_resp", frozen=True):
    engine_id: Id
    agent_name: Name
    tp_rank: TpRank
    tp_size: TpSize
    host_id: Name
    compat: Name
    spec: SpecMsg
    transports: Annotated[dict[Tag, Body], msgspec.Meta(max_length=MAX_TRANSPORTS)]
    #: random per process start: requests carry it back, so a peer restarted under the same
    #: engine id and address is detected (stale incarnation) instead of read through old state
    incarnation: U63 = 0
    #: where this rank takes kept-open sessions (plain TCP, see kvlink.channel); 0: none
    session_port: Port = 0
    #: the hold board, offered only to a peer on our host (None: validate by asking)
    board: BoardMsg | None = None

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)


class Notification(_Msg, tag="notify", frozen=True):
    """Push mode, prefill -> decode: "your blocks for this push are filled" (``ok``), or "they
    will not be / were not completely" (``ok=False``, the WRITE is quiescent either way)."""

    engine_id: Id
    req_id: Id
    tp_rank: TpRank
    tp_size: TpSize
    kind: Tag = "write"
    ok: bool = True
    detail: Text = ""  # why not ok (human-readable only; nothing is parsed out of it)
    push_id: U63 = 0  # the PushRequest this answers (a stale push's note is ignored)
    #: integrity (kvlink.integrity): digests of the blocks written, by the *decode's* block
    #: ids; empty where the prefill keeps none (integrity off there)
    digest_ids: BlockIds = msgspec.field(default_factory=list)
    digests: Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)] = b""
    folded: bool = False
    #: ``kind="layers"``: a layer-wise push's layers [layer_from, layer_to) have landed (the
    #: request is written only once its "write" note comes)
    layer_from: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)] = 0
    layer_to: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)] = 0

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)
        if self.layer_from > self.layer_to:
            raise ValueError(f"layer_from {self.layer_from} > layer_to {self.layer_to}")


class LandingMsg(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a same-host prefill signals that a push landed (:mod:`kvlink.landing`): the
    decode's landing board, and the slot it took for this push and prefill rank."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_TAG_LEN, pattern=r"^[a-z0-9-]+\Z")]
    token: Annotated[bytes, msgspec.Meta(max_length=MAX_NONCE_BYTES)]
    slot: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    host_id: Name  # the decode's host: a prefill elsewhere ignores the offer
    #: with integrity on, the slot's digest area: its byte offset in the board and its size
    #: (0: none; the push then ends by its note, which carries the digests)
    digests_at: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    digests_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0


class PushRequest(_Msg, tag="push", frozen=True):
    """Push mode: a decode rank asks the prefill to WRITE a request's blocks into its own.

    ``push_id`` names this attempt (a retry of the same request is another transfer);
    ``ttl_ms``: the prefill must not post the WRITE later than this after it got the request
    (the decode may have given up on it and sent a :class:`PushCancel`)."""

    engine_id: Id
    agent_name: Name
    req_id: Id
    tp_rank: TpRank
    tp_size: TpSize
    host: Host  # the decode rank's side channel, where the prefill handshakes back
    port: Annotated[int, msgspec.Meta(ge=1, le=MAX_PORT)]  # base port (rank r at port + r)
    block_ids: BlockIds
    push_id: U63 = 0
    ttl_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_TTL_MS)] = 0  # 0: no time to live
    incarnation: U63 = 0  # the decode's: a prefill with older handshake state re-handshakes
    #: the decode's landing board slot for this rank's push (None: it ends by note only)
    landing: LandingMsg | None = None

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)
        if self.port + self.tp_rank > MAX_PORT:
            raise ValueError(f"`port` {self.port} + `tp_rank` {self.tp_rank} is no port")


class PushCancel(_Msg, tag="push_cancel", frozen=True):
    """Decode -> prefill: my push timed out; do not post it. Answered by :class:`PushState`."""

    engine_id: Id
    req_id: Id
    tp_rank: TpRank
    push_id: U63


class PushState(_Msg, tag="push_state", frozen=True):
    """The prefill's answer to a cancel: ``cancelled`` (never posted and never will be),
    ``in_flight`` (posted; its "written" notification follows once it is quiescent), ``done``
    (fully written) or ``failed`` (quiescent, not completely written)."""

    state: Tag
    reason: Text = ""


class ReadIntent(_Msg, tag="read_intent", frozen=True):
    """Pull mode: "I am about to READ these blocks of req_id" — answered by :class:`ReadGrant`
    or an :class:`ErrorReply` (``not_yet``, ``released``, ``blocks``, ``stale``).

    ``incarnation`` is the producer's as the reader's handshake saw it: a mismatch means the
    producer restarted and the reader's metadata (mappings, keys) is stale."""

    engine_id: Id
    req_id: Id
    tp_rank: TpRank
    incarnation: U63 = 0
    block_ids: BlockIds = []


class ReadGrant(_Msg, tag="read_grant", frozen=True):
    """The lease generation the READ runs under and how long the lease holds from now."""

    generation: U63
    expires_in: Annotated[float, msgspec.Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)]


class ReadDone(_Msg, tag="read_done", frozen=True):
    """Reader -> producer after its READ (validate-after-read): was the lease of
    ``generation`` intact the whole time? Answered by :class:`ReadVerdict`.

    ``ok=False``: the READ failed or was never posted (release now, nothing to validate).
    ``generation=0``: a replica this reader did not read (heterogeneous TP): release only.
    ``block_ids``: a READ posted without an intent (the reader got the generation with the
    block ids): the blocks it read, checked against the hold here, after the fact."""

    engine_id: Id
    req_id: Id
    tp_rank: TpRank
    tp_size: TpSize
    incarnation: U63 = 0
    generation: U63 = 0
    ok: bool = True
    block_ids: BlockIds | None = None

    def __post_init__(self) -> None:
        _check_rank(self.tp_rank, self.tp_size)


class ReadVerdict(_Msg, tag="read_verdict", frozen=True):
    """``intact``: the lease held the whole READ. With integrity on, the producer's digests of
    the blocks ``digest_ids`` (``kvlink.integrity``: little-endian uint64, ``[blocks, layers,
    planes, heads]``, or ``[blocks, 1, 1, heads]`` when ``folded``) for the reader to check."""

    intact: bool
    reason: Text = ""
    digest_ids: BlockIds = []
    digests: Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)] = b""
    folded: bool = False


class ErrorReply(_Msg, tag="error", frozen=True):
    code: Tag
    message: Text


class Ack(_Msg, tag="ack", frozen=True):
    pass


class Challenge(_Msg, tag="challenge", frozen=True):
    """Asks for (empty nonce) or hands out (server) a single-use nonce for :class:`Signed`."""

    nonce: Nonce


class Signed(_Msg, tag="signed", frozen=True):
    """Another message, authenticated: HMAC-SHA256(secret, nonce || body)."""

    nonce: Nonce
    mac: Nonce
    body: Body


class Hello(_Msg, tag="hello", frozen=True):
    """Client -> server, first on a kept-open connection: opens an authenticated session.
    Answered by :class:`Welcome`; the session key is HMAC-SHA256(secret, label || client nonce
    || server nonce), so neither side alone picks it and no two sessions share one."""

    nonce: Nonce


class Welcome(_Msg, tag="welcome", frozen=True):
    nonce: Nonce


class Renew(_Msg, tag="renew", frozen=True):
    """Reader -> producer: these requests still wait for us (queued in a busy decode): renew
    their leases (:meth:`kvlink.leases.BlockLeases.renew`, capped by the producer's
    ``renew_limit``). Ids not held there are skipped; sent quiet (nothing answered)."""

    engine_id: Id
    req_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=MAX_CALLS)]


class Hold(_Msg, tag="hold", frozen=True):
    """A producer's scheduler -> its own workers, the moment it keeps a finished request's
    blocks: hold them now, under this generation (the one handed to the decode), instead of at
    the engine's next step — an idle engine takes its next step much later (about 0.5 s on a
    2-core host), and the decode's READ report waits for the hold. Block ids are the
    scheduler's; the worker maps them to its kernel blocks. Only from its own engine: ``mac``
    is HMAC-SHA256 under the engine's local key (:mod:`kvlink.localkey`) over
    :func:`hold_body`, since a hold names the generation that lets a reader in."""

    engine_id: Id
    req_id: Id
    block_ids: BlockIds
    generation: U63
    mac: Nonce = b""


def hold_body(engine_id: str, req_id: str, block_ids: list[int], generation: int) -> bytes:
    """What a :class:`Hold`'s MAC covers (every field but the MAC)."""
    return _encoder.encode((engine_id, req_id, block_ids, generation))


#: what a client asks (inside a :class:`Batch`) and what a server answers (in :class:`Replies`)
Request = (HandshakeRequest | Notification | PushRequest | PushCancel | ReadIntent | ReadDone
           | Hold | Renew)
Reply = HandshakeResponse | PushState | ReadGrant | ReadVerdict | ErrorReply | Ack


class Call(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    #: the client's, echoed in the answer (replies may come in any batch); 0: a report that
    #: wants no answer (the server handles it, logs a refusal, and answers nothing)
    id: U63
    msg: Request


class Answer(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    id: U63
    msg: Reply


class Batch(_Msg, tag="batch", frozen=True):
    """Every message one client step has for one peer, in one frame, answered in order."""

    calls: Annotated[list[Call], msgspec.Meta(max_length=MAX_CALLS)]


class Sealed(_Msg, tag="sealed", frozen=True):
    """A :class:`Batch` under a session: HMAC-SHA256(session key, counter || body); the
    counter only grows on one connection, so a replayed or reordered frame is refused."""

    counter: U63
    mac: Nonce
    body: Body


class Replies(_Msg, tag="replies", frozen=True):
    answers: Annotated[list[Answer], msgspec.Meta(max_length=MAX_CALLS)]


Message = (
    HandshakeRequest | HandshakeResponse | Notification | PushRequest | PushCancel | PushState
    | ReadIntent | ReadGrant | ReadDone | ReadVerdict | ErrorReply | Ack | Challenge | Signed
    | Hello | Welcome | Batch | Sealed | Replies | Hold | Renew
)


class _Version(msgspec.Struct):
    v: int = -1  # unconstrained: any other version is answered as such, not as malformed


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
