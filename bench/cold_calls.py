"""What one call on a request's path costs cold, by kind: numpy's against Python's builtins.

    .venv/bin/python bench/cold_calls.py [--reps 200] [--out bench/results/cold_calls.json]

Also a READ's after-check on the hold board and its system calls (the flock that says the
producer is alive), against a plain system call.

Why: stamps along a cuda_ipc READ on the H200 host (docs/history/e2e.md, "Lanes") put 40 us in the
local ids' range check and 30 us in the writes of a launch table, where each is a microsecond
back to back. Between two requests a serving process runs other code (here: a pass over 64
MiB, torch and numpy work of other shapes, a burst of Python objects), so the code of the next
request's calls has left the caches. Each call below is timed right after such a sweep
("cold") and then back to back ("hot", the same-run baseline), for the ids of one 70B TP8-rank
request (256 of 600 blocks): numpy's reductions and ufuncs against the builtins over a
buffer or list — what decided the forms used on the request path (``KVCacheSpec.
check_block_ids``, ``kvlink.gpu.lane``). CPU only. Writes bench/results/cold_calls.json.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result

BIG = np.zeros(64 << 20, dtype=np.uint8)


def _sweep(torch: Any, a: Any, b: Any) -> None:
    BIG[::64] += 1
    _ = [str(i) for i in range(5000)]
    if torch is not None:
        (a == b).sum()
    np.sort(np.random.default_rng(0).random(20000))
    _ = {i: str(i) for i in range(2000)}


_CHECK3 = struct.Struct("<3Q")


def _set3(c: Any) -> None:
    c[0] = 2**64 - 1
    c[1] = 0
    c[2] = 0


def _after_check_calls() -> dict[str, Callable[[], Any]]:
    """A READ's after-check and the system calls it is made of: the producer's flock refused
    to us (it is alive), the slot's words, and a plain system call for scale."""
    import fcntl
    import os

    from kvlink import holdboard
    from kvlink.holdboard import BoardView, HoldBoard

    board = HoldBoard()
    view = BoardView.open(board.name, board.token)
    assert view is not None
    gen, ids = (7 << 16) | 3, np.arange(256, dtype=np.int64)  # (as a READ's: its own int64)
    board.publish(gen, list(range(256)))
    check = view.after_check(gen, ids)
    assert check()
    fd = view._fd  # (our own descriptor of the board's file: the producer holds its lock)

    def refused() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    # the same check of a board whose alive word shows no sentinel (an older producer's):
    # the flock answers
    old = HoldBoard()
    old_view = BoardView.open(old.name, old.token)
    assert old_view is not None
    holdboard._ALIVE.pack_into(old._map, holdboard.ALIVE_AT, 0)
    old.publish(gen, list(range(256)))
    old_check = old_view.after_check(gen, ids)
    assert old_check()
    _KEEP.extend((board, view, old, old_view))
    libc = ctypes.CDLL(None)
    ppid = libc.getppid
    ppid.argtypes, ppid.restype = [], ctypes.c_int
    return {
        "syscall: os.getppid": os.getppid,
        "syscall: getppid through ctypes (a driver call's way)": ppid,
        "after-check: flock(LOCK_SH | LOCK_NB), refused": refused,
        "after-check: the whole check, alive word (C where built)": check,
        "after-check: the whole check, by the flock (C where built)": old_check,
    }


_KEEP: list[Any] = []  # the board and view the after-check calls use, open until exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import torch

        a, b = torch.zeros(4 << 20), torch.ones(4 << 20)
    except ImportError:
        torch = a = b = None  # type: ignore[assignment]
    ids = np.random.default_rng(0).permutation(600)[:256].astype(np.int64)
    lst = ids.tolist()
    words = (ctypes.c_longlong * 1536)()
    table = np.frombuffer(memoryview(words).cast("B"), dtype=np.uint64)
    unit = np.uint64(4096)
    check_words = np.array([2**64 - 1, 0, 0], dtype=np.uint64)  # a digest lane's check words
    check_bytes = check_words.tobytes()
    table_bytes = memoryview(words).cast("B")
    check_c = (ctypes.c_uint64 * 3).from_address(ctypes.addressof(words) + 8)
    calls: dict[str, Callable[[], Any]] = {
        "range check: ndarray.max (numpy reduction)": lambda: ids.view(np.uint64).max() >= 600,
        "range check: builtin max over the buffer": (
            lambda: max(ids.data.cast("B").cast("Q")) >= 600),
        "range check: builtin max/min over a list": lambda: max(lst) < 600 and min(lst) >= 0,
        "ids from a list: np.array(list, int64)": lambda: np.array(lst, dtype=np.int64),
        "table: np.multiply(ids, unit, out=table slice)": (
            lambda: np.multiply(ids.view(np.uint64), unit, out=table[320:576])),
        "table: fill a slice with one value": lambda: table.__setitem__(slice(832, 1088), unit),
        "table: copy the ids into a slice": (
            lambda: table.__setitem__(slice(320, 576), ids.view(np.uint64))),
        "table: ctypes slice from a list": lambda: words.__setitem__(slice(320, 576), lst),
        "3 words: numpy slice assignment": (
            lambda: table.__setitem__(slice(1, 4), check_words)),
        "3 words: ctypes.memmove of bytes": (
            lambda: ctypes.memmove(table.ctypes.data + 8, check_bytes, 24)),
        "3 words: struct.pack_into a memoryview": (
            lambda: _CHECK3.pack_into(table_bytes, 8, 2**64 - 1, 0, 0)),
        "3 words: a memoryview's slice from bytes": (
            lambda: table_bytes.__setitem__(slice(8, 32), check_bytes)),
        "3 words: a ctypes array, item by item": lambda: _set3(check_c),
        "fingerprint: blake2b of the ids": (
            lambda: hashlib.blake2b(ids.data, digest_size=8).digest()),
    }
    calls.update(_after_check_calls())
    out: dict[str, dict[str, float]] = {}
    for name, fn in calls.items():
        cold, hot = [], []
        for _ in range(args.reps):
            _sweep(torch, a, b)
            t0 = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - t0)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            hot.append(time.perf_counter() - t0)
        c, h = statistics.median(cold) * 1e6, statistics.median(hot) * 1e6
        out[name] = {"cold_us": round(c, 2), "hot_us": round(h, 2)}
        print(f"{name:50s} cold {c:7.1f} us   hot {h:6.1f} us")
    write_result("cold_calls", {"reps": args.reps, "ids": 256, "calls": out}, args.out)


if __name__ == "__main__":
    main()
