"""What `kvlink demo`, `serve` and `pull` show on stderr while they run (the parent process).

The ranks (child processes) report their start-up phases and the requests that landed over
their event queues; :class:`Display` shows them:

* on a terminal, with rich: two live lines, the current phase ("prefill: filling the KV cache
  [1/2 ranks]") and a bar that advances as requests land, with the transfer rate (bytes over
  the time spent transferring, verification not counted: the figure the summary prints);
* elsewhere (a CI log, a pipe), with ``-v`` (child logs would tear a live line), or without
  rich: plain lines, ``kvlink: ...``, each phase once, and the transfer at every 10 %.

``--no-progress`` shows nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO


def _plain_rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "- GB/s"


class Display:
    """The parent's view of a run's phases and transfer progress (see the module doc)."""

    def __init__(self, enabled: bool = True, total: int | None = None,
                 stream: TextIO | None = None, live: bool | None = None) -> None:
        """``total``: requests to land over all decode ranks (None: no transfer bar);
        ``live``: a rich live line (default: when ``stream`` is a terminal and rich imports)."""
        self.enabled, self.total = enabled, total
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.bytes, self.seconds = 0, 0, 0.0
        self._phases: dict[tuple[str, str], set[int]] = {}
        self._printed: set[tuple[str, str]] = set()
        self._decile = 0
        self._ranks: dict[int, tuple[int, int, float]] = {}  # decode rank -> done, bytes, s
        self._t0 = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        if not enabled:
            return
        if live is None:  # with -v the ranks' log lines would tear a live display
            live = (bool(getattr(self.stream, "isatty", lambda: False)())
                    and logging.getLogger().getEffectiveLevel() >= logging.WARNING)
        if live:
            self._start_rich()

    # ------------------------------------------------------------------ backends
    def _start_rich(self) -> None:
        try:
            from rich.console import Console, RenderableType
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.text import Text
        except ImportError:  # not a dependency of the core: plain lines then
            return

        class TwoLines(Progress):
            """The phase on a line of its own, the bar below it (rich's documented way:
            override get_renderables)."""

            status = ""
            bar = True

            def get_renderables(self) -> Any:
                row: RenderableType = Text(self.status, overflow="ellipsis", no_wrap=True)
                yield row
                if self.bar:  # `serve` has phases only
                    yield self.make_tasks_table(self.tasks)

        console = Console(file=self.stream, force_terminal=True)
        self._progress = TwoLines(
            SpinnerColumn(finished_text="[green]✓"), BarColumn(bar_width=30),
            MofNCompleteColumn(), TextColumn("requests  {task.fields[rate]}"),
            TimeElapsedColumn(), console=console, transient=False, refresh_per_second=10)
        self._progress.bar = self.total is not None
        self._progress.start()
        self._task = self._progress.add_task("", total=self.total, rate="")

    def _status(self, text: str) -> None:
        self._progress.status = text
        self._progress.refresh()

    def _line(self, text: str) -> None:
        self.stream.write(f"kvlink: {text}\n")
        self.stream.flush()

    # ------------------------------------------------------------------ events
    def phase(self, text: str) -> None:
        """A step of the parent's own ("starting 2 prefill ranks")."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._status(text)
        else:
            self._line(text)

    def rank_phase(self, side: str, rank: int, ranks: int, text: str) -> None:
        """A rank of ``side`` ("prefill", "decode"; ``ranks`` of them) reached a phase."""
        if not self.enabled:
            return
        key = (side, text)
        seen = self._phases.setdefault(key, set())
        seen.add(rank)
        count = f" [{len(seen)}/{ranks} ranks]" if ranks > 1 else ""
        if self._progress is not None:
            self._status(f"{side}: {text}{count}")
        elif key not in self._printed:
            self._printed.add(key)
            self._line(f"{side}: {text}" + (f" ({ranks} ranks)" if ranks > 1 else ""))

    def landed(self, rank: int, done: int, nbytes: int, seconds: float) -> None:
        """Decode ``rank`` has ``done`` requests landed, ``nbytes`` bytes, in ``seconds`` of
        transfer so far (its totals, not increments)."""
        self._ranks[rank] = (done, nbytes, seconds)
        self.done = sum(d for d, _, _ in self._ranks.values())
        self.bytes = sum(b for _, b, _ in self._ranks.values())
        self.seconds = max(s for _, _, s in self._ranks.values())
        if not self.enabled:
            return
        rate = _plain_rate(self.bytes, self.seconds)
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, rate=rate)
            return
        total = self.total or 0
        decile = self.done * 10 // total if total else 0
        if decile > self._decile or (total and self.done == total and self._decile < 10):
            self._decile = decile
            self._line(f"{self.done}/{total} requests landed, {self.bytes / 2**30:.2f} GiB, "
                       f"{rate}")

    def close(self, text: str | None = None) -> None:
        """End the live line (its last state stays on screen), or print ``text``."""
        if self._progress is not None:
            self._status(text or "done")
            self._progress.stop()
            self._progress = None
        elif self.enabled and text:
            self._line(text)
        self.enabled = False
