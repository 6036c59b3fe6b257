"""When a transport's copies should end: what a poll waits for (``poll_grace_us``).

A caller that sleeps between polls, or a scheduler that polls once a step, sees a copy that
ends just after a poll one sleep or one step later. A poll that knows the copy is about to
end can wait for it instead (:meth:`kvlink.worker.KVWorker.poll`), if it knows when: this is
that estimate, kept by the transport whose copies run one after another on one stream
(cuda_ipc). Pure arithmetic, no CUDA: the transport feeds it each post, each copy it saw
end and, where its copier times some copies on the device, their device time.

Why device times: a copy seen ended by the host only bounds the device's rate from below
(the poll came after the end), and one seen early (its kernel started before the host took
the enqueue's time) from above. With host times alone the estimate kept the best one seen,
less :data:`RATE_KEPT` a copy — and 8 copies in flight are all seen late (the caller posts
them all before it polls), so every round of them slowed it by 15 % (0.98^8), the last of 8
looked farther off than a poll's grace, and a caller sleeping between polls saw it a sleep
later: in a 70B e2e run the polls waited for a copy once, 8 in flight at 0.58x the copy
sleeping (bench/results/gpu_checks_cf9f8d4); counting with device times, 65 times, 0.71x
(bench/results/gpu_device_timed; docs/e2e.md).
"""

from __future__ import annotations

import statistics
from collections import deque

#: how much of the best rate seen a copy seen ended keeps, while no copy was timed on the
#: device: a device that got slower (other work on it) is followed within tens of copies
RATE_KEPT = 0.98
#: device-timed copies whose median rate is the estimate: one timed while the copy waited
#: for the caller's stream (its time includes the wait) does not move it alone
TIMED_KEPT = 5


class CopyEnds:
    """The expected end of each copy posted on one stream: after the copies before it, at the
    rate copies ran at lately — the median of the last :data:`TIMED_KEPT` timed on the device
    (:meth:`timed`), or, until one was, the best host-seen rate (bytes over the time from its
    enqueue to the poll that saw it end), which decays by :data:`RATE_KEPT` a copy. Times
    are ``time.perf_counter()`` seconds; not thread-safe (the transport's lock)."""

    def __init__(self) -> None:
        self.rate = 0.0  # bytes a second; 0: no copy seen ended yet
        self.tail = 0.0  # when the last copy posted should end
        self._timed: deque[float] = deque(maxlen=TIMED_KEPT)  # device rates, newest last

    def posted(self, t_post: float, nbytes: int) -> float:
        """When a copy of ``nbytes`` posted at ``t_post`` should end (0: not known yet)."""
        if not self.rate:
            return 0.0
        self.tail = max(t_post, self.tail) + nbytes / self.rate
        return self.tail

    def ended(self, nbytes: int, took: float) -> None:
        """A copy of ``nbytes`` was seen ended ``took`` seconds after its post. Ignored once
        copies are timed on the device: the host's view is off both ways (see the module)."""
        if took > 0 and nbytes > 0 and not self._timed:
            self.rate = max(nbytes / took, self.rate * RATE_KEPT)

    def timed(self, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` ran ``seconds`` on the device (its stream's events)."""
        if seconds > 0 and nbytes > 0:
            self._timed.append(nbytes / seconds)
            self.rate = statistics.median(self._timed)
