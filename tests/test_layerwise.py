"""Layer-wise push (KVWorker.push(..., layers=(start, stop))): each range of layers is its own
WRITE, posted when the prefill says those layers are ready; the decode learns of each range as
it lands (layers_landed) and finishes the request only once every layer is written.

Real KVWorkers over the real tcp transport and side channel on 127.0.0.1 (a 4-layer cache);
no fake. Each test failed on the code before (push had no ``layers``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_lifecycle import make, outcome, remote, until

from kvlink.demo import data
from kvlink.errors import ConfigError, TransferCancelled, TransferError
from kvlink.integrity import RangeDigests
from kvlink.worker import KVWorker, WorkerConfig

GEO = data.Geometry(layers=4, kv_heads=2, head_dim=8, block_size=4)
HELD, LOCAL = [2, 3, 9], [5, 6, 7]


def rank(engine: str, seed: int, **cfg: object) -> KVWorker:
    buf, layers = data.allocate(GEO, 16, 1, 0)
    buf[:] = np.random.default_rng(seed).integers(1, 2**16, buf.shape, dtype=np.uint16)
    w = KVWorker(WorkerConfig(engine_id=engine, serve_pushes=True, **cfg))  # type: ignore[arg-type]
    w.register(data.spec_of(GEO, layers, 1, 0))
    w._keep = (buf, layers)  # type: ignore[attr-defined]
    return w


def layer(w: KVWorker, i: int, ids: list[int]) -> np.ndarray:
    return np.asarray(w._keep[1][i])[:, ids].copy()  # type: ignore[attr-defined]


def asked(prefill: KVWorker, decode: KVWorker, timeout: float = 20.0) -> object:
    prefill.hold("r0", HELD)
    decode.expect_push("r0", remote(prefill), LOCAL, timeout=timeout)
    until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
    (msg,) = prefill.push_requests()
    return msg


def landed(prefill: KVWorker, decode: KVWorker, want: int) -> None:
    """Step both sides until the decode sees ``want`` layers landed (from the prefill's
    note, or sooner from its landing board: kvlink.landing) and the prefill has reported
    every range posted so far."""
    until(lambda: prefill.poll() is None or (decode.layers_landed("r0") >= want
                                             and not prefill._requests), 10,
          f"{want} layers landed")


def test_layers_land_one_range_at_a_time_and_the_request_only_at_the_end() -> None:
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        before = [layer(decode, i, LOCAL) for i in range(4)]
        rid = prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        done, failed = decode.poll()
        assert "r0" not in done and not failed  # landed is not loaded
        assert np.array_equal(layer(decode, 0, LOCAL), layer(prefill, 0, HELD))
        for i in (1, 2, 3):  # not pushed yet: untouched
            assert np.array_equal(layer(decode, i, LOCAL), before[i])
        assert prefill.push(msg, HELD, lease="r0", layers=(1, 3)) == rid
        landed(prefill, decode, 3)
        assert np.array_equal(layer(decode, 3, LOCAL), before[3])
        prefill.push(msg, HELD, lease="r0", layers=(3, 4))
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
        gone: list[str] = []
        # (the decode may have finished on its landing board before the prefill's poll saw
        # the push DONE: the prefill releases at its own poll)
        until(lambda: prefill.poll() is None or bool(gone.extend(
            r.req_id for r in prefill.released())) or "r0" in gone, 5,
            "the hold released by its last writer")
    finally:
        prefill.close()
        decode.close()


def test_a_cancel_between_ranges_stops_the_push_and_fails_it_quiescent() -> None:
    """The prefill pushes layer 0, then stalls; the decode times out and cancels: no later
    layer is posted (the next call raises), the push fails on the decode only once the
    prefill said so, and layers 1-3 of its blocks are untouched."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode, timeout=0.5)
        before = [layer(decode, i, LOCAL) for i in range(4)]
        prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        ended: dict[str, str] = {}
        ok, reason = outcome(decode, "r0", 10, step=lambda: ended.update(prefill.poll()[1]))
        assert not ok and "did not push within the timeout" in reason, reason
        until(lambda: bool(ended.update(prefill.poll()[1])) or bool(ended), 5,
              "the prefill ended the push")
        assert "cancelled by the decode after layer 1" in next(iter(ended.values()))
        with pytest.raises(TransferCancelled, match=r"no more layers|ended"):
            prefill.push(msg, HELD, lease="r0", layers=(1, 2))
        for i in (1, 2, 3):
            assert np.array_equal(layer(decode, i, LOCAL), before[i])
        assert prefill.pending() == 0 and decode.quarantined() == 0
    finally:
        prefill.close()
        decode.close()


