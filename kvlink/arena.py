"""Page runs handed out of a board's arena: the pages a hold's digests take on the hold board
(:mod:`kvlink.holdboard`) and a push's on the decode's landing board (:mod:`kvlink.landing`).

Both boards hand out runs of whole pages to live holds or pushes and take them back when those
end, in roughly the order they came. A run goes at the next page where it is free, else at the
first long-enough free run after it (wrapping) — never only at the arena's start, where one
run that stays (a long lease, a whole-cache hold) would leave every later one without
(bench/results/gpu_arena_c5e9b5e/). Not thread-safe: each board calls it under its own lock.
"""

from __future__ import annotations

import numpy as np


class PageArena:
    """Runs of pages out of ``pages``, by first page."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.used = np.zeros(pages, dtype=bool)  # pages given to live runs
        self._next = 0  # where the next run goes if the pages there are free

    def take(self, need: int) -> int:
        """The first page of a run of ``need`` free pages, now taken; -1 if there is none."""
        first = self._free_run(need)
        if first >= 0:
            self.used[first:first + need] = True
            self._next = (first + need) % self.pages
        return first

    def give(self, first: int, count: int) -> None:
        """A run :meth:`take` handed out is free again."""
        self.used[first:first + count] = False

    def _free_run(self, need: int) -> int:
        nxt = self._next
        if nxt + need <= self.pages and not self.used[nxt:nxt + need].any():
            return nxt  # (the common case: runs end in the order they came)
        if not 0 < need <= self.pages:
            return -1
        free = np.concatenate(([0], np.cumsum(~self.used, dtype=np.int32)))
        starts = np.flatnonzero(free[need:] - free[:-need] == need)  # runs of `need` free
        if starts.size == 0:
            return -1
        after = starts[np.searchsorted(starts, nxt):]
        return int(after[0] if after.size else starts[0])
