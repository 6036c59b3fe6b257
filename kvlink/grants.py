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
from collections.abc import Sequence
from types import ModuleType

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


_TICKET_MAX = 64  # bytes of a ticket a state holds (ours are 16)
#: words of a connection's state (:meth:`Grants.new_state`), as kvlink's C gate lays them out
#: (``_gate.c``): the halt word first (what the byte mover reads between socket calls), then
#: fenced, serving, the ticket's length and its bytes
STATE_WORDS = 4 + _TICKET_MAX // 4
_HALT, _FENCED, _BUSY, _TLEN, _TICKET = 0, 1, 2, 3, 4
_OPS = (Op.READ, Op.WRITE)  # (the C gate's op numbers)
_CHECK = 1 << 16  # extents per numpy pass of Python's check: temporaries O(this), not O(request)
#: what a refused :meth:`Grants.enter` answers where the connection was fenced
FENCED = "fenced"
_NO_GRANT, _OTHER_OP, _OUTSIDE = 1, 2, 3  # (the C gate's answers; 4: fenced)


def _reason(code: int, op: Op) -> str | None:
    """A check's answer as a reason (None: granted)."""
    if code == 0:
        return None
    if code == _NO_GRANT:
        return "no grant for this transfer (its ticket is unknown, or was revoked: the " \
               "hold was released or the push ended)"
    if code == _OTHER_OP:
        other = Op.WRITE if op is Op.READ else Op.READ
        return f"the grant is for {other.value.upper()}, not {op.value.upper()}"
    if code == _OUTSIDE:
        return "the transfer reaches outside the blocks granted to it"
    return FENCED


def _window(ticket: bytes, op: Op, extents: Extents) -> Window:
    if len(ticket) > _TICKET_MAX:
        raise ValueError(f"ticket: {len(ticket)} bytes, at most {_TICKET_MAX}")
    ext = np.asarray(extents, dtype=EXTENT_DTYPE)
    return Window(op, merge(ext["addr"].astype(np.uint64), ext["len"].astype(np.uint64)))


def make_grants(helpers: ModuleType | None) -> Grants:
    """kvlink's C gate where its helpers are built (:class:`CGrants`), else Python's."""
    return CGrants(helpers) if helpers is not None else Grants()


