"""The landing board: a decode's awaited pushes in shared memory, so that a same-host prefill's
transfer itself says "landed" — no message on the critical path.

A push ends, without the board, with the prefill's poll seeing its last WRITE DONE, its lease
check, and a "written" note over the side channel that the decode's poll reads: 0.5-1 ms on one
H200 after a copy of microseconds (the layer-wise push's whole exposed time). With it:

- the decode **takes a slot** per prefill rank it asks (``PushRequest.landing``: the board's
  name, token and the slot), cleared;
- the prefill, at the push's start, **writes its hold** into the slot from the host: the push's
  tag, the generation and block fingerprint of the hold the push writes from, and where its
  hold board is (:mod:`kvlink.holdboard`) — ``NO_LEASE`` when it pushes without a lease;
- each WRITE of the push is posted with a **signal**: once its bytes have landed, the
  transport moves the slot's flag from ``value(tag, start)`` to ``value(tag, stop)`` — a
  compare-and-set, so a range that never moved (failed at its post) stops the chain there and
  no later range can claim the layers after it. cuda_ipc does it on the device (a one-thread
  kernel after the copy, on the same stream, skipped when the copy refused an extent), tcp on
  its peer thread once the owner acknowledged the bytes;
- the decode's poll sees the flag at ``value(tag, num_layers)`` and the prefill's hold still
  shown on its hold board (so it was held for every WRITE: validate after write, answered from
  shared memory as a same-host READ's is) and counts that rank written. Anything else — a
  flag stuck below every layer (a copy refused an extent, a range never posted), another tag,
  no hold board, a hold no longer shown — leaves the push to the
  prefill's "written" note, as without the board.

A slot is given back only when its push ended and no byte of it can still land (the push's own
cancel/quiescence rules), so a stale signal cannot move another push's flag; the tag (from the
push id) makes that a second line. Same-host only: the prefill opens the board by name in
``/dev/shm``; 0o600, so only the same user can.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np

from kvlink import holdboard, shmfile
from kvlink.holdboard import Offer

log = logging.getLogger("kvlink.landing")

SLOTS = 4095  # with the header, 64 pages exactly (CUDA page-locks whole pages)
_LAYER_BITS = 16  # low bits of a flag: the layers landed; above them the push's tag
_HEADER = 64  # magic (8), slots (8), token (16), reserved
_WORDS = 8  # per slot: flag, tag, generation, fingerprint, hold board name (2), token (2)
KIND = shmfile.Kind("kvlink-landing-", 0x6B766C696E6B4C31, SLOTS,  # magic "kvlinkL1"
                    _HEADER + 8 * _WORDS * SLOTS)
_BOARD_PREFIX = holdboard.KIND.prefix


def tag_of(push_id: int) -> int:
    """The 47-bit, never-zero tag a push's flag values carry."""
    return int(push_id) % ((1 << 47) - 1) + 1


def value(tag: int, layers: int) -> int:
    """The flag of a push whose first ``layers`` layers have landed."""
    return (int(tag) << _LAYER_BITS) | int(layers)


#: the generation a push without a lease writes (nothing to check): not 0, so that a slot read
#: half-written (zeros where the hold goes, on a host that reorders stores) checks a hold that
#: is not there and falls back to the note, never to "nothing to check"
NO_LEASE = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Hold:
    """What the prefill wrote into a slot about the hold it pushes from."""

    generation: int  # NO_LEASE: pushed without a lease (nothing to check)
    fingerprint: int
    board: Offer | None  # its hold board


@dataclasses.dataclass(frozen=True)
class Signal:
    """One WRITE's signal: once its bytes landed, move the flag at ``offset`` of the mapping
    ``(base, nbytes)`` from ``expect`` to ``value`` (:meth:`apply` where the host does it)."""

    view: LandingView
    offset: int
    expect: int
    value: int

    @property
    def region(self) -> tuple[int, int]:
        return self.view.base, self.view.nbytes

    def apply(self) -> bool:
        """The compare-and-set, from the host (one writer per slot: the pushing rank's
        transport, in post order). True when the flag moved."""
        return self.view.swap(self.offset, self.expect, self.value)


def _words(buf: mmap.mmap) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint64)


