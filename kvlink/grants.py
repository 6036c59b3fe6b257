"""Capabilities on the data plane: which peer may touch which bytes of our memory, for what.

A handshake hands a peer what it needs to *reach* our memory (addresses, the tcp memory key,
NIXL metadata); it must not be what lets it *touch* any byte. Instead, every transfer against
our memory presents a **ticket**, and a transport that serves peers' transfers on the owner's
side (tcp) serves it only inside the **window** the owner granted under that ticket, and only
for the operation granted:

- pull: a producer's hold grants READ over the held blocks under :func:`read_ticket` (request
  id, hold generation); the reader learns the generation with the block ids (vLLM's
  ``kv_transfer_params``, the standalone ``hold()`` answer) or from a read intent's grant.
  Release revokes it: a READ after the lease ended is refused by the owner, not only caught by
  validate-after-read.
- push: a decode grants WRITE over the blocks it reserved for one push attempt under
  :func:`push_ticket` (request id, the attempt's random push id); the push ending, failing or
  being cancelled revokes it, so a late WRITE is refused where the blocks live.

Tickets are keyed hashes of values that are random per hold or push (62 bits from
``secrets``), so they cannot be guessed from request ids or counters; they travel only with
the request's own parameters. What each transport can enforce is listed in docs/security.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np
import numpy.typing as npt

from kvlink import native
from kvlink.layout import KVCacheSpec
from kvlink.transport import EXTENT_DTYPE, Extents, Op

_TICKET_KEY = b"kvlink-grant-v1"


def _ticket(kind: bytes, req_id: str, value: int) -> bytes:
    h = hashlib.blake2b(key=_TICKET_KEY, digest_size=16)
    h.update(kind + b"\0" + req_id.encode("utf-8", "surrogatepass") + b"\0")
    h.update(value.to_bytes(8, "little", signed=False))
    return h.digest()


def read_ticket(req_id: str, generation: int) -> bytes:
    """The ticket a READ of ``req_id``'s hold ``generation`` presents (pull)."""
    return _ticket(b"read", req_id, generation)


def push_ticket(req_id: str, push_id: int) -> bytes:
    """The ticket a push attempt's WRITE presents (its decode granted it)."""
    return _ticket(b"push", req_id, push_id)


def block_extents(spec: KVCacheSpec, block_ids: npt.ArrayLike) -> Extents:
    """Every byte ``block_ids`` stand for in ``spec``'s cache, all layers and planes, merged
    into as few extents as adjacency allows (what a window grants)."""
    ids = np.unique(np.asarray(block_ids, dtype=np.uint64).reshape(-1))
    base = spec.plane_base.reshape(-1)[:, None]
    stride = spec.block_stride.reshape(-1)[:, None]
    addr = (base + ids[None, :] * stride).reshape(-1)
    return merge(addr, np.full(addr.shape, spec.page_bytes, dtype=np.uint64))


def merge(addr: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64]) -> Extents:
    """Sorted, non-overlapping union of the ranges ``[addr, addr + length)``."""
    out = np.empty(0, dtype=EXTENT_DTYPE)
    if addr.size == 0:
        return out
    order = np.argsort(addr, kind="stable")
    a, n = addr[order], length[order]
    end = np.maximum.accumulate(a + n)
    # a new range starts where it begins past everything before it
    start = np.empty(a.shape, dtype=bool)
    start[0] = True
    start[1:] = a[1:] > end[:-1]
    first = np.flatnonzero(start)
    last = np.append(first[1:] - 1, a.shape[0] - 1)
    out = np.empty(first.shape[0], dtype=EXTENT_DTYPE)
    out["addr"] = a[first]
    out["len"] = end[last] - a[first]
    return out


def covers(window: Extents, ext: Extents) -> bool:
    """Whether every extent of ``ext`` lies inside one range of ``window`` (sorted, merged)."""
    return Window(Op.READ, window).covers(ext)


@dataclasses.dataclass(frozen=True)
class Window:
    """What a ticket may touch: ``extents`` (sorted, merged: see merge) for ``op``."""

    op: Op
    extents: Extents
    #: the ranges as RegionTable holds regions (kvlink.native's ``inside`` takes them)
    starts: npt.NDArray[np.uint64] = dataclasses.field(init=False, repr=False)
    ends: npt.NDArray[np.uint64] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = np.ascontiguousarray(self.extents["addr"], dtype=np.uint64)
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "ends", starts + self.extents["len"].astype(np.uint64))

    def covers(self, ext: Extents) -> bool:
        """Whether every extent of ``ext`` lies inside one of our ranges: one call of the C
        helper where it is built (the owner checks every READ with it before a byte moves),
        else numpy."""
        if ext.shape[0] == 0:
            return True
        if self.starts.shape[0] == 0:
            return False
        helpers = native.load()
        if helpers is not None and ext.dtype == EXTENT_DTYPE and ext.flags.c_contiguous:
            return bool(helpers.inside(self.starts, self.ends, ext, None) < 0)
        addr = ext["addr"]
        end = addr + ext["len"]  # uint64: a range that wraps past 2**64 ends below its start
        at = np.searchsorted(self.starts, addr, side="right") - 1
        if at.min() < 0:
            return False
        return bool(np.all((end >= addr) & (end <= self.ends[at])))


class Grants:
    """The windows one transport serves peers' transfers in, keyed by ticket. Thread-safe:
    the worker grants and revokes on its threads while the transport's serving threads check."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[bytes, Window] = {}

    def grant(self, ticket: bytes, op: Op, extents: Extents) -> None:
        ext = np.asarray(extents, dtype=EXTENT_DTYPE)
        window = Window(op, merge(ext["addr"].astype(np.uint64), ext["len"].astype(np.uint64)))
        with self._lock:
            self._windows[bytes(ticket)] = window

    def revoke(self, ticket: bytes) -> bool:
        with self._lock:
            return self._windows.pop(bytes(ticket), None) is not None

    def check(self, ticket: bytes, op: Op, ext: Extents) -> str | None:
        """None when ``ext`` may be served as ``op`` under ``ticket``; else why not."""
        with self._lock:
            window = self._windows.get(bytes(ticket))
        if window is None:
            return "no grant for this transfer (its ticket is unknown, or was revoked: the " \
                   "hold was released or the push ended)"
        if window.op is not op:
            return f"the grant is for {window.op.value.upper()}, not {op.value.upper()}"
        if not window.covers(ext):
            return "the transfer reaches outside the blocks granted to it"
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._windows)