@pytest.mark.fault("layer-wise push: the prefill stops feeding layers and its decode is gone")
def test_a_layer_wise_push_short_of_layers_fails_at_its_time_to_live(
        observed: Callable[[str], None]) -> None:
    """The prefill pushes layer 0 of a push with a 0.5 s time to live, then feeds no more
    layers, and the decode closes (gone: no cancel comes). The push fails once past its time
    to live and the wait for a cancel (``handshake_timeout``), naming it; the writer's read of
    the hold ends with it (the hold is released), and a late range is refused. Before, it was
    never reported, and its slot and the hold stayed taken."""
    prefill, decode = rank("p", 1, handshake_timeout=0.5), rank("d", 2)
    try:
        msg = asked(prefill, decode, timeout=0.5)
        rid = prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        decode.close()
        ended: dict[str, str] = {}
        until(lambda: bool(ended.update(prefill.poll()[1])) or rid in ended, 10,
              "the prefill ended the push")
        observed(f"prefill: {ended[rid]}")
        assert "past its time to live (500 ms) with layers [1, 4) not pushed" in ended[rid]
        assert "r0" in [r.req_id for r in prefill.released()]
        assert not prefill._layered and prefill._push_slots.live() == 0
        with pytest.raises(TransferCancelled, match="time to live"):
            prefill.push(msg, HELD, lease="r0", layers=(1, 2))
    finally:
        prefill.close()
        decode.close()


def test_no_range_of_a_layer_wise_push_is_posted_past_its_time_to_live() -> None:
    """Layer 0 pushed and landed with a 0.5 s time to live; the next range comes once that
    has passed, before any cancel (the decode does not step). It is refused, naming why, and
    nothing of it is written — the decode gave up on the push at its time to live; the next
    poll ends the push, naming it. Before, the range was posted (a WRITE into blocks its
    decode keeps quarantined only until told) and the push ran on."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode, timeout=0.5)
        before = [layer(decode, i, LOCAL) for i in range(4)]
        rid = prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        slot = prefill._push_slots._slots[prefill._layered[rid].key]
        until(lambda: time.monotonic() > slot.deadline, 5, "its time to live passed")
        with pytest.raises(TransferCancelled, match="past its time to live"):
            prefill.push(msg, HELD, lease="r0", layers=(1, 2))
        ended: dict[str, str] = {}
        until(lambda: bool(ended.update(prefill.poll()[1])) or rid in ended, 5,
              "the prefill ended the push")
        assert "past its time to live" in ended[rid], ended
        for i in (1, 2, 3):
            assert np.array_equal(layer(decode, i, LOCAL), before[i])
    finally:
        prefill.close()
        decode.close()


def test_an_open_layer_wise_push_is_pending_until_its_decode_is_told() -> None:
    """Layer 0 pushed and landed, then the decode times out and cancels between two ranges
    (answered "in flight": it keeps its blocks until the prefill says the push ended).
    Nothing of the push is in flight, but it is open: ``pending()`` counts it, so a caller
    that polls while anything is pending (README: how owed reports get sent) polls until the
    push ended and its decode was told. Before, ``pending()`` read 0 here: that loop stopped
    at once, the decode kept its blocks quarantined and the prefill's hold stayed taken."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode, timeout=0.5)
        rid = prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        key = prefill._layered[rid].key
        until(lambda: decode.poll() is None or prefill._push_slots.asked_to_stop(key), 10,
              "the decode cancelled the push")
        assert decode.quarantined() == 1
        ended: dict[str, str] = {}
        until(lambda: not prefill.pending() or bool(ended.update(prefill.poll()[1])), 10,
              "the prefill's loop: poll while anything is pending")
        assert "cancelled by the decode after layer 1" in ended.get(rid, ""), ended
        ok, reason = outcome(decode, "r0", 10)  # the prefill polls no more
        assert not ok and "did not push within the timeout" in reason, reason
        assert decode.quarantined() == 0
        assert "r0" in [r.req_id for r in prefill.released()]
    finally:
        prefill.close()
        decode.close()


