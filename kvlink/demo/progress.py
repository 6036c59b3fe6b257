"""A dependency-free progress bar on stderr (a line per 10 % when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._last_decile = -1
        self._t0 = time.perf_counter()

    def step(self, rate_bps: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        line = (f"[{'#' * int(frac * self.width):<{self.width}}] {self.done}/{self.total} "
                f"requests  {rate_bps / 1e9:6.2f} GB/s")
        if self._tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.enabled and self._tty:
            sys.stderr.write("\n")
