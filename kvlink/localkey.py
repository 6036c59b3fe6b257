"""A key the processes of one engine share and nobody else on the host can read.

vLLM runs an engine's scheduler and its workers as separate processes; the scheduler tells its
workers to hold a request's blocks (:class:`kvlink.wire.Hold`) over the side channel, which any
local process can reach. A hold names the generation that lets a reader in
(:mod:`kvlink.grants`), so a forged one would open any block to its sender: holds are MAC'd
with this key. With a shared secret (``KVLINK_SECRET``) the key derives from it; without, it
is 32 random bytes in a file only this user can read (``$XDG_RUNTIME_DIR/kvlink`` or
``/tmp/kvlink-<uid>``, directory 0700, file 0600, created once, atomically), so the boundary is
the OS user — a process of the same user could read the engine's memory anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from kvlink.errors import ConfigError

_LABEL = b"kvlink-engine-key-v1"


def _directory() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvlink" if runtime else Path(tempfile.gettempdir()) / (
        f"kvlink-{os.getuid()}")
    base.mkdir(mode=0o700, exist_ok=True)
    st = base.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{base} must be a directory owned by uid {os.getuid()} with mode "
                          f"0700 (it is {oct(st.st_mode & 0o777)}, uid {st.st_uid}): refusing "
                          "to keep the engine key there")
    return base


def engine_key(engine_id: str, secret: bytes | None = None) -> bytes:
    """The key ``engine_id``'s processes MAC their holds with (see the module docstring)."""
    if secret is not None:
        return hmac.new(secret, _LABEL + engine_id.encode(), hashlib.sha256).digest()
    name = hashlib.sha256(engine_id.encode()).hexdigest()[:32] + ".key"
    path = _directory() / name
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    # written whole under a private name, then linked into place: link() fails if another
    # process got there first, and nobody ever sees a partly written key
    tmp = path.with_name(f".{name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read(path)


def _read(path: Path) -> bytes:
    key = path.read_bytes()
    if len(key) != 32:
        raise ConfigError(f"engine key {path} holds {len(key)} B, not 32: remove it")
    return key


def sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def verify(key: bytes, body: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(sign(key, body), mac)
