"""Wire messages: round trips, strict decoding, fuzzing (every failure is a WireError)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import ConfigError, KVLinkError, WireError, WireVersionError
from kvlink.layout import KVCacheSpec
from kvlink.transport import EXTENT_DTYPE, make_extents

MESSAGE_TYPES: tuple[type[Any], ...] = tuple(wire.Message.__args__)  # every tagged type


def real_spec(mla: bool = False, hnd: bool = False) -> KVCacheSpec:
    if mla:
        buf = np.zeros((3, 6, 4, 16), np.uint16)
        return KVCacheSpec.from_arrays(list(buf), mla=True, total_kv_heads=1, tp_size=2,
                                       tp_rank=1, dtype="bfloat16")
    if hnd:
        buf = np.zeros((3, 2, 6, 2, 4, 8), np.uint16)
        layers = [b.transpose(0, 1, 3, 2, 4) for b in buf]
    else:
        layers = [np.zeros((6, 2, 4, 2, 8), np.uint16) for _ in range(3)]  # joined, 3 regions
    return KVCacheSpec.from_arrays(layers, total_kv_heads=8, tp_size=4, tp_rank=3,
                                   dtype="bfloat16")


SPECS = [real_spec(), real_spec(hnd=True), real_spec(mla=True)]

# ----------------------------------------------------------------------------- strategies
# in the bounds every field is decoded against (kvlink.wire's MAX_*; test_field_bounds below
# sends each field past them)
u63 = st.integers(0, wire.MAX_U63)
u64 = st.integers(0, 2**64 - 1)  # extent tables (not msgspec-decoded)
block_id = st.integers(0, wire.MAX_BLOCK_ID)
text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)  # no controls
blob = st.binary(max_size=64)
port = st.integers(1, wire.MAX_PORT - wire.MAX_TP)


def ranked(cls: type[Any], **kw: Any) -> st.SearchStrategy[Any]:
    """``cls`` with a tp_rank below its tp_size (a cross-field bound) and ``kw``."""
    return st.integers(1, wire.MAX_TP).flatmap(lambda n: st.builds(
        cls, tp_size=st.just(n), tp_rank=st.integers(0, n - 1), **kw))


STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    wire.HandshakeRequest: ranked(
        wire.HandshakeRequest, v=st.just(WIRE_VERSION), engine_id=text, agent_name=text,
        host_id=text, compat=text, auth=blob),
    wire.HandshakeResponse: ranked(
        wire.HandshakeResponse, v=st.just(WIRE_VERSION), engine_id=text, agent_name=text,
        host_id=text, compat=text,
        spec=st.sampled_from([wire.SpecMsg.of(s) for s in SPECS]),
        transports=st.dictionaries(text, blob, max_size=3), incarnation=u63),
    wire.Notification: ranked(
        wire.Notification, v=st.just(WIRE_VERSION), engine_id=text, req_id=text,
        kind=st.sampled_from(["read", "write"]), ok=st.booleans(), detail=text,
        push_id=u63),
    wire.PushRequest: ranked(
        wire.PushRequest, v=st.just(WIRE_VERSION), engine_id=text, agent_name=text,
        req_id=text, host=st.from_regex(r"[A-Za-z0-9._:%-]{1,40}", fullmatch=True), port=port,
        block_ids=st.lists(block_id, max_size=20), push_id=u63,
        ttl_ms=st.integers(0, wire.MAX_TTL_MS), incarnation=u63,
        landing=st.none() | st.builds(
            wire.LandingMsg, name=st.from_regex(r"[a-z0-9-]{1,40}", fullmatch=True),
            token=st.binary(max_size=16), slot=st.integers(0, 1 << 20), host_id=text)),
    wire.ReadIntent: st.builds(wire.ReadIntent, v=st.just(WIRE_VERSION), engine_id=text,
                               req_id=text, tp_rank=st.integers(0, wire.MAX_TP - 1),
                               incarnation=u63, block_ids=st.lists(block_id, max_size=20)),
    wire.ReadGrant: st.builds(wire.ReadGrant, v=st.just(WIRE_VERSION), generation=u63,
                              expires_in=st.floats(-wire.MAX_SECONDS, wire.MAX_SECONDS)),
    wire.ReadDone: ranked(wire.ReadDone, v=st.just(WIRE_VERSION), engine_id=text,
                          req_id=text, incarnation=u63, generation=u63, ok=st.booleans(),
                          block_ids=st.none() | st.lists(block_id, max_size=20)),
    wire.ReadVerdict: st.builds(wire.ReadVerdict, v=st.just(WIRE_VERSION), intact=st.booleans(),
                                reason=text),
    wire.PushCancel: st.builds(wire.PushCancel, v=st.just(WIRE_VERSION), engine_id=text,
                               req_id=text, tp_rank=st.integers(0, wire.MAX_TP - 1),
                               push_id=u63),
    wire.PushState: st.builds(wire.PushState, v=st.just(WIRE_VERSION), state=text,
                              reason=text),
    wire.ErrorReply: st.builds(wire.ErrorReply, v=st.just(WIRE_VERSION), code=text,
                               message=text),
    wire.Ack: st.just(wire.Ack(v=WIRE_VERSION)),
    wire.Challenge: st.builds(wire.Challenge, v=st.just(WIRE_VERSION), nonce=blob),
}
if hasattr(wire, "Signed"):  # authenticated envelope (side-channel auth)
    STRATEGIES[wire.Signed] = st.builds(wire.Signed, v=st.just(WIRE_VERSION), nonce=blob,
                                        mac=blob, body=blob)
STRATEGIES[wire.Hold] = st.builds(wire.Hold, v=st.just(WIRE_VERSION), engine_id=text,
                                  req_id=text, block_ids=st.lists(block_id, max_size=20),
                                  generation=u63)
STRATEGIES[wire.Renew] = st.builds(wire.Renew, v=st.just(WIRE_VERSION), engine_id=text,
                                   req_ids=st.lists(text, min_size=1, max_size=20))
STRATEGIES[wire.Hello] = st.builds(wire.Hello, v=st.just(WIRE_VERSION), nonce=blob)
STRATEGIES[wire.Welcome] = st.builds(wire.Welcome, v=st.just(WIRE_VERSION), nonce=blob)
STRATEGIES[wire.Sealed] = st.builds(wire.Sealed, v=st.just(WIRE_VERSION), counter=u63,
                                    mac=blob, body=blob)
_requests = st.one_of(*(STRATEGIES[t] for t in wire.Request.__args__))
_replies = st.one_of(*(STRATEGIES[t] for t in wire.Reply.__args__))
STRATEGIES[wire.Batch] = st.builds(
    wire.Batch, v=st.just(WIRE_VERSION),
    calls=st.lists(st.builds(wire.Call, id=u63, msg=_requests), max_size=4))
STRATEGIES[wire.Replies] = st.builds(
    wire.Replies, v=st.just(WIRE_VERSION),
    answers=st.lists(st.builds(wire.Answer, id=u63, msg=_replies), max_size=4))
messages = st.one_of(*STRATEGIES.values())


# ----------------------------------------------------------------------------- round trips
@settings(max_examples=300, deadline=None)
@given(messages)
def test_round_trip(msg: Any) -> None:
    buf = wire.encode(msg)
    assert isinstance(buf, bytes)
    out = wire.decode(buf)
    assert type(out) is type(msg) and out == msg
    assert wire.decode(memoryview(buf), expect=type(msg)) == msg
    other = next(t for t in MESSAGE_TYPES if t is not type(msg))
    with pytest.raises(WireError, match=f"expected {other.__name__}"):
        wire.decode(buf, expect=other)


def test_every_message_type_covered() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES), "a message type has no round-trip strategy"


@pytest.mark.parametrize("spec", SPECS, ids=["joined-NHD", "split-HND", "mla"])
def test_spec_round_trip_through_handshake(spec: KVCacheSpec) -> None:
    resp = wire.HandshakeResponse(
        v=WIRE_VERSION, engine_id="prefill-0", agent_name="prefill-0/r3/abcd", tp_rank=3,
        tp_size=4, host_id="host-a", compat="0123456789abcdef", spec=wire.SpecMsg.of(spec),
        transports={"tcp": b"127.0.0.1:5555", "nixl": bytes(range(256))},
    )
    got = wire.decode(wire.encode(resp), expect=wire.HandshakeResponse).spec.to_spec()
    for f in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype",
              "itemsize", "layout", "mla", "regions", "total_kv_heads", "tp_size", "tp_rank"):
        assert getattr(got, f) == getattr(spec, f), f
    assert np.array_equal(got.plane_base, spec.plane_base)
    assert np.array_equal(got.block_stride, spec.block_stride)
    assert got.plane_base.dtype == np.uint64 and got.plane_base.shape == spec.plane_base.shape
    assert got.geometry() == spec.geometry()
    for layer in range(spec.num_layers):  # same bytes addressed on both ends
        assert np.array_equal(got.page_extents(layer, 5, spec.num_kv - 1),
                              spec.page_extents(layer, 5, spec.num_kv - 1))


def test_defaults_apply() -> None:
    n = wire.decode(msgspec.msgpack.encode({"type": "notify", "v": WIRE_VERSION, "engine_id": "e",
                                            "req_id": "r", "tp_rank": 0, "tp_size": 1}))
    assert n == wire.Notification(v=WIRE_VERSION, engine_id="e", req_id="r", tp_rank=0, tp_size=1)
    assert n.ok is True and n.detail == ""


# ----------------------------------------------------------------------------- strict rejection
def _raw(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


NOTIFY = {"type": "notify", "v": WIRE_VERSION, "engine_id": "e", "req_id": "r", "tp_rank": 0,
          "tp_size": 1}


@pytest.mark.parametrize(("fields", "match"), [
    ({**NOTIFY, "extra": 1}, "extra"),  # unknown field
    ({"type": "ack", "v": WIRE_VERSION, "x": None}, "x"),
    ({**NOTIFY, "engine_id": 5}, r"\$\.engine_id"),  # wrong types
    ({**NOTIFY, "tp_rank": "0"}, r"\$\.tp_rank"),
    ({**NOTIFY, "ok": 1}, r"\$\.ok"),
    ({**NOTIFY, "tp_rank": 1.5}, r"\$\.tp_rank"),
    ({"type": "push", "v": WIRE_VERSION, "engine_id": "e", "agent_name": "a", "req_id": "r",
      "tp_rank": 0, "block_ids": [1, "2"]}, r"block_ids\[1\]"),
    ({**NOTIFY, "tp_size": True}, r"\$\.tp_size"),  # bool is not an int
    ({"type": "nope", "v": WIRE_VERSION}, "nope"),  # unknown tag
    ({"v": WIRE_VERSION}, "type"),  # missing tag
    ({k: v for k, v in NOTIFY.items() if k != "req_id"}, "req_id"),  # missing field
    ({"type": "challenge", "v": WIRE_VERSION, "nonce": "not-bytes"}, "nonce"),
    ({"type": "hs_resp", "v": WIRE_VERSION, "engine_id": "e", "agent_name": "a", "tp_rank": 0,
      "tp_size": 1, "host_id": "h", "compat": "c", "spec": {"num_layers": 1},
      "transports": {}}, "spec"),  # incomplete nested struct
])
def test_strict_rejection(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode(_raw(**fields))


def test_wrong_shape_top_level() -> None:
    for obj in ([1, "ack"], 1, "ack", None, b"\x01"):
        with pytest.raises(WireError):
            wire.decode(msgspec.msgpack.encode(obj))
    with pytest.raises(WireError):
        wire.decode(b"")


@pytest.mark.parametrize("v", [0, WIRE_VERSION + 1, 99, -1, 2**63])
def test_unknown_version(v: int) -> None:
    with pytest.raises(WireVersionError, match=f"wire version {v} is not supported"):
        wire.decode(_raw(**{**NOTIFY, "v": v}))


def test_version_checked_before_fields() -> None:
    # a future version may add fields: the version error wins over "unknown field"
    with pytest.raises(WireVersionError):
        wire.decode(_raw(type="brand_new", v=WIRE_VERSION + 1, payload=[1, 2, 3]))
    with pytest.raises(WireError):  # no version at all
        wire.decode(_raw(type="ack"))
    with pytest.raises(WireError):  # version of the wrong type
        wire.decode(_raw(type="ack", v="1"))


@settings(max_examples=40, deadline=None)
@given(messages)
def test_every_truncation_rejected(msg: Any) -> None:
    buf = wire.encode(msg)
    for n in range(len(buf)):
        with pytest.raises(WireError):
            wire.decode(buf[:n])
    with pytest.raises(WireError):  # trailing garbage
        wire.decode(buf + b"\x00")


def test_oversized_rejected_before_parsing() -> None:
    big = b"\xc0" * (wire.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(WireError, match=f"{wire.MAX_MESSAGE_BYTES + 1} B exceeds"):
        wire.decode(big)
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(memoryview(big))
    # a real message padded past the bound (a huge detail string) is also refused
    n = wire.Notification(v=WIRE_VERSION, engine_id="e", req_id="r", tp_rank=0, tp_size=1,
                          detail="x" * wire.MAX_MESSAGE_BYTES)
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(wire.encode(n))
    # just under the bound still decodes (in a field that may be that big: text is bounded
    # far lower, see test_field_bounds)
    ok = wire.Signed(v=WIRE_VERSION, nonce=b"n", mac=b"m",
                     body=b"x" * (wire.MAX_MESSAGE_BYTES - 64))
    assert wire.decode(wire.encode(ok)) == ok


# ----------------------------------------------------------------------------- fuzz
def _decode_or_wire_error(buf: bytes) -> None:
    try:
        out = wire.decode(buf)
    except WireError:
        return
    assert isinstance(out, MESSAGE_TYPES)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(buf: bytes) -> None:
    _decode_or_wire_error(buf)


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       st.integers(0, 10**6))
def test_fuzz_mutated_messages(msg: Any, flips: list[tuple[int, int]], cut: int) -> None:
    buf = bytearray(wire.encode(msg))
    for pos, val in flips:
        buf[pos % len(buf)] = val
    _decode_or_wire_error(bytes(buf[: max(1, len(buf) - cut % 4)]))


@pytest.mark.parametrize("where", ["unknown field", "version probe"])
def test_deep_nesting_is_a_wire_error(where: str) -> None:
    nested = b"\x91" * 200_000 + b"\xc0"  # [[[[...nil...]]]]
    enc = msgspec.msgpack.encode
    if where == "unknown field":
        buf = b"\x83" + enc("v") + enc(1) + enc("type") + enc("ack") + enc("x") + nested
    else:
        buf = b"\x82" + enc("v") + enc(1) + enc("type") + nested
    with pytest.raises(WireError):
        wire.decode(buf)


# ----------------------------------------------------------------------------- extents
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(u64, u64), max_size=20))
def test_extents_round_trip(pairs: list[tuple[int, int]]) -> None:
    ext = make_extents([a for a, _ in pairs], [n for _, n in pairs]) if pairs else \
        np.empty(0, EXTENT_DTYPE)
    buf = wire.extents_to_bytes(ext)
    assert len(buf) == 16 * len(pairs)
    back = wire.extents_from_bytes(buf)
    assert back.dtype == EXTENT_DTYPE
    assert back["addr"].tolist() == [a for a, _ in pairs]
    assert back["len"].tolist() == [n for _, n in pairs]


def test_extents_little_endian_records() -> None:
    buf = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    back = wire.extents_from_bytes(buf)
    assert (int(back["addr"][0]), int(back["len"][0])) == (1, 2)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200).filter(lambda b: len(b) % 16))
def test_extents_bad_length_rejected(buf: bytes) -> None:
    with pytest.raises(WireError, match=f"{len(buf)} B is not a multiple of 16"):
        wire.extents_from_bytes(buf)


def test_extents_count_bound() -> None:
    with pytest.raises(WireError, match="4 entries exceeds 3"):
        wire.extents_from_bytes(bytes(64), max_count=3)
    assert wire.extents_from_bytes(bytes(48), max_count=3).shape == (3,)


# ----------------------------------------------------------------------------- SpecMsg checks
@pytest.mark.parametrize("spec", SPECS, ids=["joined-NHD", "split-HND", "mla"])
@pytest.mark.parametrize("change", [
    {"plane_base": "short"}, {"plane_base": "long"}, {"block_stride": "short"},
    {"block_stride": "long"}, {"plane_base": "negative"}, {"mla": "flip"},
    {"num_layers": 0}, {"layout": "XYZ"}, {"block_size": -1}, {"block_stride": "zero"},
])
def test_spec_msg_rejects_inconsistent(spec: KVCacheSpec, change: dict[str, Any]) -> None:
    sm = wire.SpecMsg.of(spec)
    (key, how), = change.items()
    if key in ("plane_base", "block_stride"):
        vals = list(getattr(sm, key))
        new: Any = {"short": vals[:-1], "long": [*vals, vals[-1]], "negative": [-1] * len(vals),
                    "zero": [0] * len(vals)}[how]
    elif key == "mla":
        new = not sm.mla
    else:
        new = how
    bad = msgspec.structs.replace(sm, **{key: new})
    # a field out of its bounds (a zero layer count, a negative size) is refused as it is
    # decoded; what only the fields together break crosses the wire and fails to_spec()
    with pytest.raises(WireError, match=r"invalid KV cache spec from peer|at `\$\.spec\."):
        wired = wire.decode(wire.encode(wire.HandshakeResponse(
            v=WIRE_VERSION, engine_id="e", agent_name="a", tp_rank=0, tp_size=1, host_id="h",
            compat="c",
            spec=bad, transports={}))).spec
        wired.to_spec()


def test_spec_msg_rejects_zero_itemsize() -> None:
    bad = msgspec.structs.replace(wire.SpecMsg.of(SPECS[0]), itemsize=0)
    with pytest.raises(WireError):
        bad.to_spec()


@pytest.mark.parametrize("value, ok", [
    ("cmpl-7f3a-0", True), ("a b~", True), ("é-\x85-日本", True),  # non-ASCII: the pattern decides
    ("a\x01b", False), ("tab\there", False), ("del\x7f", False), ("é\x00", False),
    ("x" * wire.MAX_ID_LEN, True), ("x" * (wire.MAX_ID_LEN + 1), False),
])
def test_check_id_takes_what_the_wire_takes(value: str, ok: bool) -> None:
    """check_id's C fast path (ASCII and printable) and its pattern fallback accept exactly the
    ids a peer's strict decoder accepts: a request id either leaves or is refused here."""
    try:  # the peer's side: a frame carrying it, built and decoded strictly
        wire.decode(wire.encode(wire.ReadIntent(v=WIRE_VERSION, engine_id="e", req_id=value,
                                                tp_rank=0, incarnation=1, block_ids=[1])))
        decoded = True
    except (KVLinkError, msgspec.ValidationError):
        decoded = False
    assert decoded is ok
    if ok:
        assert wire.check_id(value, "request id") == value
    else:
        with pytest.raises(ConfigError):
            wire.check_id(value, "request id")
