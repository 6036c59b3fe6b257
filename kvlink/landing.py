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

With integrity on (:mod:`kvlink.integrity`) a slot also gets a **digest area**: pages of the
board's arena where the prefill puts the digests of what it pushes — each layer range's before
that range's WRITE is posted (on a GPU, copied there on the caller's stream ahead of the WRITE,
which waits for it) — so that when the flag shows every layer the digests are there too, and
the decode checks what landed then, without the "written" note that carries the same digests
(:class:`DigestArea`; the note still follows, for a decode that could not use them). An area
too small for the prefill's digests is left empty: that push ends by its note.
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
from kvlink.arena import PageArena
from kvlink.errors import KVLinkError
from kvlink.gpu import ipc
from kvlink.holdboard import Offer

log = logging.getLogger("kvlink.landing")

SLOTS = 4095  # with the header, 64 pages exactly (CUDA page-locks whole pages)
_LAYER_BITS = 16  # low bits of a flag: the layers landed; above them the push's tag
_HEADER = 64  # magic (8), slots (8), token (16), reserved
_WORDS = 8  # per slot: flag, tag, generation, fingerprint, hold board name (2), token (2)
PAGE = 4096
_ARENA = _HEADER + 8 * _WORDS * SLOTS  # the digest areas' first byte (page 64)
#: 32 MiB (tmpfs: only pages written take memory): e.g. 100 pushes of a 70B TP8 rank's
#: 4096-token request at `full`, 30 of an 8B TP1 request's
ARENA_PAGES = 1 << 13
#: magic "kvlinkL2" (L1: no digest areas)
KIND = shmfile.Kind("kvlink-landing-", 0x6B766C696E6B4C32, SLOTS, _ARENA + PAGE * ARENA_PAGES)
#: a digest area's header, in words: the push's tag (written last), digested blocks k,
#: layers, planes, heads, reserved (3); then the k block ids (the decode's), then the
#: digests plane by plane — [layers x planes][k][heads] — so a layer range's are one piece
AREA_HEAD = 8
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
        self._slots = _words(self._map)[_HEADER // 8:_ARENA // 8].reshape(SLOTS, _WORDS)
        #: the flags, read by plain indexing: a poll reads one per awaited rank, and a numpy
        #: scalar read costs a microsecond and more on a busy host (the exposed time of a
        #: layer-wise push is counted in them)
        self._flags = memoryview(self._map).cast("Q")
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, -1, -1))
        self._arena = PageArena(ARENA_PAGES)
        self._areas: dict[int, tuple[int, int]] = {}  # slot -> its digest area's pages

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

    def take_area(self, slot: int, nbytes: int) -> tuple[int, int] | None:
        """A digest area of at least ``nbytes`` for ``slot`` (taken), its tag cleared: (byte
        offset in the board, bytes), or None when the arena has no run of pages that long
        (that push ends by its note)."""
        need = -(-nbytes // PAGE)
        with self._lock:
            if self._path is None or slot in self._areas:
                return None
            first = self._arena.take(need)
            if first < 0:
                return None
            self._areas[slot] = (first, need)
        at = _ARENA + first * PAGE
        _words(self._map)[at // 8] = 0  # its tag: no digests yet
        return at, need * PAGE

    def give(self, slot: int) -> None:
        """Its push ended and nothing of it can land any more (its digest area too)."""
        with self._lock:
            if self._path is not None:
                self._slots[slot, :2] = 0
                self._free.append(slot)
                area = self._areas.pop(slot, None)
                if area is not None:
                    self._arena.give(*area)

    def digests(self, slot: int, tag: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The digests the prefill put in ``slot``'s area for the push tagged ``tag``: (the
        decode's block ids ``[k]``, copied out; the digests as the area keeps them, plane by
        plane: ``[layers x planes, k, heads]``, a view of the board — the decode's check stages
        them for its kernel in that order, no transpose on the poll that ends the push); None
        where it put none (another tag, a header that does not fit the area). Read once the
        flag shows every layer: each range's digests were there before its WRITE moved it,
        and the area is ours until the slot is given back."""
        area = self._areas.get(slot)
        if area is None or self._path is None:
            return None
        at = _ARENA + area[0] * PAGE
        words = _words(self._map)[at // 8:at // 8 + area[1] * PAGE // 8]
        got = _area_shape(words)
        if got is None or int(words[0]) != tag:
            return None
        k, layers, planes, heads = got
        ids = words[AREA_HEAD:AREA_HEAD + k].view(np.int64).copy()
        d = words[AREA_HEAD + k:AREA_HEAD + k + k * layers * planes * heads]
        return ids, d.reshape(layers * planes, k, heads)

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
            self._areas.clear()
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


def _area_shape(words: np.ndarray) -> tuple[int, int, int, int] | None:
    """(k, layers, planes, heads) of an area's header, or None where they do not fit it."""
    k, layers, planes, heads = (int(x) for x in words[1:5])
    if min(k, layers, planes, heads) < 1 or layers >= 1 << _LAYER_BITS:
        return None
    if AREA_HEAD + k + k * layers * planes * heads > words.shape[0]:
        return None
    return k, layers, planes, heads


class DigestArea:
    """The prefill's side of a digest area (see the module docstring): its header written
    at the push's start by :meth:`open`, then each layer range's digests into the place
    :meth:`open` returned, ahead of that range's WRITE."""

    def __init__(self, view: LandingView, at: int, nbytes: int) -> None:
        self._words = _words(view._map)[at // 8:(at + nbytes) // 8]

    def open(self, tag: int, ids: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
        """Write the header for the push tagged ``tag``, digesting the decode's blocks
        ``ids`` over ``shape``, (layers, planes, heads): the digests' place, ``[layers x
        planes, k, heads]`` words, or None where they do not fit (the area is left without a
        tag: the push ends by its note)."""
        layers, planes, heads = (int(x) for x in shape)
        k = int(ids.shape[0])
        w = self._words
        if not k or AREA_HEAD + k + k * layers * planes * heads > w.shape[0]:
            return None
        w[0] = 0
        w[1:5] = (k, layers, planes, heads)
        w[5:AREA_HEAD] = 0
        w[AREA_HEAD:AREA_HEAD + k] = ids.astype(np.int64).view(np.uint64)
        w[0] = np.uint64(tag)  # last: a decode that reads the tag reads the rest
        d = w[AREA_HEAD + k:AREA_HEAD + k + k * layers * planes * heads]
        return d.reshape(layers * planes, k, heads)


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
        self._slots = words[_HEADER // 8:_ARENA // 8].reshape(SLOTS, _WORDS)
        self.base = int(words.ctypes.data)
        self.nbytes = KIND.size
        self._lock = threading.Lock()
        self._pinned: int | None = None  # the device's pointer once registered (0: failed)

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

    def area(self, at: int, nbytes: int) -> DigestArea | None:
        """The digest area a push request offered (``at``, ``nbytes``), or None where it does
        not lie in the board's arena."""
        if at < _ARENA or at % PAGE or nbytes <= 0 or at + nbytes > KIND.size:
            return None
        return DigestArea(self, at, nbytes)

    def pin(self) -> bool:
        """Page-lock the board for the GPU (once): a push's digests are copied into its area
        on the caller's stream, and a copy into memory that is not page-locked waits for the
        stream on the host — a layer-wise prefill's forward loop with it. False where it
        cannot be (its pushes end by note)."""
        if self._pinned is None:
            try:
                self._pinned = ipc.host_register(self.base, self.nbytes)
            except KVLinkError as exc:
                log.warning("landing board %s not page-locked (%s): integrity pushes to it "
                            "end by note", self.name, exc)
                self._pinned = 0
        return bool(self._pinned)

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
        if self._pinned:
            from kvlink.errors import KVLinkError
            from kvlink.gpu import ipc

            try:
                ipc.host_unregister(self.base)
            except KVLinkError as exc:
                log.warning("landing board %s: %s", self.name, exc)
        self._pinned = None
        self._slots = np.zeros((0, _WORDS), dtype=np.uint64)
        shmfile.unmap(self._map)
