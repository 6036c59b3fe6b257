"""Integrity levels, and which of a request's blocks each level checks.

Both sides pick the same blocks from what both know (a salt and the block ids), so the
producer digests exactly what its consumer will check (:mod:`kvlink.sampling`)."""

from __future__ import annotations

import enum
import hashlib

import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError
from kvlink.sampling import picked


class Level(str, enum.Enum):
    """A deployment's integrity setting (docs/integrity.md): what each level checks is
    :func:`checked`'s."""

    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"

    @classmethod
    def parse(cls, value: object, key: str = "integrity") -> Level:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{key} must be one of {[m.value for m in cls]}, got {value!r}"
                              ) from None


def checked(level: Level, salt: str | int, remote_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which positions of a request's (remote) block ids are checked at ``level``.

    Deterministic in what both sides know — ``salt``: the hold's generation (a pull: what a
    reader's READ is told, so a cuda_ipc READ's launcher picks the same blocks from what it
    launches with, kvlink.gpu.lane.sample_order) or the request id (a push without a hold) — and
    the block ids, so the producer digests exactly what the consumer will check. ``sample``
    always keeps the last block (every reader reads the request's tail, whatever its own
    prefix hits)."""
    ids = np.asarray(remote_ids, dtype=np.int64)
    if level is Level.OFF or ids.size == 0:
        return np.zeros(ids.shape, dtype=bool)
    if level is Level.FULL:
        return np.ones(ids.shape, dtype=bool)
    return picked(salt if isinstance(salt, int) else _salt(salt), ids)  # (both below 2**64)


def _salt(req_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")