class LandingBoard:
    """The decode's side: one board per worker, slots taken per awaited push and rank."""

    def __init__(self) -> None:
        made = shmfile.make(KIND)
        # the fd (and its flock) stays open until close(): a board left by a killed decode is
        # swept by the next process that makes one (shmfile.sweep)
        self.name, self.token, self._map, self._fd = made.name, made.token, made.map, made.fd
        self._path: str | None = made.path
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))
        self._slots = _words(self._map)[_HEADER // 8:].reshape(SLOTS, _WORDS)
        #: the flags, read by plain indexing: a poll reads one per awaited rank, and a numpy
        #: scalar read costs a microsecond and more on a busy host (the exposed time of a
        #: layer-wise push is counted in them)
        self._flags = memoryview(self._map).cast("Q")
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, -1, -1))

    @classmethod
    def create(cls) -> LandingBoard | None:
        """A new board, or None where shared memory is not available (pushes end by note)."""
        try:
            return cls()
        except OSError as exc:
            log.info("no landing board (%s): pushes end by their 'written' note", exc)
            return None

    def offer(self) -> Offer:
        return Offer(self.name, self.token)

    def take(self) -> int | None:
        """A cleared slot, or None when all are taken (that push ends by note)."""
        with self._lock:
            if not self._free or self._path is None:
                return None
            slot = self._free.pop()
        self._slots[slot] = 0
        return slot

    def give(self, slot: int) -> None:
        """Its push ended and nothing of it can land any more."""
        with self._lock:
            if self._path is not None:
                self._slots[slot, :2] = 0
                self._free.append(slot)

    def landed(self, slot: int, tag: int) -> int:
        """Layers the flag says landed for the push tagged ``tag`` (0: none, or not ours)."""
        flag = self._flags[_HEADER // 8 + _WORDS * slot]
        if flag >> _LAYER_BITS != tag:
            return 0
        return flag & ((1 << _LAYER_BITS) - 1)

    def end_check(self, slot: int, tag: int, layers: int,
                  read: Callable[[], tuple[int, ...]] | None,
                  held: tuple[int, int]) -> EndCheck:
        """The check :class:`EndCheck` makes of ``slot`` for the push tagged ``tag``: every
        one of ``layers`` landed, and ``read()`` (the prefill's hold, where it lies) still
        ``held``; ``read`` None: nothing to check (pushed without a lease)."""
        return EndCheck(self._flags, _HEADER // 8 + _WORDS * slot, value(tag, layers), read,
                        held)

    def hold(self, slot: int, tag: int) -> Hold | None:
        """The hold the prefill wrote for the push tagged ``tag``, or None (not written)."""
        row = self._slots[slot].copy()  # one read of the slot; the tag was stored last
        if int(row[1]) != tag:
            return None
        raw = row[4:8].tobytes()
        name = _BOARD_PREFIX + raw[:16].hex()
        board = Offer(name, raw[16:]) if any(raw) else None
        return Hold(int(row[2]), int(row[3]), board)

    def close(self) -> None:
        with self._lock:
            if self._path is None:
                return
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None
            self._slots = np.zeros((0, _WORDS), dtype=np.uint64)
            self._flags.release()
            self._flags = memoryview(b"").cast("Q")
            shmfile.unmap(self._map)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class EndCheck:
    """Whether one prefill rank wrote every layer of a push from a hold still shown, bound
    when its hold is first read: the poll that ends the push reads the flag and the hold
    where they lie and calls nothing else. Every call on that poll is cold (the push's start
    was a forward ago): on one H200 the flag, the hold board's view and the bookkeeping made
    the poll that ends a layer-wise push 40 us, the whole of its exposed time."""

    __slots__ = ("_final", "_flags", "_held", "_index", "_read")

    def __init__(self, flags: memoryview, index: int, final: int,
                 read: Callable[[], tuple[int, ...]] | None, held: tuple[int, int]) -> None:
        self._flags, self._index, self._final = flags, index, final
        self._read, self._held = read, held

    def written(self) -> bool | None:
        """True: every layer landed (the flag, set once its bytes were there) and the hold is
        still shown, so it was held for every WRITE; False: not (yet); None: a board was
        closed under us (bind a new check)."""
        try:
            if self._flags[self._index] != self._final:
                return False
            return self._read is None or self._read() == self._held
        except ValueError:  # a released view or a closed mapping
            return None


def _forget_in_child(ref: weakref.ref[LandingBoard]) -> None:
    """After fork, in the child: our copy of the board's fd would keep its lock after the
    parent dies (and the board unswept); the parent's board is not the child's to unlink."""
    board = ref()
    if board is not None and board._fd >= 0:
        os.close(board._fd)
        board._fd = -1
        board._path = None


class LandingView:
    """The prefill's side: a read-write mapping of a same-host decode's board."""

    def __init__(self, name: str, view: mmap.mmap) -> None:
        self.name, self._map = name, view
        words = _words(view)
        self._slots = words[_HEADER // 8:].reshape(SLOTS, _WORDS)
        self.base = int(words.ctypes.data)
        self.nbytes = KIND.size
        self._lock = threading.Lock()

    @classmethod
    def open(cls, name: str, token: bytes) -> LandingView | None:
        """The board a push request offered, or None (logged) when it is not ours to write:
        not on this host's /dev/shm, not a board, another token."""
        opened = shmfile.open_board(KIND, name, token, writable=True,
                                    what="landing board (its pushes end by note)")
        if opened is None:
            return None
        fd, view = opened
        os.close(fd)  # the mapping is what we use
        return cls(name, view)

    def start(self, slot: int, tag: int, hold: Hold) -> None:
        """At the push's start, before any of its WRITEs: the hold it writes from, then the
        flag at "no layer landed", then the tag (last: the decode reads it first)."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"landing slot {slot} outside [0, {SLOTS})")
        row = self._slots[slot]
        raw = bytearray(32)
        if hold.board is not None and hold.board.name.startswith(_BOARD_PREFIX):
            raw[:16] = bytes.fromhex(hold.board.name[len(_BOARD_PREFIX):])
            raw[16:] = hold.board.token
        row[2] = np.uint64(hold.generation)
        row[3] = np.uint64(hold.fingerprint)
        row[4:8] = np.frombuffer(bytes(raw), dtype=np.uint64)
        row[0] = np.uint64(value(tag, 0))
        row[1] = np.uint64(tag)

    @staticmethod
    def offset(slot: int) -> int:
        """Byte offset of ``slot``'s flag in the mapping."""
        return _HEADER + 8 * _WORDS * slot

    def signal(self, slot: int, tag: int, start: int, stop: int) -> Signal:
        """The signal of a WRITE of layers ``[start, stop)`` of the push tagged ``tag``."""
        return Signal(self, self.offset(slot), value(tag, start), value(tag, stop))

    def swap(self, offset: int, expect: int, new: int) -> bool:
        slot = (offset - _HEADER) // (8 * _WORDS)
        with self._lock:
            if int(self._slots[slot, 0]) != expect:
                return False
            self._slots[slot, 0] = np.uint64(new)
            return True

    def close(self) -> None:
        self._slots = np.zeros((0, _WORDS), dtype=np.uint64)
        shmfile.unmap(self._map)
