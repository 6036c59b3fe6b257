"""The C lane launcher (kvlink/_native.c, built by kvlink.native): what it writes and
which driver calls it makes, in which order, and how it fails.

No GPU here: the driver's five functions are stand-ins (ctypes callbacks that record their
calls and return what a test tells them to), handed to the launcher as it is handed the real
ones. The real driver is exercised by scripts/gpu_runs_check.py (its lane rows go through
this launcher where it builds, and it says whether it did)."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import pytest

from kvlink import native
from kvlink.errors import ExtentOutOfBounds
from kvlink.gpu.lane import (
    _BOARD_AT,
    _BOARD_LEN,
    _DIGEST_CHECK,
    _DIGEST_GENERATION,
    _DIGEST_PICK,
    _DIGEST_SLOTS,
    _PLAIN_SLOTS,
    END_WORD,
    BoardDigest,
    board_slot,
    sample_order,
)
from kvlink.holdboard import LAYOUT, BoardView, HoldBoard
from kvlink.transport import Op

NOT_READY = 600
vp = ctypes.c_void_p
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                          ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, vp, vp, vp)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, vp)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_uint)
WRITE = ctypes.CFUNCTYPE(ctypes.c_int, vp, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)


class StandInDriver:
    """cuLaunchKernel, cuStreamQuery, cuEventRecord, cuStreamWaitEvent,
    cuStreamWriteValue32 as callbacks (a
    stand-in: this machine has no CUDA driver). ``calls``: what was called, in order, with
    the launch's table and argument slots as they were at the call."""

    def __init__(self, table: Any, slots: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.rc = {"launch": 0, "query": 0, "record": 0, "wait": 0, "write": 0}
        self._table, self._slots = table, slots

        def launch(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, sh: int,
                   stream: int, params: int, extra: int) -> int:
            self.calls.append(("launch", f, gx, bx, stream, params,
                               list(self._table[:12]), list(self._slots)))
            return self.rc["launch"]

        self._fns = (LAUNCH(launch),
                     QUERY(lambda s: self._call("query", s)),
                     RECORD(lambda e, s: self._call("record", e, s)),
                     WAIT(lambda s, e, f: self._call("wait", s, e)),
                     WRITE(lambda s, a, v, f: self._call("write", s, a, v)))

    def _call(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        return self.rc[name]

    def addresses(self) -> list[int]:
        return [int(ctypes.cast(f, vp).value or 0) for f in self._fns]


@pytest.fixture
def launcher(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # a real build, in a cache of this test's own (not a fake: load() forgets what it loaded)
    monkeypatch.setenv("KVLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    mod = native.load()
    assert mod is not None, f"the C launcher did not build here: {native.why_not()}"
    return mod


def _form(table: Any, slots: Any, params: int, n: int, which: tuple[int, ...],
          at: int = 2, check: int = -1, board: tuple[int, ...] | None = None,
          status: int = -1) -> tuple[Any, ...]:
    """A lane's form (kvlink.gpu.lane.Lane._form); with a ``status`` value, the sequence
    number is the value after it, as a lane's is."""
    return (0xF00, ctypes.addressof(table), ctypes.addressof(slots), params, 7, 256, at, n,
            len(table), which, check, board, status, -1 if status < 0 else status + 1)


def _setup(launcher: Any) -> tuple[Any, Any, StandInDriver]:
    table = (ctypes.c_longlong * 16)()
    slots = (ctypes.c_longlong * 24)()
    drv = StandInDriver(table, slots)
    launcher.bind(*drv.addresses())
    return table, slots, drv


def test_a_post_writes_the_ids_and_slots_then_launches_and_marks_its_end(
        launcher: Any) -> None:
    """The launch, then the stream's write of the post's sequence number into its end word
    (``END_WORD`` words past its status word), where a poll reads it: no completion event
    recorded (until this stop the launcher recorded one, which every poll then queried)."""
    table, slots, drv = _setup(launcher)
    table[0], table[1] = 111, 222  # the lane's bases: not the post's to touch
    words = (ctypes.c_int64 * 8)()
    src = np.array([5, 9, 2], dtype=np.int64)
    dst = np.array([1, 0, 7], dtype=np.int64)
    form = _form(table, slots, 0xABC, 3, _PLAIN_SLOTS, status=1)
    at = ctypes.addressof(words)
    launcher.post(form, src, dst, 0x51, None, 0xE1, (3, at, 17, 4))
    assert [c[0] for c in drv.calls] == ["launch", "write"]
    _, fn, grid, threads, stream, params, ids, vals = drv.calls[0]
    assert (fn, grid, threads, stream, params) == (0xF00, 7, 256, 0x51, 0xABC)
    assert ids[:8] == [111, 222, 5, 9, 2, 1, 0, 7]
    assert [vals[i] for i in _PLAIN_SLOTS] == [3, at, 17, 4]
    assert drv.calls[1] == ("write", 0x51, at + 8 * END_WORD, 17)  # on the copy's stream


def test_a_push_post_signals_its_landing_after_the_copy_and_before_its_end(
        launcher: Any) -> None:
    """A push into a landing board through a lane (kvlink.landing): kv_signal is launched
    right after the copy, with the post's status word and sequence number (it moves the flag
    only where the copy refused nothing) and the flag, and before the end mark — a poll that
    sees the copy done may hand the status word back, so the signal must have read it by
    then. Until this stop a push never took a lane: it was planned and posted the general
    way, 0.6-0.8 ms of the prefill's host per push() on one H100 (bench/results/gpu_push_lane/)."""
    table, slots, drv = _setup(launcher)
    words = (ctypes.c_int64 * 8)()
    at = ctypes.addressof(words)
    one = np.array([3], dtype=np.int64)
    form = _form(table, slots, 0xABC, 1, _PLAIN_SLOTS, status=1)
    flag, expect, value = 0xF1A6, (5 << 40) | 7, (5 << 40) | 80
    launcher.post(form, one, one, 0x51, None, 0xE1, (1, at, 17, 4), (0x516, flag, expect, value))
    assert [c[0] for c in drv.calls] == ["launch", "launch", "write"]
    assert drv.calls[0][1] == 0xF00  # the copy first
    _, fn, grid, threads, stream, params, _, _ = drv.calls[1]
    assert (fn, grid, threads, stream) == (0x516, 1, 1, 0x51)
    args = (ctypes.c_void_p * 5).from_address(params)
    got = [ctypes.c_uint64.from_address(args[i]).value for i in range(5)]
    assert got == [at, 17, flag, expect, value]
    assert drv.calls[2] == ("write", 0x51, at + 8 * END_WORD, 17)
    drv.calls.clear()  # without a status word there is nothing to tell the signal: refused
    with pytest.raises(ValueError, match="status word"):
        launcher.post(_form(table, slots, 0xABC, 1, _PLAIN_SLOTS), one, one, 0x51, None, 0xE1,
                      (1, 0, 17, 4), (0x516, flag, expect, value))
    assert drv.calls == []  # before any driver call


def test_a_digest_post_writes_the_check_and_sample_and_keeps_the_generation(
        launcher: Any) -> None:
    """The hold's generation is the launcher's (the board's slot, sample's pick), not an
    argument of the kernel: written to no slot (-1 in the form) — nor before them, where
    an index of -1 written as given would land (a guard word here). Until c7c7120 the
    kernel took it in an argument it did not read."""
    guarded = (ctypes.c_longlong * 25)()
    guarded[0] = 0x5AFE
    table, slots, drv = _setup(launcher)
    slots = (ctypes.c_longlong * 24).from_address(ctypes.addressof(guarded) + 8)
    drv._slots = slots
    ids = [4, 3]
    words = (ctypes.c_uint64 * 3)(5, 6, 7)  # what the last copy's kernel left there
    at = ctypes.addressof(words)
    form = _form(table, slots, 1, 2, _DIGEST_SLOTS, check=_DIGEST_CHECK)
    gen = (1 << 62) + 3
    launcher.post(form, np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int64), 9, None,
                  1, (2, 0x70, 5, gen, at, True))
    vals = drv.calls[0][7]
    assert _DIGEST_SLOTS[_DIGEST_GENERATION] == -1
    written = [(i, v) for i, v in zip(_DIGEST_SLOTS, (2, 0x70, 5, gen, at, 1)) if i >= 0]
    assert [vals[i] for i, _ in written] == [v for _, v in written]
    assert gen not in vals and guarded[0] == 0x5AFE
    # the kernel's words as it starts from them: no mismatch, no rows compared, none missed
    assert list(words) == [2**64 - 1, 0, 0]


def test_a_digest_post_reads_where_its_hold_lies_from_the_board(launcher: Any) -> None:
    """The launcher reads the hold's slot on the producer's board (a real one: HoldBoard,
    mapped here by BoardView) and hands the kernel its offset and bytes; a generation the
    slot does not show gets bytes 0 (the kernel then compares nothing). The same as
    :func:`kvlink.gpu.lane.board_slot`, the ctypes launch's reader."""
    table, slots, _ = _setup(launcher)
    board = HoldBoard()
    view = BoardView.open(board.name, board.token)
    assert view is not None
    try:
        ids = np.array([4, 3], dtype=np.int64)
        assert board.publish(7, ids, b"\x01" * 96)
        host = view.region[0]
        spec = (host + 8 * LAYOUT.slot0, LAYOUT.mask, _DIGEST_GENERATION, _BOARD_AT, _BOARD_LEN,
                _DIGEST_PICK)
        form = _form(table, slots, 1, 2, _DIGEST_SLOTS, check=_DIGEST_CHECK, board=spec)
        digest = BoardDigest(1, 4096, 0, 0, 0, LAYOUT, host)
        at, nbytes = board_slot(digest, 7)
        assert nbytes == 96 and LAYOUT.lo <= at < LAYOUT.hi
        for gen, want in ((7, (at, 96)), (7 + LAYOUT.mask + 1, (0, 0)), (8, (0, 0))):
            launcher.post(form, ids, ids, 9, None, 1, (2, 0x70, 5, gen, 0, False))
            assert (slots[_BOARD_AT], slots[_BOARD_LEN]) == want, gen
            assert board_slot(digest, gen) == want
    finally:
        view.close()
        board.close()


def test_a_sample_post_orders_the_blocks_it_checks_first(launcher: Any) -> None:
    """``sample``: the launcher picks the blocks the producer picked (by the hold's generation,
    the last one always), writes their positions first after the ids, then the others, each
    in order, and the count into the pick slot — what :func:`kvlink.gpu.lane.sample_order`
    computes with kvlink.integrity.checked. ``full`` (pick 0) leaves both alone."""
    n = 300
    table = (ctypes.c_longlong * (2 + 3 * n))()
    slots = (ctypes.c_longlong * 24)()
    drv = StandInDriver(table, slots)
    launcher.bind(*drv.addresses())
    words = (ctypes.c_uint64 * (4 * (LAYOUT.mask + 1)))()
    spec = (ctypes.addressof(words), LAYOUT.mask, _DIGEST_GENERATION, _BOARD_AT, _BOARD_LEN,
            _DIGEST_PICK)
    form = _form(table, slots, 1, n, _DIGEST_SLOTS, check=_DIGEST_CHECK, board=spec)
    rids = np.random.default_rng(7).permutation(5000)[:n].astype(np.int64)
    lids = np.arange(n, dtype=np.int64)
    for gen in (3, 1001, (7 << 40) | 5, 2**63 - 1):
        launcher.post(form, rids, lids, 9, None, 1, (n, 0, 5, gen, 0, True))
        order, k = sample_order(rids, gen)
        assert slots[_DIGEST_PICK] == k and 1 <= k < n
        assert list(table[2 + 2 * n:2 + 3 * n]) == order.tolist()
        assert order[k - 1] == n - 1 or (n - 1) in order[:k]  # the last block is checked
    table[2 + 2 * n] = -5
    launcher.post(form, rids, lids, 9, None, 1, (n, 0, 5, 77, 0, False))
    assert slots[_DIGEST_PICK] == 0 and table[2 + 2 * n] == -5  # full: every block, in order


def test_a_form_naming_no_value_for_its_check_words_is_refused(launcher: Any) -> None:
    table, slots, drv = _setup(launcher)
    one = np.array([1], dtype=np.int64)
    with pytest.raises(ValueError, match="check words at value 6, status word at -1, "
                                         "sequence number at -1, of 6"):
        launcher.post(_form(table, slots, 1, 1, _DIGEST_SLOTS, check=6), one, one, 9, None,
                      1, (1, 0, 1, 3, 0, False))
    assert drv.calls == []


@pytest.mark.parametrize("pending", [False, True])
def test_the_copy_waits_for_the_callers_stream_only_where_it_has_work(
        launcher: Any, pending: bool) -> None:
    table, slots, drv = _setup(launcher)
    drv.rc["query"] = NOT_READY if pending else 0
    one = np.array([1], dtype=np.int64)
    form = _form(table, slots, 1, 1, _PLAIN_SLOTS)
    launcher.post(form, one, one, 0x51, 0x77, 0xE1, (1, 0, 1, 1))
    names = [c[0] for c in drv.calls]
    if pending:  # the order's event recorded on the caller's stream, waited on by ours, first
        assert names == ["query", "record", "wait", "launch"]
        assert drv.calls[1] == ("record", 0xE1, 0x77)
        assert drv.calls[2] == ("wait", 0x51, 0xE1)
    else:
        assert names == ["query", "launch"]
    drv.calls.clear()  # the caller's stream is ours: nothing to wait for
    launcher.post(form, one, one, 0x51, 0x51, 0xE1, (1, 0, 1, 1))
    assert [c[0] for c in drv.calls] == ["launch"]  # (no status word: no end to mark)
    drv.calls.clear()  # the legacy default stream is handle 0, and is waited for
    drv.rc["query"] = NOT_READY
    launcher.post(form, one, one, 0x51, 0, 0xE1, (1, 0, 1, 1))
    assert drv.calls[1] == ("record", 0xE1, None)  # (ctypes hands a null pointer as None)


@pytest.mark.parametrize("pending", [False, True])
def test_a_timed_post_records_its_start_right_before_the_kernel(launcher: Any,
                                                                 pending: bool) -> None:
    """A copy timed on the device: its start event is recorded on the copy's stream by the
    launcher, after the order's wait and right before the launch — so the copy's time is the
    kernel's (recorded before the launcher's call, it also held the host's steps up to the
    launch, and whatever else ran there). A driver that refuses that record leaves the copy
    untimed, not failed: it is still launched and its end marked, and the post says False."""
    table, slots, drv = _setup(launcher)
    drv.rc["query"] = NOT_READY if pending else 0
    one = np.array([1], dtype=np.int64)
    words = (ctypes.c_int64 * 8)()
    form = _form(table, slots, 1, 1, _PLAIN_SLOTS, status=1)
    values = (1, ctypes.addressof(words), 5, 1)
    assert launcher.post(form, one, one, 0x51, 0x77, 0xE1, values, None, 0x5A) is True
    names = [c[0] for c in drv.calls]
    order = ["query", "record", "wait"] if pending else ["query"]
    assert names == [*order, "record", "launch", "write"]
    assert drv.calls[len(order)] == ("record", 0x5A, 0x51)  # on the copy's stream
    drv.calls.clear()
    assert launcher.post(form, one, one, 0x51, 0x77, 0xE1, values) is False  # (untimed)
    assert "record" not in [c[0] for c in drv.calls][len(order):]
    drv.calls.clear()
    drv.rc["record"] = 999  # the driver refuses a record: the order's too, where it is made
    if not pending:
        assert launcher.post(form, one, one, 0x51, 0x77, 0xE1, values, None, 0x5A) is False
        assert [c[0] for c in drv.calls] == ["query", "record", "launch", "write"]


@pytest.mark.parametrize(("step", "made"), [
    ("query", ["query"]),
    ("wait", ["query", "record", "wait"]),
    ("launch", ["query", "record", "wait", "launch"]),
    ("write", ["query", "record", "wait", "launch", "write"]),
])
def test_a_refused_step_raises_naming_it_and_stops_there(launcher: Any, step: str,
                                                         made: list[str]) -> None:
    table, slots, drv = _setup(launcher)
    drv.rc["query"] = NOT_READY  # the caller's stream busy: the order's steps are made
    drv.rc[step] = 999
    one = np.array([1], dtype=np.int64)
    words = (ctypes.c_int64 * 8)()
    with pytest.raises(RuntimeError, match="CUDA error 999") as err:
        launcher.post(_form(table, slots, 1, 1, _PLAIN_SLOTS, status=1), one, one, 1, 2, 3,
                      (1, ctypes.addressof(words), 1, 1))
    assert [c[0] for c in drv.calls] == made  # no end marked for a copy not made
    assert ("cuLaunchKernel" in str(err.value)) == (step == "launch")
    assert ("marking the end" in str(err.value)) == (step == "write")


def test_the_post_clears_its_status_and_end_words_before_the_launch(launcher: Any) -> None:
    """The status word (where a refusing kernel stores the post's sequence number) and the
    end word (``END_WORD`` words on, where the stream writes it once the copy ended) are
    cleared by the launcher, before its launch: a word left from an earlier refused post
    would fail this copy, and an end left by an earlier post would end it before its
    kernel ran."""
    table, slots, drv = _setup(launcher)
    word = 10  # an argument slot no plain lane writes: the launch's record shows it as it was
    slots[word], slots[word + END_WORD] = 41, 7  # an earlier post's refusal, and its end
    status = ctypes.addressof(slots) + 8 * word
    one = np.array([1], dtype=np.int64)
    launcher.post(_form(table, slots, 1, 1, _PLAIN_SLOTS, status=1), one, one, 1, None, 3,
                  (1, status, 7, 1))
    assert [c[0] for c in drv.calls] == ["launch", "write"]
    assert drv.calls[0][7][word] == 0 and drv.calls[0][7][word + END_WORD] == 0
    assert slots[word] == 0 and slots[word + END_WORD] == 0  # (the stand-in wrote nothing)
    slots[word], slots[word + END_WORD] = 41, 7  # a form without a status word (-1) leaves
    launcher.post(_form(table, slots, 1, 1, _PLAIN_SLOTS), one, one, 1, None, 3,  # memory
                  (1, status, 7, 1))  # alone
    assert (slots[word], slots[word + END_WORD]) == (41, 7)
    with pytest.raises(ValueError, match="status word at 9"):
        launcher.post(_form(table, slots, 1, 1, _PLAIN_SLOTS, status=9), one, one, 1, None,
                      3, (1, status, 7, 1))
    form = (*_form(table, slots, 1, 1, _PLAIN_SLOTS, status=1)[:13], -1)
    with pytest.raises(ValueError, match="status word at 1, sequence number at -1"):
        launcher.post(form, one, one, 1, None, 3, (1, status, 7, 1))  # (an end needs both)


def test_lists_of_ints_are_taken_as_int64_arrays_are(launcher: Any) -> None:
    table, slots, drv = _setup(launcher)
    form = _form(table, slots, 1, 3, _PLAIN_SLOTS)
    launcher.post(form, [5, np.int64(9), 2**63 - 1], [1, 0, -7], 1, None, 3,
                  (3, 0, 1, 1))  # (a negative id: the kernel refuses it, naming it)
    assert drv.calls[0][6][2:8] == [5, 9, 2**63 - 1, 1, 0, -7]


def test_ids_that_are_not_int64_or_do_not_fit_are_refused_before_any_driver_call(
        launcher: Any) -> None:
    table, slots, drv = _setup(launcher)
    table[0], table[1] = 111, 222  # the lane's bases: never written by a post
    form = _form(table, slots, 1, 2, _PLAIN_SLOTS)
    good = np.array([1, 2], dtype=np.int64)
    for bad, err, why in ((np.array([1, 2], dtype=np.int32), ValueError, "source ids"),
                          (np.array([1, 2, 3], dtype=np.int64), ValueError, "source ids"),
                          (np.array([1.0, 2.0]), ValueError, "source ids"),
                          (np.array([[1], [2]], dtype=np.int64), ValueError, "source ids"),
                          ((1, 2), ValueError, "a list of ints or an int64 array"),
                          ([1, 2, 3], ValueError, "expected 2, got 3"),
                          ([1, 2.5], TypeError, "float"),
                          ([1, "2"], TypeError, "str"),
                          ([1, 2**64], OverflowError, "too large|too big")):
        with pytest.raises(err, match=why):
            launcher.post(form, bad, good, 1, None, 3, (2, 0, 1, 1))
    with pytest.raises(ValueError, match="destination ids"):
        launcher.post(form, good, good.astype(np.uint64), 1, None, 3, (2, 0, 1, 1))
    with pytest.raises(ValueError, match="do not fit"):  # 2 x 8 ids past a 16-word table
        launcher.post(_form(table, slots, 1, 8, _PLAIN_SLOTS, at=2), np.zeros(8, np.int64),
                      np.zeros(8, np.int64), 1, None, 3, (8, 0, 1, 1))
    assert drv.calls == [] and list(table[:2]) == [111, 222]


def test_an_unbuildable_launcher_falls_back_saying_why(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="kvlink.gpu"):
        assert native.load() is None
    assert "failed" in native.why_not() and "launch through ctypes" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-built file left to load later
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("KVLINK_NATIVE", "0")
    assert native.load() is None and native.why_not() == "KVLINK_NATIVE=0"


def test_the_c_fingerprint_is_numpys(launcher: Any) -> None:
    """kvlink.holdboard.fingerprint in C (the reader's READ path) and by numpy (where the
    helpers are not built) give one value for every form of the same ids, and tell orders,
    lengths and neighbours apart."""
    from kvlink.holdboard import fingerprint_numpy

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 256, 4097):
        ids = rng.integers(-2**63, 2**63 - 1, size=n, dtype=np.int64, endpoint=True)
        want = fingerprint_numpy(ids)
        assert launcher.fingerprint(ids) == want
        assert launcher.fingerprint(ids.tolist()) == want
        assert fingerprint_numpy(ids.astype(np.int32).astype(np.int64)) == launcher.fingerprint(
            ids.astype(np.int32).tolist())
    base = list(range(256))
    seen = {launcher.fingerprint(base), launcher.fingerprint(base[::-1]),
            launcher.fingerprint(base[:-1]), launcher.fingerprint([*base[:-1], 256]),
            launcher.fingerprint([*base, 0])}
    assert len(seen) == 5
    with pytest.raises(TypeError):
        launcher.fingerprint([1, 2.5])
    with pytest.raises(ValueError):
        launcher.fingerprint(np.arange(3, dtype=np.int32))


def test_fingerprint_takes_numpys_form_where_c_does_not_take_the_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An int32 array, a tuple, a 2-D array: numpy's form, the same value as their ids'."""
    from kvlink import holdboard

    want = holdboard.fingerprint_numpy([5, 1, 7, 3])
    for ids in (np.array([5, 1, 7, 3], np.int32), (5, 1, 7, 3), np.array([[5, 1], [7, 3]]),
                [5, 1, 7, 3], np.array([5, 1, 7, 3])):
        assert holdboard.fingerprint(ids) == want
    # not a fake: kvlink's own numpy path, taken where the helpers are not built
    monkeypatch.setattr(holdboard, "_c_helpers", None)
    assert holdboard.fingerprint([5, 1, 7, 3]) == want


def test_event_query_asks_the_bound_driver_function_and_hands_back_its_answer(
        launcher: Any) -> None:
    """A poll's completion query (kvlink.gpu.move.DriverEvents.query) through C: the event's
    handle reaches cuEventQuery as it is, and its CUresult comes back (0 done, 600 not
    ready, anything else an error the caller names) — with a stand-in for the driver's
    function, as for the launch."""
    asked: list[int] = []
    answer = [NOT_READY]

    def query(ev: int) -> int:
        asked.append(ev)
        return answer[0]

    fn = QUERY(query)
    launcher.bind_event_query(int(ctypes.cast(fn, vp).value or 0))
    assert launcher.event_query(0xE1) == NOT_READY
    answer[0] = 0
    assert launcher.event_query(0xE2) == 0
    answer[0] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the copy's fault, named by its caller
    assert launcher.event_query(0xE3) == 700
    assert asked == [0xE1, 0xE2, 0xE3]
    with pytest.raises(ValueError, match="null"):
        launcher.bind_event_query(0)


def test_a_lanes_end_is_read_with_its_status_and_check_words_in_one_call(
        launcher: Any) -> None:
    """A poll's look at a lane's copy (kvlink.gpu.copy.Pending.done through ``lane_end``):
    nothing while the end word does not show the post's sequence number; once it does, the
    status word's verdict (the device refused an extent: it shows the sequence number too)
    and, for a digest lane that refused nothing, its three check words as the kernel left
    them — the same words the ctypes reads took (kvlink.gpu.copy._Pinned's layout)."""
    words = np.zeros(END_WORD + 1, dtype=np.int64)
    at = int(words.ctypes.data)
    seq = 41
    words[1:4] = [7, 12, 0]  # first differing index, rows compared, none missed
    assert launcher.lane_end(at, seq, True) is None  # not ended: the end word shows 0
    words[END_WORD] = seq - 1  # an earlier post's end
    assert launcher.lane_end(at, seq, True) is None
    words[END_WORD] = seq
    assert launcher.lane_end(at, seq, True) == (False, 7, 12, 0)
    assert launcher.lane_end(at, seq, False) == (False, 0, 0, 0)  # a plain lane's
    words[1] = -1  # NO_MISMATCH, all ones: read as the unsigned word it is
    assert launcher.lane_end(at, seq, True) == (False, 2**64 - 1, 12, 0)
    words[0] = seq  # refused by the device: the check words say nothing then
    assert launcher.lane_end(at, seq, True) == (True, 0, 0, 0)
    with pytest.raises(ValueError, match="null"):
        launcher.lane_end(0, seq, True)


def test_the_c_bounds_check_is_numpys(launcher: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvlink.transport.RegionTable.locate and kvlink.grants.Window.covers through C
    (``inside``, both sides of every tcp READ) give numpy's answers: the same regions, the
    same first extent outside (starts before every range, in a gap, past the end, across two
    ranges, wrapping past 2**64, empty), for extents in order and shuffled."""
    from kvlink.grants import Window, merge
    from kvlink.transport import EXTENT_DTYPE, Region, RegionTable

    rng = np.random.default_rng(5)
    # regions of 1-3 pages, apart (a window merges neighbours; regions it keeps apart)
    starts = np.sort(rng.choice(np.arange(1, 4000, dtype=np.uint64), 40, replace=False)) * 16384
    table = RegionTable([Region(int(a), 4096 * int(rng.integers(1, 4))) for a in starts])
    window = Window(Op.READ, merge(table.starts, table.ends - table.starts))
    cases = []
    for _ in range(300):
        n = int(rng.integers(0, 20))
        at = rng.integers(0, len(table.regions), n)
        ext = np.zeros(n, dtype=EXTENT_DTYPE)
        ext["addr"] = table.starts[at] + rng.integers(0, 4096, n).astype(np.uint64)
        ext["len"] = rng.integers(0, 4096, n).astype(np.uint64)
        if n and rng.random() < 0.5:  # one extent somewhere else
            k = int(rng.integers(0, n))
            ext[k] = [(0, 8), (int(table.ends[-1]), 1), (int(table.ends[-1]) - 8, 16),
                      (int(table.ends[3]) - 8, 4096 * 3),
                      (int(table.starts[3]) + 8, 2**64 - 16)][int(rng.integers(0, 5))]
        cases.append(ext)
    for ext in cases:
        idx, bad = table._locate_numpy(ext) if len(ext) else (np.empty(0, np.intp), -1)
        out = np.empty(len(ext), dtype=np.intp)
        assert launcher.inside(table.starts, table.ends, ext, out) == bad
        if bad < 0:
            assert np.array_equal(out, idx)
            assert np.array_equal(table.locate(ext), idx)
        else:
            with pytest.raises(ExtentOutOfBounds, match=f"extent {bad} "):
                table.locate(ext)
        assert window.covers(ext) == (bad < 0) == (launcher.inside(window.starts, window.ends,
                                                                   ext, None) < 0)
    monkeypatch.setattr(native, "_loaded", {"launch": None})  # numpy's path, where not built
    for ext in cases:
        assert window.covers(ext) == (len(ext) == 0 or table._locate_numpy(ext)[1] < 0)