def test_close_reports_an_open_layer_wise_push_under_its_id() -> None:
    """close() with a layer-wise push open (layer 0 landed, layer 1 posted): the next poll
    reports the push failed under the id push() returned. Before, it reported the range's
    internal id (``<id>@1-2``), which the caller never saw, and never the push's own."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        rid = prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        assert prefill.push(msg, HELD, lease="r0", layers=(1, 2)) == rid
        prefill.close()
        done, failed = prefill.poll()
        assert not done and list(failed) == [rid], failed
        assert "closed with it in flight" in failed[rid]
    finally:
        prefill.close()
        decode.close()


def test_layer_ranges_are_checked_naming_the_values() -> None:
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        with pytest.raises(ConfigError, match=r"starts at layer 0, got \[1, 2\)"):
            prefill.push(msg, HELD, lease="r0", layers=(1, 2))
        with pytest.raises(ConfigError, match=r"outside \[0, 4\)"):
            prefill.push(msg, HELD, lease="r0", layers=(0, 5))
        prefill.push(msg, HELD, lease="r0", layers=(0, 2))
        with pytest.raises(ConfigError, match=r"the next is 2, got \[3, 4\)"):
            prefill.push(msg, HELD, lease="r0", layers=(3, 4))
        prefill.push(msg, HELD, lease="r0", layers=(2, 4))
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
    finally:
        prefill.close()
        decode.close()


def _keep(w: KVWorker, i: int) -> np.ndarray:
    return np.asarray(w._keep[1][i])  # type: ignore[attr-defined]


def pushed_in_two(prefill: KVWorker, decode: KVWorker, between=lambda: None) -> tuple[bool, str]:
    """Layers [0, 2) pushed and landed, then ``between()``, then [2, 4): the push's outcome."""
    msg = asked(prefill, decode)
    prefill.push(msg, HELD, lease="r0", layers=(0, 2))
    landed(prefill, decode, 2)
    assert "r0" not in decode.poll()[0]  # landed is not loaded
    between()
    prefill.push(msg, HELD, lease="r0", layers=(2, 4))
    return outcome(decode, "r0", 10, step=lambda: prefill.poll())


