"""One mooncake peer's thread: submitting its sub-batches, waiting on them, retrying failures.

**Completion.** The engine's Python API has no non-blocking batch status:
``get_batch_transfer_status`` spins (GIL released) until the batch completes, fails or times
out, and ``transfer_check_status`` only looks at entry 0. So every peer gets one thread that
submits its sub-batches and waits on the oldest one; :meth:`poll` only reads the state that
thread recorded and never blocks.

A failed sub-batch is probed and retried, or fails its transfer, by the rules in the
transport's module doc (**Failures**).

Separate from the transport because it is the peer's thread, not the caller's: it shares the
transport's lock (its condition is on it) and reaches the transport only through
:class:`_Owner`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Protocol

from kvlink.errors import TransferError
from kvlink.transport import PENDING, Extents, Op, Region, RegionTable, XferState
from kvlink_transports.mooncake.calls import within
from kvlink_transports.mooncake.wire import _Descriptor

log = logging.getLogger("kvlink.mooncake")


@dataclasses.dataclass(eq=False)
class _Xfer:
    op: Op
    peer: _Peer | None  # None: failed at post, never queued
    local: Extents
    remote: Extents
    nbytes: int
    t_post: float
    queued: int = 0  # sub-batches not yet handed to the engine
    inflight: int = 0  # sub-batches handed to the engine and not yet returned
    done_subs: int = 0  # sub-batches completed
    failure: str | None = None
    state: XferState = PENDING
    #: stream order: a mark of the caller's CUDA stream at the post (kvlink.staging), waited
    #: for by the peer's thread before the first sub-batch is submitted; None: nothing to wait
    after: Any = None


@dataclasses.dataclass(eq=False)
class _Sub:
    xfer: _Xfer
    lo: int
    hi: int
    attempts: int = 0
    not_before: float = 0.0

    @property
    def n(self) -> int:
        return self.hi - self.lo


class _Owner(Protocol):
    """What a peer's thread needs of its transport."""

    @property
    def _lock(self) -> threading.Lock: ...

    @property
    def _engine(self) -> Any: ...

    @property
    def max_inflight(self) -> int: ...

    @property
    def max_retries(self) -> int: ...

    @property
    def retry_backoff(self) -> float: ...

    timeout: float  # timeout_s: no transfer is retried past it

    def _submit(self, op: Op, session: str, local: Extents, remote: Extents) -> tuple[int, str]:
        ...

    def _settle(self, x: _Xfer, force: bool = False) -> None: ...

    def _await_stream(self, mark: Any) -> None:
        """Block until the caller's stream ran what ``mark`` marks (this peer's thread)."""

    def _drop_mark(self, mark: Any) -> None:
        """Hand back the mark of a transfer that ended before it was submitted."""


