"""A board file in ``/dev/shm``: made by its owner, opened by a same-host peer that was told
its name and token. What the hold board (:mod:`kvlink.holdboard`) and the landing board
(:mod:`kvlink.landing`) share; their slots and rules are theirs.

Layout of the first 32 bytes: magic (8), slot count (8), token (16). The owner writes the
magic last, so a peer that sees it sees the rest. A peer opens only a regular file of the
board's exact size under a name of the board's pattern, with the magic, slot count and token
it was told — anything else is someone else's file, and the caller falls back to messages.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable

import numpy as np

log = logging.getLogger("kvlink.shmfile")

DIR = "/dev/shm"
TOKEN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of board: its file name prefix, magic, slot count and size in bytes."""

    prefix: str  # "kvlink-board-": names are the prefix and 32 hex digits
    magic: int
    slots: int
    size: int

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"\A{re.escape(self.prefix)}[0-9a-f]{{32}}\Z")


@dataclasses.dataclass
class Made:
    """A board its owner just made: the open file (``fd``), its mapping, name and token."""

    name: str
    token: bytes
    path: str
    fd: int
    map: mmap.mmap


def make(kind: Kind, before_map: Callable[[int], None] | None = None) -> Made:
    """Create a new board file (0o600, exclusive), sized and mapped, its header written;
    ``before_map(fd)`` runs on the new file first (the hold board's flock). Raises OSError."""
    name = f"{kind.prefix}{secrets.token_hex(16)}"
    token = secrets.token_bytes(TOKEN_BYTES)
    path = os.path.join(DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, kind.size)
        if before_map is not None:
            before_map(fd)
        view = mmap.mmap(fd, kind.size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    words = np.frombuffer(view, dtype=np.uint64, count=2)
    words[1] = kind.slots
    view[16:16 + TOKEN_BYTES] = token
    words[0] = kind.magic  # last: a peer that sees the magic sees the rest
    del words
    return Made(name, token, path, fd, view)


def open_board(kind: Kind, name: str, token: bytes, writable: bool, what: str
               ) -> tuple[int, mmap.mmap] | None:
    """A peer's board by the name and token it was told: ``(fd, mapping)``, or None (the
    reason logged at info: ``what`` names the board and the fallback) when it is not ours
    to use — not a board name, not on this host, another file, another token."""
    if not kind.pattern.match(name) or len(token) != TOKEN_BYTES:
        log.info("%s offer %r refused: not a board name", what, name)
        return None
    try:
        fd = os.open(os.path.join(DIR, name),
                     (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError as exc:
        log.info("%s %s not opened (%s)", what, name, exc)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != kind.size:
            raise OSError(errno.EINVAL, "not a board of this kind")
        view = (mmap.mmap(fd, kind.size) if writable
                else mmap.mmap(fd, kind.size, prot=mmap.PROT_READ))
        head = np.frombuffer(view, dtype=np.uint64, count=2)
        ok = (int(head[0]) == kind.magic and int(head[1]) == kind.slots
              and view[16:16 + TOKEN_BYTES] == token)
        del head
        if not ok:
            view.close()
            raise OSError(errno.EINVAL, "another board (magic or token differ)")
    except OSError as exc:
        os.close(fd)
        log.info("%s %s refused (%s)", what, name, exc)
        return None
    return fd, view


def unmap(view: mmap.mmap) -> None:
    """Close a board's mapping; one whose buffer a numpy view still exports goes with the last
    reference instead (the caller has dropped its slots' view first)."""
    try:
        view.close()
    except BufferError:
        pass