@pytest.mark.parametrize("level", ["full", "sample"])
def test_integrity_checks_a_layer_wise_push_once_its_last_layer_is_written(level: str) -> None:
    """With integrity on, the prefill digests each range as it pushes it (its layers are final
    then) and sends them all with "written"; the decode checks every layer of what landed
    before the push finishes. (Refused before: integrity did not cover it.)"""
    prefill = rank("p", 1, integrity=level)
    decode = rank("d", 2, integrity=level)
    try:
        ok, reason = pushed_in_two(prefill, decode)
        assert ok, reason
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
        checked = decode.integrity.checked_blocks
        assert (checked == 3 if level == "full" else 1 <= checked <= 3), checked
        assert decode.integrity.failures == 0
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("level", ["full", "off"], ids=["full", "off control"])
@pytest.mark.parametrize("fault", ["landed layer overwritten", "source changed before its WRITE"])
def test_a_layer_wise_push_with_wrong_kv_fails_naming_the_layer(level: str, fault: str) -> None:
    """Both injected: a byte of layer 0, already landed in the decode's block, overwritten
    before the last range is pushed (a late write into it); or a byte of the prefill's layer
    2 changed after the forward wrote it and its range was digested, before that range's
    WRITE read it (the block reused under the push). Either way the decode holds KV the
    forward did not write: the push fails naming block and layer; with integrity off the same
    push finishes with the wrong bytes (the control). The second is injected by wrapping the
    prefill's own ``_start`` (a fake only for its timing: a real reuse cannot be made to land
    between a range's digest and its WRITE on demand); the transport and workers are real."""
    prefill = rank("p", 1, integrity=level)
    decode = rank("d", 2, integrity=level)
    written = [layer(prefill, i, HELD) for i in range(4)]  # what the "forward" wrote

    def late_write() -> None:
        if fault == "landed layer overwritten":
            _keep(decode, 0)[0, LOCAL[1], 2, 1, 3] ^= 1

    start = prefill._start

    def changed_then_start(*args: Any, **kw: Any) -> None:  # (after the range's digest)
        if fault == "source changed before its WRITE" and kw.get("layers") == (2, 4):
            _keep(prefill, 2)[1, HELD[2], 0, 0, 5] ^= 1
        start(*args, **kw)

    prefill._start = changed_then_start  # type: ignore[method-assign]
    try:
        ok, reason = pushed_in_two(prefill, decode, late_write)
        wrong = [i for i in range(4) if not np.array_equal(layer(decode, i, LOCAL), written[i])]
        assert wrong == ([0] if fault == "landed layer overwritten" else [2])
        if level == "off":
            assert ok, reason  # silently wrong: what integrity is for
            return
        bad = LOCAL[1] if fault == "landed layer overwritten" else LOCAL[2]
        assert not ok and "differs from the producer's" in reason, reason
        assert f"local block {bad} " in reason and f"layer {wrong[0]}," in reason, reason
        assert decode.integrity.failures == 1
    finally:
        prefill.close()
        decode.close()


