"""Error types of the all-reduce that a caller may want to tell apart.

All derive from :class:`kvlink.errors.AllReduceError`, so ``except AllReduceError`` catches them.
"""

from __future__ import annotations

from kvlink.errors import AllReduceError


class PeerTimeoutError(AllReduceError, TimeoutError):
    """A peer never reached a barrier in time (dead, hung, or calling a different sequence).

    ``missing`` holds the ranks that never arrived, so a supervisor can tell which process to
    restart; the communicator is unusable afterwards (its epochs are out of step).
    """

    def __init__(self, message: str, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.missing = missing


class PeerExitedError(PeerTimeoutError):
    """A peer's process is gone (seen before the timeout ran out, via its pid)."""