class Grants:
    """The windows one transport serves peers' transfers in, keyed by ticket, and which of its
    connections is serving under which ticket — under one lock, so that a check and the mark
    that a connection serves under it are one step, and so are a revoke and the cut of those
    serving under its ticket: a transfer is refused, or seen by the revoke that stops it.

    A connection's state is a small array (:meth:`new_state`) its serving thread keeps; its
    first word is the halt word the byte mover reads between socket calls. This is Python's
    form; :class:`CGrants` keeps the same in kvlink's C gate, with the same answers
    (tests/test_grants.py runs both). Thread-safe: the worker grants and revokes on its
    threads while serving threads check."""

    #: the C gate tcp's C serving loop checks READs against (None: none, this is Python's)
    gate: object | None = None

    def __init__(self) -> None:
        self._lock = threading.Condition()  # the windows, and the states' words
        self._windows: dict[bytes, Window] = {}

    @staticmethod
    def new_state() -> npt.NDArray[np.uint32]:
        """A connection's state: serving nothing, not fenced."""
        return np.zeros(STATE_WORDS, dtype=np.uint32)

    @staticmethod
    def halted(state: npt.NDArray[np.uint32]) -> bool:
        """Whether the connection is to stop before its next socket call (fenced, or the
        ticket it serves under revoked)."""
        return bool(state[_HALT])

    @staticmethod
    def fenced(state: npt.NDArray[np.uint32]) -> bool:
        return bool(state[_FENCED])

    def grant(self, ticket: bytes, op: Op, extents: Extents) -> None:
        """``ticket`` may do ``op`` inside ``extents`` (replacing what it had)."""
        window = _window(ticket, op, extents)
        with self._lock:
            self._windows[bytes(ticket)] = window

    def revoke(self, ticket: bytes) -> bool:
        """End ``ticket``'s window (whether it had one); see :meth:`cut` for those serving."""
        with self._lock:
            return self._windows.pop(bytes(ticket), None) is not None

    def check(self, ticket: bytes, op: Op, ext: Extents) -> str | None:
        """None when ``ext`` may be served as ``op`` under ``ticket``; else why not."""
        with self._lock:
            return self._why_not(bytes(ticket), op, ext)

    def enter(self, state: npt.NDArray[np.uint32], ticket: bytes, op: Op, ext: Extents,
              check: bool = True) -> str | None:
        """A connection starts serving ``op`` on ``ext`` under ``ticket``: None, marked serving
        under it (the halt word cleared) in the step that checked it (``check``; else only
        whether it is fenced), or why not (:data:`FENCED` where it was), nothing marked. A
        connection that entered leaves (:meth:`leave`) once its bytes moved or failed."""
        with self._lock:
            if state[_FENCED]:
                return FENCED
            why = self._why_not(bytes(ticket), op, ext) if check else None
            if why is None:  # (one longer than any grant, unchecked: served as no ticket)
                mark = bytes(ticket) if len(ticket) <= _TICKET_MAX else b""
                padded = mark.ljust(_TICKET_MAX, b"\0")
                state[_TICKET:] = np.frombuffer(padded, dtype=np.uint32)
                state[_TLEN], state[_BUSY], state[_HALT] = len(mark), 1, 0
            return why

    def _why_not(self, ticket: bytes, op: Op, ext: Extents) -> str | None:
        """(under the lock) What :meth:`check` answers."""
        window = self._windows.get(ticket)
        if window is None:
            return _reason(_NO_GRANT, op)
        if window.op is not op:
            return _reason(_OTHER_OP, op)
        for k in range(0, max(ext.shape[0], 1), _CHECK):  # O(_CHECK) numpy temporaries
            if not window.covers(ext[k : k + _CHECK]):
                return _reason(_OUTSIDE, op)
        return None

    def leave(self, state: npt.NDArray[np.uint32]) -> None:
        """The connection is no longer serving (a :meth:`wait` on it may end)."""
        with self._lock:
            state[_BUSY] = state[_TLEN] = 0
            self._lock.notify_all()

    def fence(self, state: npt.NDArray[np.uint32]) -> None:
        """The connection serves nothing more, and stops before its next socket call."""
        with self._lock:
            state[_FENCED] = state[_HALT] = 1

    def cut(self, ticket: bytes, states: Sequence[npt.NDArray[np.uint32]]) -> list[int]:
        """The indices of ``states`` serving under ``ticket``, each told to stop before its
        next socket call (their halt word set). After :meth:`revoke`, no other can start."""
        with self._lock:
            busy = [i for i, s in enumerate(states) if self._serves(s, bytes(ticket))]
            for i in busy:
                states[i][_HALT] = 1
            return busy

    def wait(self, ticket: bytes, states: Sequence[npt.NDArray[np.uint32]],
             timeout: float) -> bool:
        """Whether, within ``timeout`` s, none of ``states`` serves under ``ticket`` any
        more."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not any(self._serves(s, bytes(ticket)) for s in states),
                max(timeout, 0.0))

    def serving(self, state: npt.NDArray[np.uint32]) -> bytes | None:
        """The ticket the connection serves under, if it is serving."""
        with self._lock:
            return state[_TICKET:].tobytes()[: int(state[_TLEN])] if state[_BUSY] else None

    @staticmethod
    def _serves(state: npt.NDArray[np.uint32], ticket: bytes) -> bool:
        return bool(state[_BUSY]) and state[_TICKET:].tobytes()[: int(state[_TLEN])] == ticket

    def __len__(self) -> int:
        with self._lock:
            return len(self._windows)


class CGrants(Grants):
    """:class:`Grants` kept in kvlink's C gate (``_gate.c``: its own mutex, never held across a
    socket call or a wait for the GIL), which tcp's C serving loop checks and marks READs in
    without the GIL."""

    def __init__(self, helpers: ModuleType) -> None:  # (no Python windows or lock: the gate's)
        self._c = helpers
        self.gate = helpers.gate_new()

    def grant(self, ticket: bytes, op: Op, extents: Extents) -> None:
        window = _window(ticket, op, extents)
        self._c.gate_grant(self.gate, ticket, _OPS.index(op), window.starts, window.ends)

    def revoke(self, ticket: bytes) -> bool:
        return bool(self._c.gate_revoke(self.gate, ticket))

    def check(self, ticket: bytes, op: Op, ext: Extents) -> str | None:
        return self._enter(None, ticket, op, ext, True)

    def enter(self, state: npt.NDArray[np.uint32], ticket: bytes, op: Op, ext: Extents,
              check: bool = True) -> str | None:
        return self._enter(state, ticket, op, ext, check)

    def _enter(self, state: npt.NDArray[np.uint32] | None, ticket: bytes, op: Op, ext: Extents,
               check: bool) -> str | None:
        ext = np.ascontiguousarray(ext, dtype=EXTENT_DTYPE)
        return _reason(self._c.gate_enter(self.gate, state, ticket, _OPS.index(op), ext, check),
                       op)

    def leave(self, state: npt.NDArray[np.uint32]) -> None:
        self._c.gate_leave(self.gate, state)

    def fence(self, state: npt.NDArray[np.uint32]) -> None:
        self._c.gate_fence(self.gate, state)

    def cut(self, ticket: bytes, states: Sequence[npt.NDArray[np.uint32]]) -> list[int]:
        return list(self._c.gate_cut(self.gate, ticket, list(states)))

    def wait(self, ticket: bytes, states: Sequence[npt.NDArray[np.uint32]],
             timeout: float) -> bool:
        return bool(self._c.gate_wait(self.gate, ticket, list(states),
                                      max(0, int(timeout * 1000))))

    def serving(self, state: npt.NDArray[np.uint32]) -> bytes | None:
        got = self._c.gate_serving(self.gate, state)
        return None if got is None else bytes(got)

    def __len__(self) -> int:
        return int(self._c.gate_len(self.gate))
