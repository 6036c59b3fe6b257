"""The landing board (kvlink.landing): a same-host push ends on the decode without the
prefill's "written" note — its transport moves the decode's flag once the bytes landed, and
the decode checks the prefill's hold on its hold board — and never on a flag it cannot trust.

Real KVWorkers over the real tcp transport (which signals from its peer thread once the owner
acknowledged the bytes), side channel and shared-memory boards on this host; no fake. The
end-to-end tests failed on the code before (a decode waited for the prefill's note, which
only the prefill's poll sends: it timed out).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layerwise import HELD, LOCAL, _keep, asked, landed, layer, rank
from test_lifecycle import outcome, remote, until

from kvlink import landing
from kvlink.holdboard import Offer
from kvlink.worker import KVWorker


def _wait_written(prefill: KVWorker) -> None:
    """The prefill's posted WRITEs DONE on its transport (polled directly: the worker's own
    poll would send the note this test does without)."""
    handles = [(p.go.peer.transport, p.handle) for r in prefill._requests.values()
               for p in r.parts if p.handle is not None and p.go is not None]
    assert handles, "nothing posted"
    until(lambda: all(t.poll(h).status.value != "pending" for t, h in handles), 10,
          "the WRITEs DONE")


def _finish_silently(decode: KVWorker, req: str, timeout: float = 10.0) -> tuple[bool, str]:
    """The decode's poll alone, the prefill not polled at all (no note can come)."""
    return outcome(decode, req, timeout)


def _note_taken_quietly(prefill: KVWorker, decode: KVWorker) -> None:
    """The prefill's "written" note, sent once its push ended there, reaches a decode that
    ended the push on its board first: taken, not refused."""
    until(lambda: prefill.poll() is None or prefill.pending() == 0, 10, "the push ended")
    until(lambda: decode.poll() is None or not decode._chan.busy(), 5, "notes taken")
    assert decode.refusals["written"] == 0


