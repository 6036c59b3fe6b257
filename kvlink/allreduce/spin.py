"""Epoch flag barrier over shared host memory (the CPU variant's synchronisation).

Each rank owns one 64-byte line per flag array and is the only writer of it; a barrier is "write
my epoch, wait until every peer's line holds at least that epoch". Epochs only grow (one per call),
so flags never need resetting and a late reader can't confuse two calls: a peer can be at most one
barrier ahead, because it cannot pass the *next* barrier without us.

Line layout (int64 words): ``[0]`` the owner's epoch, ``[1]`` the epoch the owner is *sleeping*
on in this array (see below), the rest padding so that pollers never share a line with a writer.

Memory ordering. The flags are 8-byte aligned int64 words read and written with single 8-byte
moves (memoryview item access compiles to an inlined fixed-size memcpy). On x86-64 (TSO) stores
become visible in program order and loads are not reordered with older loads, so "copy data, then
store flag" on one side and "see flag, then read data" on the other needs no fence; the data copies
are opaque C calls the interpreter cannot reorder around the flag store. Weakly ordered CPUs
(aarch64, POWER) would need a release fence before the flag store and an acquire fence after the
flag load, which Python cannot issue: :func:`ordering_is_safe` reports that and the shm backend
refuses such hosts unless explicitly forced.

Waiting. A decode step makes ~160 calls, so the common wait is microseconds: spin first. A peer
that does not arrive within ``_SPIN_SECONDS`` has usually lost its CPU (more runnable threads than
cores), and spinning or ``sched_yield`` then keeps *our* CPU busy so the scheduler cannot move the
peer onto it; so the waiter blocks in ``futex(FUTEX_WAIT)`` on the peer's flag word, after
announcing that in its line's word 1. An arriving rank that sees such an announcement for the
current epoch calls ``FUTEX_WAKE`` (no syscall otherwise). The announce/check pair is not fenced
(Python has no fence), so a wake-up can in rare cases be missed: waits are therefore bounded
(``_FUTEX_SLICE``) and re-check the flag, which turns a lost wake-up into a short delay, never a
hang. Without futex (non-Linux), it falls back to short sleeps. Every slow-path round checks the
deadline, the shared abort word (a peer already failed) and, every 100 ms, whether the missing
peers' processes still exist, so a dead peer costs at most ``timeout_s`` and usually ~0.1 s.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable, Sequence

from kvlink.allreduce.exceptions import PeerExitedError, PeerTimeoutError

#: Flags are one per 64-byte cache line so that peers polling never share a line with a writer.
FLAG_STRIDE_WORDS = 8
_SLEEP_WORD = 1
#: a word of each rank's line the caller may use for what this step is (EpochBarrier.note)
_NOTE_WORD = 2
_SPIN_SECONDS = 20e-6
_FUTEX_SLICE = 200e-6
_MAX_SLEEP = 1e-3
_LIVENESS_EVERY = 0.1

_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


def ordering_is_safe() -> bool:
    """Whether plain loads/stores give the store->store and load->load order the protocol needs."""
    return platform.machine().lower() in _X86


def pid_alive(pid: int) -> bool:
    """True unless the process is known to be gone (a zombie still counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """``futex(2)`` on 32-bit words of a shared mapping (process-shared: no FUTEX_PRIVATE)."""

    def __init__(self) -> None:
        nr = _SYS_FUTEX.get(platform.machine().lower()) if os.name == "posix" else None
        self._nr = nr
        self._syscall = None
        if nr is not None and platform.system() == "Linux":
            try:
                self._syscall = ctypes.CDLL(None, use_errno=True).syscall
            except (OSError, AttributeError):
                self._syscall = None

    @property
    def available(self) -> bool:
        return self._syscall is not None

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        """Sleep while the u32 at ``addr`` equals ``expected`` (or until woken / timed out)."""
        assert self._syscall is not None and self._nr is not None
        ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        self._syscall(
            ctypes.c_long(self._nr),
            ctypes.c_void_p(addr),
            ctypes.c_int(_FUTEX_WAIT),
            ctypes.c_uint32(expected & 0xFFFFFFFF),
            ctypes.byref(ts),
            ctypes.c_void_p(0),
            ctypes.c_int(0),
        )

    def wake(self, addr: int) -> None:
        """Wake every waiter on the u32 at ``addr``."""
        assert self._syscall is not None and self._nr is not None
        self._syscall(
            ctypes.c_long(self._nr),
            ctypes.c_void_p(addr),
            ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(0x7FFFFFFF),
            ctypes.c_void_p(0),
            ctypes.c_void_p(0),
            ctypes.c_int(0),
        )


class EpochBarrier:
    """One flag array (``world`` lines) plus the rules to arrive at and wait on it.

    ``words`` is an int64 memoryview over the array (``FLAG_STRIDE_WORDS`` words per rank) and
    ``address`` its absolute address in this process (for futex; 0 disables sleeping on futex);
    ``pid_of`` maps a rank to its process id for the liveness check; ``aborted`` returns a
    non-zero value once any rank has given up (``rank + 1`` of the first that did).
    """

    def __init__(
        self,
        words: memoryview,
        *,
        address: int,
        name: str,
        rank: int,
        world: int,
        timeout_s: float,
        pid_of: Callable[[int], int],
        aborted: Callable[[], int],
    ) -> None:
        self._words = words
        self._address = address
        self.name = name
        self._rank = rank
        self._world = world
        self._timeout = timeout_s
        self._pid_of = pid_of
        self._aborted = aborted
        self._me = rank * FLAG_STRIDE_WORDS
        self._peer_index: Sequence[int] = tuple(
            p * FLAG_STRIDE_WORDS for p in range(world) if p != rank
        )
        self._sleep_index: Sequence[int] = tuple(i + _SLEEP_WORD for i in self._peer_index)
        futex = Futex()
        self._futex: Futex | None = futex if (address and futex.available) else None

    def release(self) -> None:
        """Drop the view of the shared array so the mapping can be closed."""
        self._words.release()

    def arrive(self, epoch: int, note: int = 0) -> None:
        """Publish that this rank reached the barrier of ``epoch``; wake peers sleeping on it.
        ``note``: a word the peers read with :meth:`notes` once they saw the arrival (stored
        before the epoch: x86 keeps the two stores in order, see ordering_is_safe)."""
        words = self._words
        words[self._me + _NOTE_WORD] = note
        words[self._me] = epoch
        for idx in self._sleep_index:
            if words[idx] == epoch:
                if self._futex is not None:
                    self._futex.wake(self._address + self._me * 8)
                return

    def wait(self, epoch: int) -> None:
        """Return once every peer has arrived at ``epoch``; raise naming the ones that did not."""
        words = self._words
        for idx in self._peer_index:
            if words[idx] < epoch:
                break
        else:
            return
        self._wait_slow(epoch)

    def value(self, rank: int) -> int:
        return int(self._words[rank * FLAG_STRIDE_WORDS])

    def notes(self) -> list[int]:
        """Every rank's note of its last arrival, by rank (after :meth:`wait` returned)."""
        words = self._words
        return [int(words[r * FLAG_STRIDE_WORDS + _NOTE_WORD]) for r in range(self._world)]

    def _wait_slow(self, epoch: int) -> None:
        words = self._words
        pending = [idx for idx in self._peer_index if words[idx] < epoch]
        start = time.perf_counter()
        next_liveness = start + _LIVENESS_EVERY
        sleep = 2e-5
        announced = False
        while True:
            pending = [idx for idx in pending if words[idx] < epoch]
            if not pending:
                return
            now = time.perf_counter()
            waited = now - start
            if waited < _SPIN_SECONDS:
                continue
            missing = tuple(idx // FLAG_STRIDE_WORDS for idx in pending)
            if waited > self._timeout:
                raise PeerTimeoutError(
                    f"all-reduce rank {self._rank}/{self._world}: rank(s) "
                    f"{', '.join(map(str, missing))} never arrived at the {self.name} barrier of "
                    f"call {epoch} within {self._timeout:g} s",
                    missing,
                )
            culprit = self._aborted()
            if culprit:
                raise PeerTimeoutError(
                    f"all-reduce rank {self._rank}/{self._world}: rank {culprit - 1} gave up "
                    f"(its error names the cause) while rank(s) {', '.join(map(str, missing))} "
                    f"had not reached the {self.name} barrier of call {epoch}",
                    missing,
                )
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY
                dead = tuple(p for p in missing if not pid_alive(self._pid_of(p)))
                if dead:
                    raise PeerExitedError(
                        f"all-reduce rank {self._rank}/{self._world}: rank(s) "
                        f"{', '.join(f'{p} (pid {self._pid_of(p)})' for p in dead)} exited "
                        f"before the {self.name} barrier of call {epoch}",
                        dead,
                    )
            if self._futex is not None:
                if not announced:
                    words[self._me + _SLEEP_WORD] = epoch
                    announced = True
                    continue  # re-check the flags once after announcing
                idx = pending[0]
                seen = int(words[idx])
                if seen < epoch:
                    self._futex.wait(self._address + idx * 8, seen, _FUTEX_SLICE)
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)