class _Peer:
    """One peer: its offered regions, its sub-batch queue and the thread that drives them."""

    def __init__(self, owner: _Owner, name: str, desc: _Descriptor) -> None:
        self.owner, self.name, self.desc = owner, name, desc
        self.session = desc.session
        self.table = RegionTable([Region(a, n, d) for a, n, d in desc.regions])
        self.cv = threading.Condition(owner._lock)
        self.queue: collections.deque[_Sub] = collections.deque()
        self.window: collections.deque[tuple[int, _Sub]] = collections.deque()
        self.window_entries = 0
        self.xfers: set[_Xfer] = set()
        self.call_since: float | None = None  # start of the engine call in progress
        self.closed = False
        self.thread = threading.Thread(
            target=self._run, name=f"kvlink-mooncake-{name}", daemon=True
        )
        self.thread.start()

    def where(self) -> str:
        return f"peer {self.name} ({self.session})"

    # -- called with the lock held
    def enqueue(self, xfer: _Xfer, cuts: list[int]) -> None:
        if self.closed:
            raise TransferError(f"mooncake: {self.where()} is disconnected")
        self.xfers.add(xfer)
        for lo, hi in itertools.pairwise(cuts):
            self.queue.append(_Sub(xfer, lo, hi))
        xfer.queued = len(cuts) - 1
        self.cv.notify()

    def fail_all(self, reason: str, now: bool = False) -> None:
        """Fail every pending transfer of this peer: each reports FAILED once its sub-batches
        in the engine have returned. ``now`` skips that wait; only for a dead peer thread (a
        kvlink bug), after which nothing would ever see those sub-batches return."""
        for x in list(self.xfers):
            if x.failure is None:
                x.failure = reason
            self.owner._settle(x, force=now)
        self.cv.notify()

    # -- the thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave handles PENDING behind a dead thread
            log.exception("mooncake: thread of %s died", self.where())
            with self.cv:
                self.call_since = None
                self.closed = True
                self.fail_all(f"mooncake: thread of {self.where()} died: {exc!r}", now=True)

    def _loop(self) -> None:
        owner, engine = self.owner, self.owner._engine
        cap = owner.max_inflight
        while True:
            sub: _Sub | None = None
            with self.cv:
                while True:
                    self._drop_dead()
                    now = time.monotonic()
                    if self.queue and (
                        not self.window or self.window_entries + self.queue[0].n <= cap
                    ):
                        head = self.queue[0]
                        if head.not_before <= now:
                            sub = self.queue.popleft()
                            sub.xfer.queued -= 1
                            sub.xfer.inflight += 1
                            break
                        if not self.window:
                            self.cv.wait(head.not_before - now)
                            continue
                    if self.window:
                        break  # wait for the oldest sub-batch outside the lock
                    if self.closed:
                        return
                    self.cv.wait()
                self.call_since = now
            if sub is not None:
                x = sub.xfer
                if x.after is not None:  # the caller's GPU work first (this thread waits)
                    mark, x.after = x.after, None
                    owner._await_stream(mark)
                bid, why = owner._submit(
                    x.op, self.session, x.local[sub.lo : sub.hi], x.remote[sub.lo : sub.hi]
                )
                if bid:
                    with self.cv:
                        self.call_since = None
                        self.window.append((bid, sub))
                        self.window_entries += sub.n
                    continue
                self._failed(sub, why)
                continue
            bid, sub = self.window[0]  # only this thread adds to or takes from the window
            try:
                rc = int(engine.get_batch_transfer_status([bid]))
            except Exception as exc:  # the binding raising is a failed batch, not a dead thread
                rc, why = -1, repr(exc)
            else:
                why = f"engine status {rc}"
            with self.cv:
                self.window.popleft()
                self.window_entries -= sub.n
                if rc == 0:
                    self.call_since = None
                    sub.xfer.inflight -= 1
                    sub.xfer.done_subs += 1
                    owner._settle(sub.xfer)
                    continue
            self._failed(sub, why)

    def _drop_dead(self) -> None:
        while self.queue and (
            self.queue[0].xfer.failure is not None or self.queue[0].xfer.state is not PENDING
        ):
            sub = self.queue.popleft()
            sub.xfer.queued -= 1
            if sub.xfer.after is not None:  # never submitted: nothing waits on its mark
                mark, sub.xfer.after = sub.xfer.after, None
                self.owner._drop_mark(mark)
            self.owner._settle(sub.xfer)

    def _probe(self) -> tuple[int, str]:
        """``send_probe`` of the peer, waited for until ``timeout_s`` after the start of the
        engine call that failed (``call_since``, what :meth:`poll` counts from): (0, "") where
        it answered, else (non-zero, why). Bounded (:func:`~kvlink_transports.mooncake.calls.
        within`): the engine waits ~60 s for a stopped peer's answer, and this thread must
        not — every transfer of the peer waits on it, and one failed by poll at timeout_s
        (8 s) was reported FAILED 66 s after its post."""
        since = self.call_since if self.call_since is not None else time.monotonic()
        got = within(lambda: int(self.owner._engine.send_probe(self.session)),
                     since + self.owner.timeout - time.monotonic(),
                     f"kvlink-mooncake-probe-{self.name}")
        if got is None:
            return -1, f"no answer to send_probe within timeout_s={self.owner.timeout:g}s"
        return (got, "") if isinstance(got, int) else (-1, f"probe raised {got}")

    def _failed(self, sub: _Sub, why: str) -> None:
        """A sub-batch failed (``call_since`` still set): retry it, or fail its transfer."""
        owner, x = self.owner, sub.xfer
        what = (
            f"{x.op.value} sub-batch of {sub.n} entries (extents {sub.lo}..{sub.hi - 1} of "
            f"{x.local.shape[0]})"
        )
        alive = not self.closed and sub.attempts < owner.max_retries and x.failure is None
        probe = 0
        if alive:
            probe, said = self._probe()
            why = f"{why}; {said}" if said else why
        with self.cv:
            self.call_since = None
            x.inflight -= 1
            if x.failure is not None or x.state is not PENDING:
                owner._settle(x)
            elif probe != 0:
                log.warning(
                    "mooncake: %s: %s failed (%s) and the peer does not answer "
                    "(probe %d); failing its %d transfer(s)",
                    self.where(),
                    what,
                    why,
                    probe,
                    len(self.xfers),
                )
                self.fail_all(
                    f"mooncake: {self.where()} does not answer (probe {probe}) "
                    f"after a failed {what}: {why}"
                )
            elif not alive:
                tries = sub.attempts + 1
                x.failure = (
                    f"mooncake: {what} to {self.where()} failed {tries} time(s); "
                    f"last: {why}" + ("" if not self.closed else "; disconnected")
                )
                owner._settle(x)
            elif (late := time.perf_counter() - x.t_post
                  + owner.retry_backoff * 2 ** sub.attempts) > owner.timeout:
                # its next try would start past timeout_s (a backoff that doubles each
                # time, counted by nobody while it waits: 20 s and on with timeout_s 2)
                x.failure = (
                    f"mooncake: {what} to {self.where()} failed {sub.attempts + 1} time(s); "
                    f"last: {why}; its next try would start {late:.2f}s after the post, past "
                    f"timeout_s={owner.timeout:g}s"
                )
                owner._settle(x)
            else:
                sub.attempts += 1
                delay = owner.retry_backoff * 2 ** (sub.attempts - 1)
                log.info(
                    "mooncake: %s: %s failed (%s); retry %d/%d in %.3fs",
                    self.where(),
                    what,
                    why,
                    sub.attempts,
                    owner.max_retries,
                    delay,
                )
                sub.not_before = time.monotonic() + delay
                self.queue.appendleft(sub)
                x.queued += 1
