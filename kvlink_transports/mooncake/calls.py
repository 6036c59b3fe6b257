"""An engine call waited for no longer than a deadline of ours.

Why: the engine waits for a hung (stopped) peer on its own clocks — its session setup and its
probe answer take ~60 s whatever ``timeout_s`` says — and a handshake or a peer's thread must
not. The call runs on a daemon thread of its own, left to end when the engine returns; it
touches nothing of the caller's but what the call itself was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def within(call: Callable[[], T], seconds: float, name: str) -> T | str | None:
    """``call()``'s result where it returned within ``seconds``; None where it did not (or
    ``seconds`` <= 0: not started); the exception it raised, named, as a string."""
    answer: list[T | str] = []

    def run() -> None:
        try:
            answer.append(call())
        except Exception as exc:  # an error is no answer
            answer.append(f"{type(exc).__name__}: {exc}")

    if seconds > 0:
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(seconds)
    return answer[0] if answer else None
