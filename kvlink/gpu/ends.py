"""When a transport's copies should end: what a poll waits for (``poll_grace_us``).

A caller that sleeps between polls, or a scheduler that polls once a step, sees a copy that
ends just after a poll one sleep or one step later. A poll that knows the copy is about to
end can wait for it instead (:meth:`kvlink.worker.KVWorker.poll`), if it knows when: this is
that estimate, kept by the transport whose copies run one after another on one stream
(cuda_ipc). Pure arithmetic, no CUDA: the transport feeds it each post and each copy it saw
end.
"""

from __future__ import annotations

#: how much of the best rate seen a copy seen ended keeps: a device that got slower (other
#: work on it) is followed within tens of copies
RATE_KEPT = 0.98


class CopyEnds:
    """The expected end of each copy posted on one stream: after the copies before it, at the
    best rate (bytes over the time from its enqueue to the poll that saw it end) seen lately.
    A copy seen late (the caller slept) or queued behind others ran no slower than it shows,
    so only the fastest count, and the best decays by :data:`RATE_KEPT` a copy. Times are
    ``time.perf_counter()`` seconds; not thread-safe (the transport's lock)."""

    def __init__(self) -> None:
        self.rate = 0.0  # bytes a second; 0: no copy seen ended yet
        self.tail = 0.0  # when the last copy posted should end

    def posted(self, t_post: float, nbytes: int) -> float:
        """When a copy of ``nbytes`` posted at ``t_post`` should end (0: not known yet)."""
        if not self.rate:
            return 0.0
        self.tail = max(t_post, self.tail) + nbytes / self.rate
        return self.tail

    def ended(self, nbytes: int, took: float) -> None:
        """A copy of ``nbytes`` was seen ended ``took`` seconds after its post."""
        if took > 0 and nbytes > 0:
            self.rate = max(nbytes / took, self.rate * RATE_KEPT)
