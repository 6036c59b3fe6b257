"""The hold board: a producer's live holds in shared memory, so a same-host reader validates
its READ without asking.

Validate-after-read (:mod:`kvlink.leases`) makes a READ's bytes count only once the producer
confirms the hold was intact for the whole READ: a round trip through the producer's side
channel thread after every READ. On one H200 that round trip was 0.5 ms of a 1.3 ms request
(160 MiB that copy in 0.09 ms), and in a serving prefill it waits for the GIL of a process busy
launching kernels. For a reader on the producer's host the same question has a lock-free
answer, a seqlock over shared memory:

- the producer **publishes** a hold's generation (with a fingerprint of its block ids) in a
  slot of a small file in ``/dev/shm`` right after the hold exists, and **withdraws** it before
  the release can be seen by whoever reuses the blocks (:class:`BlockLeases`' ``on_release``);
- once its READ completed, the reader checks the slot still shows its generation and the
  fingerprint of the block ids it read. That is :meth:`BlockLeases.validate_read`'s question,
  answered the same way: a generation is minted where the blocks are reserved, before any
  reader knows it, and a hold never comes back once withdrawn (generations are random and
  never held twice), so "shown now" means "held for the whole READ" — the producer's own
  answer, read without its CPU.

A dead producer cannot withdraw: it holds an exclusive ``flock`` on the board for as long as it
lives (the kernel drops it at exit, however the process ends), and the after-check first checks
that lock is still held. Where kvlink's C helpers build, the board's header also has an alive
word the kernel itself marks when the producer dies (:class:`_Sentinel`: a robust futex of a
thread that only waits), so the after-check reads a word where it made a system call: the
whole check cold 9.1 us against 12.8 by the flock on one H200 host
(bench/results/gpu_checks_alive_word/cold_calls.json). A word that does not show a live
sentinel (none, a closed board, an older producer) is settled by the flock, as before.

Anything the board cannot answer — another host, a slot taken by another hold (:data:`SLOTS`
slots, chosen by the generation's low bits), a subset of the held blocks, a board that cannot
be opened — falls back to the round trip, never to "intact".
The reader still reports its READ (without waiting for the answer, with a later poll) so the
producer counts it done and releases.

With integrity on (:mod:`kvlink.integrity`) the producer also publishes the hold's digests, in
the board's arena (pages after the slots, handed out per hold and given back at withdrawal), so
the reader's check of what landed needs no verdict either. The arena's bytes are written before
the slot names them and freed only after the generation is cleared: a reader that sees the
generation before and after copying them out copied what that hold published. A hold whose
digests do not fit (arena full) is published without them, and its readers ask.

Memory order: 8-byte aligned loads and stores are single accesses on the hosts CUDA runs on
(x86-64, arm64); the producer stores the fingerprint before the generation and clears the
generation first; the reader loads the generation before the fingerprint, after it saw its
READ complete (a driver call) and the producer's lock (a syscall). Where the hardware may
reorder the two stores of a publish (arm64), a reader can only see a generation with a stale
fingerprint — a mismatch, so it asks. A withdrawal precedes the blocks' reuse by the lease
table's lock release and the caller's own work, so it is seen first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import functools
import logging
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvlink import shmfile
from kvlink.arena import PageArena
from kvlink.sampling import mix

log = logging.getLogger("kvlink.holdboard")

SLOTS = 1 << 16  # power of two: a generation's low bits pick its slot
_HEADER = 64  # magic (8), slots (8), token (16), the alive word (4), reserved
#: the header's alive word: the sentinel thread's id while it lives, FUTEX_OWNER_DIED once the
#: kernel saw it end (kvlink.native's ``sentinel_arm``; ``_native.c``'s ALIVE_AT)
ALIVE_AT = 32
_TID_MASK, _OWNER_DIED = 0x3FFFFFFF, 0x40000000  # linux/futex.h
_ALIVE = struct.Struct("<I")


def _shows_live(word: int) -> bool:
    """Whether an alive word shows a thread id the kernel has not marked dead."""
    return bool(word & _TID_MASK) and not word & _OWNER_DIED
_WORDS = 4  # per slot: generation, fingerprint, digests' arena offset, their length
PAGE = 4096  # the arena's unit: a hold's digests take whole pages
ARENA_PAGES = 1 << 14  # 64 MiB (tmpfs: only pages written take memory), e.g. 200 holds of
#                        a 70B TP8-rank 4096-token request's full digests
_ARENA = _HEADER + 8 * _WORDS * SLOTS  # the arena's first byte (past the slots)
#: magic "kvlinkB2" (B1: slots without digests)
# (B3: fingerprints by kvlink.native's sum of mixes; a B2 board's were blake2b: not opened)
KIND = shmfile.Kind("kvlink-board-", 0x6B766C696E6B4233, SLOTS, _ARENA + PAGE * ARENA_PAGES)
TOKEN_BYTES = shmfile.TOKEN_BYTES


_FP_SEED = np.uint64(0x6B766C696E6B6670)  # "kvlinkfp"
_UNSET: Any = object()
_c_helpers: Any = _UNSET  # kvlink.native's module, once looked up (None: not built)


def _helpers() -> Any:
    """kvlink.native's built module or None, looked up once: both its uses here are on a
    READ's path, where native.load()'s lock and lookup would be a step more each."""
    global _c_helpers
    if _c_helpers is _UNSET:
        from kvlink import native

        _c_helpers = native.load()
    return _c_helpers


def fingerprint(block_ids: npt.ArrayLike) -> int:
    """64 bits naming an exact list of block ids (in order): the sum over positions ``i``
    of ``mix(id_i ^ mix(i ^ SEED))`` modulo 2**64, mixed with the count (``mix``:
    splitmix64's finaliser). Not a cryptographic hash: it tells a reader's id list from the
    hold's, which a same-host reader could read anyway. Computed in C where kvlink's helpers
    build (kvlink.native: one call, where numpy's steps and blake2b cost 26 us of a READ's
    path cold on one H200 host), else by numpy, to the same value."""
    helpers = _helpers()
    if helpers is not None:
        try:
            return int(helpers.fingerprint(block_ids))
        except (TypeError, ValueError, OverflowError):  # not a list or int64: numpy's below
            pass
    return fingerprint_numpy(block_ids)


def fingerprint_numpy(block_ids: npt.ArrayLike) -> int:
    """:func:`fingerprint` by numpy (where the C helpers are not built; and their check)."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    n = ids.shape[0]
    pos = mix(np.arange(n, dtype=np.uint64) ^ _FP_SEED)
    h = mix(ids.view(np.uint64) ^ pos).sum(dtype=np.uint64)
    return int(mix(np.array([h ^ np.uint64(n)], dtype=np.uint64))[0])




@dataclasses.dataclass(frozen=True)
class Offer:
    """What a same-host reader needs to open the board (sent in the handshake answer)."""

    name: str
    token: bytes


class HoldBoard:
    """The producer's side: one board per worker process, published and withdrawn under
    :class:`~kvlink.leases.BlockLeases`' lock."""

    def __init__(self) -> None:
        made = shmfile.make(KIND)  # its flock is held for as long as we live: readers'
        # liveness check
        self.name, self.token, self._map = made.name, made.token, made.map
        self._fd, self._path = made.fd, made.path
        self._slots = _slots(self._map)
        _fault_in(self._map, write=True)  # (before the sentinel thread writes the header)
        self._arena = PageArena(ARENA_PAGES)  # pages given to live holds' digests
        self._pages: dict[int, tuple[int, int]] = {}  # generation -> its (first page, count)
        self._lock = threading.Lock()
        helpers = _helpers()
        self._sentinel = (_Sentinel(helpers, self._map)
                          if helpers is not None and _kernel_marks_dead_owners(helpers)
                          else None)
        self.published = 0
        self.collisions = 0  # holds whose slot another live hold had: readers ask instead
        self.arena_full = 0  # holds published without their digests: readers ask for them
        # a forked child must not keep our lock alive after we die (fork copies the fd)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    @classmethod
    def create(cls) -> HoldBoard | None:
        """A new board, or None where shared memory is not available (readers then ask)."""
        try:
            return cls()
        except OSError as exc:
            log.info("no hold board (%s): same-host readers validate by asking", exc)
            return None

    def offer(self) -> Offer:
        return Offer(self.name, self.token)

    def publish(self, generation: int, block_ids: npt.ArrayLike,
                digests: bytes = b"") -> bool:
        """Show ``generation`` as held over ``block_ids``, with its ``digests`` (an opaque
        blob, :func:`kvlink.integrity.pack`) where they fit; False if its slot is taken."""
        fp = np.uint64(fingerprint(block_ids))
        with self._lock:
            if self._fd < 0:
                return False
            slot = self._slots[generation & (SLOTS - 1)]
            if int(slot[0]) != 0:
                self.collisions += 1
                return False
            at = self._place(generation, digests) if digests else None
            if digests and at is None:
                self.arena_full += 1
            slot[2] = np.uint64(at if at is not None else 0)
            slot[3] = np.uint64(len(digests) if at is not None else 0)
            slot[1] = fp
            slot[0] = np.uint64(generation)  # last: a reader that sees it sees the rest
            self.published += 1
            return True

    def _place(self, generation: int, blob: bytes) -> int | None:
        """Write ``blob`` into free arena pages (kvlink.arena: the next ones, else the first
        free run after them) — its byte offset in the file, or None when no run of free pages
        is long enough anywhere (the hold is then shown without its digests)."""
        need = -(-len(blob) // PAGE)
        first = self._arena.take(need)
        if first < 0:
            return None
        self._pages[generation] = (first, need)
        at = _ARENA + first * PAGE
        self._map[at:at + len(blob)] = blob
        return at

    def withdraw(self, generation: int) -> None:
        """``generation``'s hold ended: clear its slot (if it is ours), then give its digests'
        pages back (a reader's second look at the generation then fails first)."""
        with self._lock:
            if self._fd < 0:
                return
            slot = self._slots[generation & (SLOTS - 1)]
            if int(slot[0]) == generation:
                slot[0] = 0
                slot[1:] = 0
            pages = self._pages.pop(generation, None)
            if pages is not None:
                self._arena.give(*pages)

    def close(self) -> None:
        """Unlink and drop the lock: readers' after-checks fail from here on."""
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._slots = np.zeros((0, _WORDS), dtype=np.uint64)
            _ALIVE.pack_into(self._map, ALIVE_AT, 0)  # readers trust the word no more
            if self._sentinel is None or self._sentinel.stop():
                shmfile.unmap(self._map)
            # (else its thread did not let the word go: the mapping stays, lest the kernel
            # write into whatever is mapped there next when that thread ends)
            os.close(self._fd)  # releases the flock
            self._fd = -1


class _Sentinel:
    """The board's sentinel: a thread that arms the alive word (kvlink.native's
    ``sentinel_arm``: the word is its robust futex, which the kernel marks FUTEX_OWNER_DIED
    when the thread ends — with the process, however it is killed — before the process's
    files and GPU memory are let go) and then only waits, until :meth:`stop` disarms it
    before the mapping goes. A thread of its own: a robust futex belongs to the thread that
    took it, and the caller's (a serving loop's, a pool's) may end before the process does.
    Where arming fails, the word stays 0 and readers use the flock."""

    def __init__(self, helpers: Any, view: mmap.mmap) -> None:
        self._stop = threading.Event()
        armed = threading.Event()
        self.tid = 0
        self._thread = threading.Thread(target=self._run, args=(helpers, view, armed),
                                        name="kvlink-board-sentinel", daemon=True)
        self._thread.start()
        armed.wait(5.0)

    def _run(self, helpers: Any, view: mmap.mmap, armed: threading.Event) -> None:
        try:
            self.tid = int(helpers.sentinel_arm(view))
        except (OSError, ValueError) as exc:
            log.info("hold board: no alive word (%s); readers check its flock", exc)
            return
        finally:
            armed.set()
            del view  # (the board's close unmaps it)
        self._stop.wait()
        helpers.sentinel_disarm()

    def stop(self) -> bool:
        """Disarm and end the thread; False if it did not end in time (then the word's
        mapping must stay: the kernel reads it when the thread ends)."""
        self._stop.set()
        self._thread.join(5.0)
        if self._thread.is_alive():
            log.warning("hold board: its sentinel thread did not end; keeping its mapping")
            return False
        return True


@functools.cache
def _kernel_marks_dead_owners(helpers: Any) -> bool:
    """Whether this kernel marks a robust futex whose owner thread ended (what the alive
    word rests on: a kernel or sandbox that did not would leave a dead producer's word
    showing it alive). Tried once a process: a thread arms a word of a scratch mapping and
    ends without disarming it; the kernel must mark the word FUTEX_OWNER_DIED as the thread
    exits — looked for until a second after the thread is joined (a join returns before the
    OS thread has quite exited). Where it does not, boards get no sentinel (readers check
    the flock)."""
    scratch = mmap.mmap(-1, ALIVE_AT + 8)
    prober = threading.Thread(target=_arm_and_end, args=(helpers, scratch),
                              name="kvlink-robust-probe", daemon=True)
    prober.start()
    prober.join(5.0)
    if prober.is_alive():  # (its word stays mapped: the kernel reads it when it ends)
        return False
    word = _ALIVE.unpack_from(scratch, ALIVE_AT)[0]
    deadline = time.monotonic() + 1.0
    while _shows_live(word) and time.monotonic() < deadline:
        time.sleep(0.001)  # armed, the thread on its way out: the kernel marks it there
        word = _ALIVE.unpack_from(scratch, ALIVE_AT)[0]
    marked = bool(word & _OWNER_DIED)
    if marked or not word & _TID_MASK:
        scratch.close()  # (else a thread that is somehow still there keeps it mapped)
    if not marked:
        log.info("hold board: no alive word here (a dead thread's robust futex was not "
                 "marked); readers check the producer's flock")
    return marked


def _arm_and_end(helpers: Any, scratch: mmap.mmap) -> None:
    try:
        helpers.sentinel_arm(scratch)
    except (OSError, ValueError):
        pass  # (the word stays 0: not marked)


_SLOT = struct.Struct(f"<{_WORDS}Q")
_SHOWN = struct.Struct("<2Q")


def _gil_flock() -> Callable[[int, int], int] | None:
    """libc's ``flock(2)`` called with the GIL held (``ctypes.PyDLL``), or None where it cannot
    be found. ``fcntl.flock`` releases the GIL around the syscall, and a thread waiting for it
    (a transport's progress thread, the side channel's) may run before the caller gets it
    back; the after-check that ends a READ measured 25-30 us on one H200 host. A non-blocking
    flock never waits, so it holds the GIL for a syscall's time; no exception is made for
    "held" either (the answer we expect)."""
    try:
        fn = ctypes.PyDLL(None, use_errno=True).flock
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn  # type: ignore[no-any-return]


_FLOCK = _gil_flock()
_SHARED_NB = fcntl.LOCK_SH | fcntl.LOCK_NB


class DeviceLayout(NamedTuple):
    """Where a hold lies on a board's mapping, for a copy kernel that finds it there itself
    (kvlink.gpu.move's ``kv_move_digest``, KV_BOARD): slot ``generation & mask`` is at word
    ``slot0 + 4 x slot`` (generation, fingerprint, offset, bytes), and a hold's digests lie
    in bytes [lo, hi) of the mapping."""

    slot0: int
    mask: int
    lo: int
    hi: int


LAYOUT = DeviceLayout(_HEADER // 8, SLOTS - 1, _ARENA, KIND.size)


def _slot_at(generation: int) -> int:
    return _HEADER + 8 * _WORDS * (generation & (SLOTS - 1))


def _slots(view: mmap.mmap) -> npt.NDArray[np.uint64]:
    words = np.frombuffer(view, dtype=np.uint64, count=(_ARENA // 8))
    return words[_HEADER // 8:].reshape(SLOTS, _WORDS)


def _fault_in(view: mmap.mmap, write: bool) -> None:
    """Map the board's header and slots (2 MiB, not the arena) into this process now, a page
    at a time. A hold's slot is picked by its generation's low bits, so a new hold lands on a
    page this process may never have touched. The first look at it — the reader's
    after-check, on the poll that sees a READ DONE; the producer's publish, in the hold —
    then took a minor page fault: 272 of 400 after-checks faulted, cold, median 17.7 us
    against 10.1 now on a 2-core VM (bench/board_faults.py, bench/results/board_faults/).
    Once per board (writing what is there: nothing is published yet) and per view (reading)."""
    pages = np.frombuffer(view, dtype=np.uint8, count=_ARENA)[::PAGE]
    if write:
        pages[:] = pages.copy()
    else:
        int(pages.sum())


def _forget_in_child(ref: weakref.ref[HoldBoard]) -> None:
    """After fork, in the child: close our copy of the board's fd (the lock is the parent's
    liveness, not ours) and never unlink the parent's board."""
    board = ref()
    if board is not None and board._fd >= 0:
        os.close(board._fd)
        board._fd = -1
        board._sentinel = None  # (the parent's thread: none here)


class BoardView:
    """The reader's side: a read-only mapping of a same-host producer's board."""

    def __init__(self, fd: int, view: mmap.mmap) -> None:
        self._fd, self._map = fd, view  # slots read by struct: no numpy view to drop first
        base = int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)
        #: (host address, bytes) of the mapping: a device that reads digests in place
        #: registers it (read-only)
        self.region = (base, KIND.size)

    @classmethod
    def open(cls, offer_name: str, token: bytes) -> BoardView | None:
        """The board a handshake offered, or None (with the reason logged) when it is not
        ours to read: not on this host's /dev/shm, not a board, another token."""
        opened = shmfile.open_board(KIND, offer_name, token, writable=False,
                                    what="hold board (validating by asking)")
        if opened is None:
            return None
        fd, view = opened
        _fault_in(view, write=False)
        return cls(fd, view)

    def holds(self, generation: int, fp: int) -> bool:
        """Whether ``generation`` is shown held over the blocks fingerprinted ``fp``."""
        if self._fd < 0:
            return False
        gen, got = _SHOWN.unpack_from(self._map, _slot_at(generation))
        return bool(gen == generation and got == fp)

    def reader(self, generation: int) -> Callable[[], tuple[int, ...]] | None:
        """A call that reads ``generation``'s slot as (generation, fingerprint), what
        :meth:`holds` compares, without a Python frame of its own: a decode binds it when a
        push starts and calls it on the poll that ends the push, where every call is cold
        (a whole microsecond and more each on a busy host). It raises ValueError once this
        view is closed; None if it is already."""
        if self._fd < 0:
            return None
        return functools.partial(_SHOWN.unpack_from, self._map, _slot_at(generation))

    def digests(self, generation: int, fp: int) -> bytes | None:
        """The digests ``generation``'s hold published, copied out; None where it shows none
        (or is not shown). Checked before and after the copy: the pages are given back only
        after the generation is cleared, and a generation never comes back."""
        area = self.digest_area(generation, fp)
        if area is None:
            return None
        blob = self._map[area[0]:area[0] + area[1]]
        return blob if self.holds(generation, fp) else None

    def digest_area(self, generation: int, fp: int | None) -> tuple[int, int] | None:
        """(offset in the mapping, bytes) of the digests ``generation``'s hold published (over
        the block ids fingerprinted ``fp``; None: any), or None. Bytes read there count only
        if :meth:`holds` still says so afterwards. One unpack of the slot's words (numpy's
        per-scalar cost is the time on a busy host)."""
        if self._fd < 0:
            return None
        gen, got, at, n = _SLOT.unpack_from(self._map, _slot_at(generation))
        if (gen != generation or (fp is not None and got != fp) or n == 0 or at < _ARENA
                or at + n > KIND.size):
            return None
        return at, n

    def words(self, at: int, count: int) -> tuple[int, ...]:
        """``count`` little-endian 64-bit words of the mapping at offset ``at``."""
        return struct.unpack_from(f"<{count}Q", self._map, at)

    def int64s(self, at: int, count: int) -> npt.NDArray[np.int64]:
        """``count`` little-endian int64 of the mapping at offset ``at``, copied out (the
        mapping's buffer is let go at once: nothing keeps it from closing)."""
        return np.frombuffer(self._map, dtype="<i8", count=count, offset=at).copy()

    def alive(self) -> bool:
        """Whether the producer is alive and has not closed its worker: its alive word shows
        its sentinel, else it still holds its board's lock."""
        if self._fd < 0:
            return False
        if _shows_live(_ALIVE.unpack_from(self._map, ALIVE_AT)[0]):
            return True
        if _FLOCK is not None:
            if _FLOCK(self._fd, _SHARED_NB) != 0:
                return ctypes.get_errno() in (errno.EWOULDBLOCK, errno.EAGAIN)
            _FLOCK(self._fd, fcntl.LOCK_UN)  # we got it: nobody holds it any more
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)  # we got it: nobody holds it any more
        return False

    def close(self) -> None:
        """Drop the mapping and the descriptor (after-checks fail from here on)."""
        if self._fd < 0:
            return
        shmfile.unmap(self._map)
        os.close(self._fd)
        self._fd = -1

    def still_holds(self, generation: int, fp: int) -> bool:
        """The after-check: the producer is alive and the hold is still shown. Alive first: a
        dead producer's board keeps its last words (see the module docstring)."""
        return self.alive() and self.holds(generation, fp)

    def after_check(self, generation: int, block_ids: npt.ArrayLike) -> AfterCheck:
        """:meth:`still_holds` of one READ of ``block_ids`` (the producer's, in the order
        held), bound when it is posted (see :class:`AfterCheck`)."""
        return AfterCheck(self, generation, block_ids)


class AfterCheck:
    """:meth:`BoardView.still_holds` for one READ, bound when it is posted (see the module
    docstring: alive first, then the slot) over the block ids it read. Made in one C call
    where kvlink's helpers build (kvlink.native's ``board_shows``: the ids' fingerprint, the
    flock and both loads), else by :meth:`BoardView.still_holds`. Nothing is taken at the
    bind but the slot's place: where a READ's host steps outrun its copy, every step before
    the poll that sees it DONE is on its path (bench/results/gpu_stamps_e98e4fa/); the
    fingerprint and the bound check's own steps cost ~5 us of that poll cold on a 2-core VM
    (bench/worker_host.py)."""

    __slots__ = ("_args", "_view")

    def __init__(self, view: BoardView, generation: int, block_ids: npt.ArrayLike) -> None:
        self._view = view
        self._args = (_slot_at(generation), generation, block_ids)  # (board_shows' own)

    def __call__(self) -> bool:
        """The producer is alive and still shows the hold (alive first: module docstring)."""
        view = self._view
        at, generation, ids = self._args
        helpers = _c_helpers if _c_helpers is not _UNSET else _helpers()  # (no call once known)
        try:
            if helpers is not None:
                return bool(helpers.board_shows(view._map, at, view._fd, generation, ids))
            return view.still_holds(generation, fingerprint(ids))
        except ValueError:  # the view was closed under us
            return False