def test_a_layer_wise_push_ends_on_the_board_without_the_note() -> None:
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        assert msg.landing is not None  # the decode offered its board
        prefill.push(msg, HELD, lease="r0", layers=(0, 1))  # the handshake, then posted
        landed(prefill, decode, 1)
        prefill.push(msg, HELD, lease="r0", layers=(1, 4))  # a cached peer: posted now
        ok, reason = _finish_silently(decode, "r0")
        assert ok, reason
        assert decode.board_landed == 1
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
        # the prefill's note comes after the decode ended the push: taken, not refused
        _note_taken_quietly(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_ranges_signalled_on_the_board_are_told_by_no_note() -> None:
    """The decode reads what landed off its board (layers_landed), so the prefill sends no
    "layers" notes for a push whose every range signalled: its side channel stays quiet while
    the push ends (on one H200 a note arriving then held the decode's completing poll 0.1 ms)."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        sent = prefill._chan.calls_sent
        for i in (1, 2):
            prefill.push(msg, HELD, lease="r0", layers=(i, i + 1))
        landed(prefill, decode, 3)
        assert prefill._chan.calls_sent == sent  # no "layers" note
        assert decode.layers_landed("r0") == 3
    finally:
        prefill.close()
        decode.close()


def test_a_whole_push_ends_on_the_board_without_the_note() -> None:
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0")
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        prefill.hold("r1", HELD)
        decode.expect_push("r1", remote(prefill), LOCAL, timeout=20)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg1,) = prefill.push_requests()
        before = decode.board_landed
        prefill.push(msg1, HELD, lease="r1")  # the peer is cached: posted in the call
        ok, reason = _finish_silently(decode, "r1")
        assert ok, reason
        assert decode.board_landed == before + 1
    finally:
        prefill.close()
        decode.close()


def test_a_push_reported_off_the_board_gives_its_slot_back_at_the_next_poll() -> None:
    """The poll that finds a push written on the board returns it at once (the slot is given
    back one poll later, off the report's path): the slot must still come back, and the
    prefill's note that follows is taken quietly, not refused."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        assert decode.landing is not None
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0")  # (the handshake: the first push is not timed)
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        decode.poll()
        free = len(decode.landing._free)
        prefill.hold("r1", HELD)
        decode.expect_push("r1", remote(prefill), LOCAL, timeout=20)
        assert len(decode.landing._free) == free - 1  # the push's slot, taken at the ask
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg1,) = prefill.push_requests()
        before = decode.board_landed
        prefill.push(msg1, HELD, lease="r1")  # the peer is cached: posted in the call
        _wait_written(prefill)
        done: set[str] = set()
        until(lambda: bool(done.update(decode.poll()[0]) or done), 10, "reported")
        assert done == {"r1"} and decode.board_landed == before + 1
        decode.poll()
        assert len(decode.landing._free) == free
        _note_taken_quietly(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_hold_that_ended_under_the_push_is_not_trusted_from_the_board() -> None:
    """The bytes land and the flag moves, but the prefill's hold ended (aborted: its blocks
    may be reused) before the decode looked: the board is not enough, the prefill's note
    decides — and it says the lease ended under the WRITE."""
    prefill, decode = rank("p", 1), rank("d", 2)
    try:
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0", layers=(0, 1))
        landed(prefill, decode, 1)
        prefill.push(msg, HELD, lease="r0", layers=(1, 4))
        _wait_written(prefill)
        prefill.abort("r0")
        done, _ = decode.poll()
        assert "r0" not in done and decode.board_landed == 0
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert not ok and "ended under the WRITE" in reason, reason
    finally:
        prefill.close()
        decode.close()


def test_without_the_board_the_push_still_ends_by_note() -> None:
    prefill, decode = rank("p", 1), rank("d", 2, landing_board=False)
    try:
        msg = asked(prefill, decode)
        assert msg.landing is None
        prefill.push(msg, HELD, lease="r0")
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        assert decode.board_landed == 0
    finally:
        prefill.close()
        decode.close()


# ------------------------------------------------------------------ with integrity on
def _integrity_push(prefill: KVWorker, decode: KVWorker, how: str) -> str:
    """Push a request whole or in two ranges with the peer's handshake done before (by a
    push of r0 first, whole; by the first range), the last call posting at once: what is
    left is the decode's to see. Returns the request pushed."""
    msg = asked(prefill, decode)
    if how == "whole":
        prefill.push(msg, HELD, lease="r0")
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        _note_taken_quietly(prefill, decode)
        prefill.hold("r1", HELD)
        decode.expect_push("r1", remote(prefill), LOCAL, timeout=20)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg1,) = prefill.push_requests()
        prefill.push(msg1, HELD, lease="r1")
        return "r1"
    prefill.push(msg, HELD, lease="r0", layers=(0, 1))
    landed(prefill, decode, 1)
    prefill.push(msg, HELD, lease="r0", layers=(1, 4))
    return "r0"


@pytest.mark.parametrize("level", ["full", "sample"])
@pytest.mark.parametrize("how", ["layer-wise", "whole"])
def test_an_integrity_push_ends_on_the_board_with_its_digests(how: str, level: str) -> None:
    """With integrity on, the prefill puts each range's digests in the slot's digest area
    before its WRITE, so the decode checks what landed once the flag shows every layer — no
    note (the prefill is not polled at all). Before, a decode with integrity on took no slot
    and waited for the note (this test timed out)."""
    prefill, decode = rank("p", 1, integrity=level), rank("d", 2, integrity=level)
    try:
        req = _integrity_push(prefill, decode, how)
        before = (decode.board_landed, decode.integrity.checked_blocks)
        ok, reason = _finish_silently(decode, req)
        assert ok, reason
        assert decode.board_landed == before[0] + 1
        checked = decode.integrity.checked_blocks - before[1]
        assert (checked == 3 if level == "full" else 1 <= checked <= 3), checked
        for i in range(4):
            assert np.array_equal(layer(decode, i, LOCAL), layer(prefill, i, HELD))
        _note_taken_quietly(prefill, decode)
        assert decode.integrity.failures == 0  # (the note's digests were not checked again)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("level", ["full", "off"], ids=["full", "off control"])
def test_a_late_write_fails_the_push_on_the_board(level: str) -> None:
    """A byte of layer 0, landed in the decode's block, overwritten before the last range is
    pushed (injected: a late write): the check at the flag fails the push naming block and
    layer, without the note; with integrity off the push ends there with the wrong byte."""
    prefill, decode = rank("p", 1, integrity=level), rank("d", 2, integrity=level)
    try:
        msg = asked(prefill, decode)
        prefill.push(msg, HELD, lease="r0", layers=(0, 2))
        landed(prefill, decode, 2)
        _keep(decode, 0)[0, LOCAL[1], 2, 1, 3] ^= 1
        prefill.push(msg, HELD, lease="r0", layers=(2, 4))
        ok, reason = _finish_silently(decode, "r0")
        if level == "off":
            assert ok and decode.board_landed == 1, reason
            assert not np.array_equal(layer(decode, 0, LOCAL), layer(prefill, 0, HELD))
            return
        assert not ok and "differs from the producer's" in reason, reason
        assert f"local block {LOCAL[1]} " in reason and "layer 0," in reason, reason
        assert decode.board_landed == 0 and decode.integrity.failures == 1
    finally:
        prefill.close()
        decode.close()


def test_a_slot_without_a_digest_area_leaves_an_integrity_push_to_its_note() -> None:
    """The decode's arena full (every page taken: a real one, as a flood of large pushes
    leaves it): its slot carries no digest area, and with integrity on the flag alone is not
    trusted — the push ends by the prefill's note, which carries the digests."""
    prefill, decode = rank("p", 1, integrity="full"), rank("d", 2, integrity="full")
    try:
        assert decode.landing is not None
        msg = asked(prefill, decode)  # r0: the handshake
        prefill.push(msg, HELD, lease="r0")
        ok, reason = outcome(decode, "r0", 10, step=lambda: prefill.poll())
        assert ok, reason
        _note_taken_quietly(prefill, decode)
        decode.landing._arena.used[:] = True
        before = (decode.board_landed, decode.integrity.checked_blocks)
        prefill.hold("r1", HELD)
        decode.expect_push("r1", remote(prefill), LOCAL, timeout=20)
        until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
        (msg1,) = prefill.push_requests()
        assert msg1.landing is not None and msg1.landing.digests_bytes == 0
        prefill.push(msg1, HELD, lease="r1")
        _wait_written(prefill)
        done, failed = decode.poll()
        assert "r1" not in done and not failed  # written on the board: not enough
        ok, reason = outcome(decode, "r1", 10, step=lambda: prefill.poll())
        assert ok, reason
        assert decode.board_landed == before[0]
        assert decode.integrity.checked_blocks == before[1] + 3
    finally:
        prefill.close()
        decode.close()


# ---------------------------------------------------------------------------- the board itself
@pytest.fixture
def board() -> landing.LandingBoard:
    b = landing.LandingBoard.create()
    if b is None:
        print("\nskipping: no /dev/shm here for a landing board")
        pytest.skip("no /dev/shm here for a landing board")
    yield b
    b.close()


def test_a_range_that_never_moved_stops_the_chain(board: landing.LandingBoard) -> None:
    """Layers [1, 2) failed at its post (no signal): the signal of [2, 4) finds the flag at
    1, not 2, and leaves it — no later range can claim the layers of one that did not land."""
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    slot, tag = board.take(), landing.tag_of(12345)
    assert slot is not None
    view.start(slot, tag, landing.Hold(0, 0, None))
    assert view.signal(slot, tag, 0, 1).apply()
    assert not view.signal(slot, tag, 2, 4).apply()
    assert board.landed(slot, tag) == 1
    view.close()


def test_slots_carry_their_push_only(board: landing.LandingBoard) -> None:
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    slot = board.take()
    assert slot is not None
    tag, other = landing.tag_of(7), landing.tag_of(8)
    assert board.hold(slot, tag) is None and board.landed(slot, tag) == 0  # cleared
    hold = landing.Hold(99, 1234, Offer("kvlink-board-" + "ab" * 16, b"t" * 16))
    view.start(slot, tag, hold)
    assert board.hold(slot, tag) == hold
    assert board.hold(slot, other) is None  # another push's tag: not ours
    assert view.signal(slot, tag, 0, 3).apply()
    assert board.landed(slot, tag) == 3 and board.landed(slot, other) == 0
    board.give(slot)
    again = board.take()
    assert again == slot and board.hold(again, tag) is None  # cleared for the next push
    view.close()


def test_a_half_written_slot_is_never_read_as_no_lease(board: landing.LandingBoard) -> None:
    """A slot whose tag shows but whose hold reads as zeros (stores seen out of order) names
    generation 0 and no hold board: a hold to check, which cannot be shown — never "pushed
    without a lease, nothing to check" (that is NO_LEASE)."""
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    slot = board.take()
    assert slot is not None
    tag = landing.tag_of(9)
    view._slots[slot, 1] = np.uint64(tag)  # an injected fault: only the tag has landed
    hold = board.hold(slot, tag)
    assert hold is not None and hold.generation != landing.NO_LEASE and hold.board is None
    view.start(slot, tag, landing.Hold(landing.NO_LEASE, 0, None))
    assert board.hold(slot, tag) == landing.Hold(landing.NO_LEASE, 0, None)
    view.close()


def test_a_board_is_opened_only_with_its_token(board: landing.LandingBoard) -> None:
    assert landing.LandingView.open(board.name, b"x" * 16) is None
    assert landing.LandingView.open("kvlink-landing-../../etc", board.token) is None
    assert landing.LandingView.open(board.name.replace("landing", "board"), board.token) is None


def test_an_end_check_reads_the_flag_and_the_hold_where_they_lie(
        board: landing.LandingBoard) -> None:
    """The check the poll that ends a push makes (bound once, read in place): written only
    with the flag at every layer of this push AND the hold still shown; a hold withdrawn, a
    flag one layer short or another push's, say not written; a hold board closed under the
    check says "bind anew" (None), never "written"."""
    from kvlink.holdboard import BoardView, HoldBoard, fingerprint

    holds = HoldBoard.create()
    assert holds is not None
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    ids = np.arange(8)
    gen, fp = 41, fingerprint(ids)
    assert holds.publish(gen, ids)
    shown = BoardView.open(holds.name, holds.token)
    assert shown is not None
    slot, tag = board.take(), landing.tag_of(77)
    assert slot is not None
    view.start(slot, tag, landing.Hold(gen, fp, holds.offer()))
    check = board.end_check(slot, tag, 4, shown.reader(gen), (gen, fp))
    assert check.written() is False  # nothing landed
    assert view.signal(slot, tag, 0, 3).apply()
    assert check.written() is False  # a layer short
    assert view.signal(slot, tag, 3, 4).apply()
    assert check.written() is True
    other = board.end_check(slot, landing.tag_of(78), 4, shown.reader(gen), (gen, fp))
    assert other.written() is False  # another push's flag
    lease_less = board.end_check(slot, tag, 4, None, (landing.NO_LEASE, 0))
    assert lease_less.written() is True  # pushed without a lease: nothing to check
    holds.withdraw(gen)
    assert check.written() is False  # the hold ended: not trusted from the board
    assert holds.publish(gen + 4096, ids)  # another hold in the same slot: not ours
    assert check.written() is False
    shown.close()
    assert check.written() is None
    holds.close()
    view.close()


def test_a_digest_area_is_read_only_for_its_push_and_its_size(
        board: landing.LandingBoard) -> None:
    """What the decode reads of a slot's digest area: the prefill's digests for this push's
    tag, plane by plane back into (block, layer, plane, head) order; nothing for another tag,
    nor before the prefill wrote its header; a header whose sizes overrun the area, nothing;
    digests that do not fit are not written (open says None: the push ends by note)."""
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    slot = board.take()
    assert slot is not None
    got = board.take_area(slot, 8 * (landing.AREA_HEAD + 2 + 2 * 3 * 2 * 1))
    assert got is not None
    at, nbytes = got
    tag = landing.tag_of(5)
    assert board.digests(slot, tag) is None  # nothing written yet
    area = view.area(at, nbytes)
    assert area is not None and view.area(at + 8, nbytes) is None  # not a page of the arena
    ids = np.array([7, 3])
    assert area.open(tag, ids, (3, 2, 1000)) is None  # too large for the area
    assert board.digests(slot, tag) is None
    place = area.open(tag, ids, (3, 2, 1))
    assert place is not None and place.shape == (6, 2, 1)
    want = np.arange(2 * 3 * 2, dtype=np.uint64).reshape(2, 3, 2, 1)  # [k, layers, planes, heads]
    place[...] = want.transpose(1, 2, 0, 3).reshape(6, 2, 1)
    read = board.digests(slot, tag)
    assert read is not None
    assert read[0].tolist() == [7, 3]  # the digests plane by plane, as the area keeps them
    assert np.array_equal(read[1], want.transpose(1, 2, 0, 3).reshape(6, 2, 1))
    assert board.digests(slot, landing.tag_of(6)) is None  # another push's
    view._map[at + 16:at + 24] = (1 << 40).to_bytes(8, "little")  # injected: layers overrun
    assert board.digests(slot, tag) is None
    board.give(slot)
    assert not board._arena.used.any()
    view.close()