def test_a_range_that_cannot_be_digested_is_not_posted_and_fails_the_push(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A range whose digests cannot be taken (injected: the digest raises, as a device error
    in its kernel would — the real one cannot be made to fail on demand) is not posted: the
    call raises naming the layers, and the decode is told the push failed (never loaded),
    layers 2-3 of its blocks untouched."""
    prefill = rank("p", 1, integrity="full")
    decode = rank("d", 2, integrity="full")
    try:
        msg = asked(prefill, decode)
        before = [layer(decode, i, LOCAL) for i in range(4)]
        prefill.push(msg, HELD, lease="r0", layers=(0, 2))

        def fails(self: RangeDigests, start: int, stop: int) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(RangeDigests, "take", fails)
        with pytest.raises(TransferError, match=r"digesting layers \[2, 4\) failed"):
            prefill.push(msg, HELD, lease="r0", layers=(2, 4))
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert not ok and "digesting layers [2, 4) failed" in reason, reason
        for i in (2, 3):
            assert np.array_equal(layer(decode, i, LOCAL), before[i])
        assert prefill.pending() == 0
    finally:
        prefill.close()
        decode.close()


def test_a_whole_push_whose_digests_cannot_be_read_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole push from a hold that fixed no digests takes them as it is pushed (on a GPU,
    on the caller's stream, not waited for) and reads them for its note once the WRITE is
    DONE; where they cannot be read then (injected: reading raises, as a device error would
    — the real one cannot be made to fail on demand), the push fails naming why, and the
    decode (no landing board: it waits for the note) is told it failed, never loaded."""
    prefill = rank("p", 1, integrity="full")
    decode = rank("d", 2, integrity="full", landing_board=False)
    try:
        prefill.hold("r0", HELD, final=False)
        decode.expect_push("r0", remote(prefill), LOCAL, timeout=20)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()

        def fails(self: RangeDigests, layers: int) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(RangeDigests, "wire", fails)
        prefill.push(msg, HELD, lease="r0")
        ended: dict[str, str] = {}
        ok, reason = outcome(decode, "r0", 10, step=lambda: ended.update(prefill.poll()[1]))
        assert not ok and "the pushed blocks' digests: RuntimeError" in reason, reason
        assert any("the pushed blocks' digests" in why for why in ended.values()), ended
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("final", [False, True], ids=["held not final", "held final: control"])
def test_a_hold_before_its_kv_is_written_fixes_no_digests(final: bool) -> None:
    """vLLM's layer-wise flow holds a request when its forward starts, before the KV is
    written. Held with ``final=False`` no digests are fixed then: a whole push from that hold
    after the forward digests the written blocks and passes, and a READ of it fails closed
    (no digest to trust). The control: digests fixed at such a hold describe the KV before
    the forward, and the push of the right KV fails against them."""
    prefill = rank("p", 1, integrity="full")
    decode = rank("d", 2, integrity="full")
    try:
        prefill.hold("r0", HELD, final=final)
        for i in range(4):  # the forward writes the request's KV
            _keep(prefill, i)[:, HELD] += 1
        decode.expect_push("r0", remote(prefill), LOCAL, timeout=20)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()
        prefill.push(msg, HELD, lease="r0")
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        if final:
            assert not ok and "differs from the producer's" in reason, reason
            return
        assert ok, reason
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
        gen = prefill.hold("r1", HELD, final=False)
        decode.read("r1", remote(prefill), LOCAL, HELD, generation=gen)
        ok, reason = outcome(decode, "r1", 10, step=lambda: prefill.poll())
        assert not ok and "sent no digest" in reason, reason
    finally:
        prefill.close()
        decode.close()


def test_whole_push_reports_no_layers_before_it_is_written() -> None:
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        decode.expect_push("r0", remote(prefill), [3], timeout=10)
        assert decode.layers_landed("r0") == 0
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg,) = prefill.push_requests()
        prefill.push(msg, [5])
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        assert decode.layers_landed("r0") == 0  # not awaited any more
    finally:
        prefill.close()
        decode.close()


def test_ranges_that_landed_by_one_poll_are_told_in_one_note() -> None:
    """A forward enqueues its layers faster than the device runs them, so a prefill that polls
    after its forward finds every range DONE at once: one merged "layers" note then, not one
    per range (80 for a 70B model; each one a message the decode must take). The transport's
    handles are polled directly first, so both ranges are DONE before the worker's poll. (A
    decode without a landing board: with one, no note at all — tests/test_landing.py.)"""
    prefill, decode = rank("p", 1), rank("d", 2, landing_board=False)
    try:
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0", layers=(0, 1))  # (the handshake, then posted)
        landed(prefill, decode, 1)
        for i in (1, 2):  # a cached peer: posted in the call
            prefill.push(msg, HELD, lease="r0", layers=(i, i + 1))
        handles = [(p.go.peer.transport, p.handle) for r in prefill._requests.values()
                   for p in r.parts if p.handle is not None and p.go is not None]
        assert len(handles) == 2
        until(lambda: all(t.poll(h).status.value != "pending" for t, h in handles), 10,
              "both WRITEs DONE")
        sent = prefill._chan.calls_sent
        prefill.poll()
        assert prefill._chan.calls_sent - sent == 1  # one note: layers [1, 3)
        until(lambda: decode.layers_landed("r0") == 3, 10, "layers [0, 3) landed")
        prefill.push(msg, HELD, lease="r0", layers=(3, 4))
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
    finally:
        prefill.close()
        decode.close()
