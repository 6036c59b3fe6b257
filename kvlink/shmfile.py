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
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time

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


def make(kind: Kind) -> Made:
    """Create a new board file (0o600, exclusive), sized and mapped, its header written, and
    locked (an exclusive ``flock`` on ``fd``, held for as long as the owner keeps ``fd`` open:
    a reader's liveness check, and what :func:`sweep` leaves alone). Raises OSError."""
    sweep(kind)  # first: boards of processes that died before they could unlink theirs
    name = f"{kind.prefix}{secrets.token_hex(16)}"
    token = secrets.token_bytes(TOKEN_BYTES)
    path = os.path.join(DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, kind.size)
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


SWEEP_AGE = 10.0  # seconds: a younger unlocked board may be one whose owner is just locking it
_swept: set[str] = set()  # kinds (prefixes) this process has swept


def sweep(kind: Kind, force: bool = False) -> int:
    """Unlink the boards of ``kind`` in /dev/shm that no live process holds — left by owners
    killed before they could unlink them (a hold board's arena keeps the digests it was
    given in memory until then). Once per process and kind (``force``: again). A board is
    someone's while its ``flock`` is held; only our own user's regular files of the kind's
    name pattern, older than :data:`SWEEP_AGE`, are considered. Returns how many went."""
    if kind.prefix in _swept and not force:
        return 0
    _swept.add(kind.prefix)
    try:
        names = [n for n in os.listdir(DIR) if kind.pattern.match(n)]
    except OSError:
        return 0
    gone = 0
    now = time.time()
    for name in names:
        path = os.path.join(DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or now - st.st_mtime < SWEEP_AGE):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            os.unlink(path)
            gone += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    if gone:
        log.info("unlinked %d %s* board(s) left in %s by processes that are gone", gone,
                 kind.prefix, DIR)
    return gone


def unmap(view: mmap.mmap) -> None:
    """Close a board's mapping; one whose buffer a numpy view still exports goes with the last
    reference instead (the caller has dropped its slots' view first)."""
    try:
        view.close()
    except BufferError:
        pass
