"""The transport contract and the plugin registry.

A transport moves bytes between registered memory of two processes and knows nothing of
requests, blocks or vLLM: it gets extent arrays and hands back handles. Plugins register under
the entry-point group ``kvlink.transports`` so a third-party package can add one without touching
kvlink; :func:`register_transport` does the same in-process (tests, notebooks).

The contract every transport obeys (``tests/test_transport_contract.py`` checks it against tcp,
nixl and mooncake):

1. **FAILED means quiescent.** A handle reports FAILED only once the transport has nothing of
   it in flight: every library request or sub-batch it started has finished, errored, or been
   released/aborted in a way the library guarantees moves no further bytes, and no thread of
   the transport is still reading or writing its memory. A handle with any part still moving
   stays PENDING, and then reports the first error. Why: the caller frees or reuses the blocks
   of a FAILED transfer at once (a decode hands them to the next request; a prefill's lease
   frees them), so a byte landing later would corrupt someone else's KV. What the initiator
   cannot see: for a WRITE, bytes the network already accepted may still be applied by the
   target; only the target can rule that out, with :meth:`Transport.fence`.
2. **post never raises for peer or runtime conditions.** An unknown, disconnected or dropped
   peer, a closed transport, a refusal by the remote side or an error of the library all give a
   handle whose :meth:`~Transport.poll` is FAILED with a reason naming the peer. ``post``
   raises only for caller bugs, before anything moves: :class:`~kvlink.errors.ExtentOutOfBounds`
   for extent arrays that do not pair up, local extents outside our registered memory, or
   remote extents outside the regions the peer's descriptor offered; and
   :class:`~kvlink.errors.TransportUnavailable` for an option the transport lacks (mooncake: a
   native notification).
3. **disconnect(peer) fails only that peer's handles**, each once it is quiescent (rule 1);
   other peers' transfers go on and finish DONE.
4. **close() is bounded.** It returns within about 2 s whatever peers do, having stopped the
   transport's threads, closed its listening sockets (the port refuses connections) and its
   inbound connections, so that a peer's READ or WRITE after close fails. Rule 1 still holds
   after close: a transfer stuck in a library call that cannot be interrupted (mooncake's
   batch wait on a hung peer) stays PENDING, and its memory stays registered, until that call
   returns at the library's own timeout; that thread ends then.
5. **fence(peer, timeout) -> bool** (optional): True means no byte from transfers that
   ``peer`` initiated against our memory can land any more; its one-sided access stays revoked
   until it connects again (our :meth:`~Transport.connect` for it, after a new handshake).
   The default returns False ("cannot guarantee"). A decode uses it in push mode to free the
   blocks of a timed-out push whose prefill cannot answer a cancel.
6. **Stream order** (GPU memory): a copy a transport runs on the device starts only after the
   work enqueued on the caller's current stream of its device when ``post`` was called (READ
   destination and WRITE source alike), and DONE means the bytes are there. A transport whose
   library copies on streams of its own (nixl, mooncake) hands the transfer to the library only
   once that work ran (:class:`kvlink.staging.StreamMarks`: nixl at a later poll, mooncake on
   its peer's thread); the caller never blocks. Optional hook
   ``completion_event(handle) -> torch.cuda.Event | None`` (cuda_ipc): an event complete once
   the handle's device copy has ended (recorded on the copy's stream at the first ask: it may
   also wait for copies posted in between, never for less), so a caller can order its own
   stream after it without a host sync (``stream.wait_event(ev)``); None where there is none.
   It says the copy has ended, not that it succeeded: :meth:`~Transport.poll` says that.
   Optional hook ``ends_in(handle) -> float | None`` (cuda_ipc): seconds until the handle's
   transfer should have ended, by the transport's own estimate (None: it cannot tell); the
   worker's poll waits up to ``poll_grace_us`` for one about to end, polling it in a loop
   that holds the GIL: a transport whose own Python threads move the bytes must not offer it.
   :class:`kvlink.worker.KVWorker` posts from ``read``/``write`` when the peer's handshake is
   cached, else from
   :meth:`~kvlink.worker.KVWorker.poll`, so the stream that counts is the current stream of
   the thread posting: poll from the thread (and stream) that called ``read``/``write``.
7. **post_runs(op, peer, runs) -> handle** (optional): :meth:`~Transport.post` of
   ``runs.expand()`` (:class:`Runs`) without the host expanding it; same contract as post.
   cuda_ipc implements it (its kernel computes the addresses); the worker uses it where the
   plan takes that form. **lane(op, peer, local_base, remote_base, unit, blocks,
   digests=None)** (optional): an object whose ``post(local_ids, remote_ids, generation=0,
   sample=False)``
   is post_runs of one run of ``unit`` bytes per block pair over those segment bases, with
   what does not change between requests of the pair worked out once (cuda_ipc:
   :mod:`kvlink.gpu.lane`) and ids at or past ``blocks`` (ours, the peer's) refused by the
   transport (the handle FAILED, naming the id); same contract, or None where it cannot take
   a request (then post_runs/post). With ``digests`` (:class:`LaneDigests`) a READ lane
   digests what it lands and compares it with the rows of the hold ``generation`` names on
   the producer's hold board — every block's, or with ``sample`` the blocks it picks as the
   producer did (kvlink.integrity.checked, by the generation); ``landed_check(handle)`` says
   how it went. The worker keeps
   one per peer and plan table, for transports that enforce no grants (it takes no ticket).
   Optional hook ``end_probe(handle) -> Callable[[], int | None] | None`` (cuda_ipc's lane
   posts): a call that says, without the transport's bookkeeping of the end, None while the
   transfer moves, else how it ended: -1 where :meth:`~Transport.poll` must say (FAILED, or a
   digest lane whose kernel did not find every digest equal), else DONE and the digest rows
   found equal (0 for a plain lane). :meth:`~Transport.poll` or :meth:`~Transport.release`
   still take the end as they would have (release accounts a DONE nobody polled).
8. **Grants** (:mod:`kvlink.grants`): every ``post`` names the ``ticket`` its owner granted.
   A transport that serves peers' transfers on the owner's side and declares
   ``Capabilities.enforces_grants`` serves, when its context says ``require_grants``, only
   transfers whose ticket has a live :meth:`~Transport.grant` for that operation covering
   every extent; anything else is refused (the initiator's handle FAILED, naming why) and
   counted in ``TransportStats.refused``. Others accept the ticket and cannot check it
   (docs/security.md says what each one enforces).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from kvlink import native
from kvlink.errors import ExtentOutOfBounds, TransportUnavailable, UnknownTransportError

log = logging.getLogger("kvlink.transport")

ENTRY_POINT_GROUP = "kvlink.transports"

#: One contiguous byte range: absolute address in the owning process, and length.
EXTENT_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u8")])
Extents = npt.NDArray[np.void]


def make_extents(addr: npt.ArrayLike, length: npt.ArrayLike) -> Extents:
    """Build an extent array from parallel address and length arrays (broadcast)."""
    a, n = np.broadcast_arrays(np.asarray(addr, dtype=np.uint64),
                               np.asarray(length, dtype=np.uint64))
    out = np.empty(a.shape[0] if a.ndim else 1, dtype=EXTENT_DTYPE)
    out["addr"] = a.reshape(-1)
    out["len"] = n.reshape(-1)
    return out


class Op(enum.Enum):
    READ = "read"
    WRITE = "write"


class XferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class XferState:
    status: XferStatus
    reason: str = ""
    #: FAILED because the owner refused it before any byte moved (no grant for it, out of its
    #: bounds): posting it again may succeed once the owner grants it
    refused: bool = False


PENDING = XferState(XferStatus.PENDING)
DONE = XferState(XferStatus.DONE)


@dataclasses.dataclass(frozen=True)
class Region:
    """Memory a process registers once and offers to peers."""

    addr: int
    nbytes: int
    device: str = "cpu"  # "cpu" or "cuda:N" (N = local device ordinal)

    @property
    def memory_kind(self) -> str:
        return self.device.split(":", 1)[0]


@dataclasses.dataclass(frozen=True)
class Runs:
    """A request's extents in factored form, for a transport that need not expand them
    (optional hook ``post_runs``: cuda_ipc computes the addresses on its device, nixl the
    prepped-list indices from the segments' first blocks): extent (s, r) is
    ``local_base[s] + local_at[r]`` <->
    ``remote_base[s] + remote_at[r]``, ``lens[r]`` bytes — segments x runs extents described
    by segments + runs numbers. The planner makes it (``kvlink.plan.PlanTable.runs``) where a
    request has that form; :meth:`expand` gives the plain extents, in the planner's order."""

    local_base: npt.NDArray[np.uint64]  # [segments]
    remote_base: npt.NDArray[np.uint64]
    local_at: npt.NDArray[np.uint64]  # [runs] byte offset of the run's first block
    remote_at: npt.NDArray[np.uint64]
    lens: npt.NDArray[np.uint64]  # [runs]
    raw_descriptors: int  # extent count before coalescing (the planner's count)
    #: bytes of one segment's runs and of the longest run (-1: computed from ``lens``); the
    #: planner knows both, and a transport's post needs them: no reduction on the post path
    run_bytes: int = -1
    longest: int = -1

    @classmethod
    def of_blocks(cls, local_base: npt.NDArray[np.uint64], remote_base: npt.NDArray[np.uint64],
                  local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64],
                  unit: int, raw_descriptors: int,
                  lens: npt.NDArray[np.uint64] | None = None) -> Runs:
        """One run of ``unit`` bytes per block pair (int64 ids, in range): a block's offset
        is its id x ``unit`` (segments whose block stride is their unit). ``lens``: the ``n``
        units where the caller keeps them (else made here)."""
        u, n = np.uint64(unit), int(local_ids.shape[0])
        return cls(local_base, remote_base, local_ids.view(np.uint64) * u,
                   remote_ids.view(np.uint64) * u,
                   np.full(n, unit, dtype=np.uint64) if lens is None else lens,
                   raw_descriptors, n * unit, unit)

    @property
    def descriptors(self) -> int:
        return int(self.local_base.shape[0]) * int(self.lens.shape[0])

    @property
    def nbytes(self) -> int:
        per = self.run_bytes if self.run_bytes >= 0 else int(self.lens.sum())
        return int(self.local_base.shape[0]) * per

    @property
    def longest_run(self) -> int:
        return self.longest if self.longest >= 0 else int(self.lens.max(initial=0))

    def expand(self, alloc: Callable[[int], Extents] | None = None) -> ExpandedRuns:
        segs, runs = self.local_base.shape[0], self.lens.shape[0]
        make = alloc or (lambda n: np.empty(n, dtype=EXTENT_DTYPE))
        local, remote = make(segs * runs), make(segs * runs)
        np.add(self.local_base[:, None], self.local_at[None, :],
               out=local["addr"].reshape(segs, runs))
        np.add(self.remote_base[:, None], self.remote_at[None, :],
               out=remote["addr"].reshape(segs, runs))
        local["len"].reshape(segs, runs)[...] = self.lens
        remote["len"] = local["len"]
        return ExpandedRuns(local, remote, self.raw_descriptors)


class PerBases:
    """What a transport works out once per peer's segment bases (:class:`Runs`'
    ``local_base`` / ``remote_base``) and reads on every post. The planner hands every
    request of a peer pair its table's read-only arrays: those are kept by identity (held
    with the answer, so their ids are not reused); an array that can be written — a caller
    may refill one — is kept by what it holds. ``owner``: another object the answer depends
    on (kept by identity too). Bounded; callers serialise their calls (their lock or the
    GIL: a race only works an answer out twice)."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._memo: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}

    def get(self, make: Callable[[], Any], owner: object, *bases: npt.NDArray[Any]) -> Any:
        if any(b.flags.writeable for b in bases):
            key: tuple[Any, ...] = (id(owner), *(b.tobytes() for b in bases))
            held: tuple[Any, ...] = (owner,)
        else:
            key, held = (id(owner), *(id(b) for b in bases)), (owner, *bases)
        got = self._memo.get(key)
        if got is None or any(a is not b for a, b in zip(got[0], held)):
            if len(self._memo) > self._limit:
                self._memo.clear()
            got = self._memo[key] = (held, make())
        return got[1]

    def clear(self) -> None:
        self._memo.clear()


@dataclasses.dataclass(frozen=True)
class ExpandedRuns:
    local: Extents
    remote: Extents
    raw_descriptors: int


@dataclasses.dataclass(slots=True)  # not frozen: made per READ posted the general way
class DigestJob:
    """Integrity digests (kvlink.integrity) a transport that copies on its device computes of
    what it lands, while it copies, and compares with the producer's: the optional keyword
    ``digest`` of ``post_runs`` where the transport has ``fuses_digests`` (a READ no digest
    lane takes: :class:`LaneDigests`); its ``landed_check(handle)`` then says, once DONE,
    whether they all matched and how many rows it compared (None where it could not fuse them
    for this post: the caller digests itself). Made by the consumer's integrity checker; the
    transport knows nothing of what the numbers mean."""

    geometry: int  # device pointer: the consumer's views (heads, tokens, ... then per plane)
    weights: int  # device pointer: the digest's weights
    planes: int  # layers x K|V planes the views hold
    heads: int  # heads per plane (rank-local)
    page_bytes: int  # one block's page of one plane
    blocks: int  # of the request
    count: int  # expected rows
    rows: npt.NDArray[np.int64]  # [blocks] each block's expected row, -1: not checked
    expect: int  # host address of expected row 0: [count][planes][heads] little-endian u64
    region: tuple[int, int]  # the host mapping both lie in: (address, bytes)


class LaneDigests(NamedTuple):
    """A READ lane that digests what it lands while it copies and compares it with the
    producer's rows, which its kernel finds on the producer's hold board from each post's
    generation (the ``digests`` of a transport's ``lane`` hook, where it has
    ``fuses_digests``): so the host reads nothing of them before the launch, and a request
    with integrity on posts what one with it off does. Made by the consumer once per peer;
    the transport knows nothing of what the numbers mean."""

    page_bytes: int  # one block's page of one plane
    geometry: int  # device pointer: the consumer's views (as DigestJob)
    weights: int  # device pointer: the digest's weights
    planes: int  # layers x K|V planes the views hold
    heads: int  # heads per plane (rank-local)
    board: tuple[int, int]  # the producer's hold board mapping: (host address, bytes)
    layout: tuple[int, int, int, int]  # where a hold lies on it (kvlink.holdboard.LAYOUT)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    ops: frozenset[Op]
    memory_kinds: frozenset[str]
    same_host_only: bool = False
    native_notifications: bool = True
    #: its transfers progress on Python threads of its own (they need the GIL): a caller that
    #: polls in a tight loop must yield it, or each of their steps waits out the interpreter's
    #: switch interval (5 ms) — measured 24 ms instead of 5 for a 10 MiB tcp READ
    python_threads: bool = False
    #: serves peers' transfers only inside granted windows (contract rule 8)
    enforces_grants: bool = False


@dataclasses.dataclass(frozen=True)
class TransportContext:
    """What every transport needs to know about the process it lives in."""

    agent_name: str  # unique per process and restart: engine id + rank + nonce
    host: str = "127.0.0.1"  # address to bind data-plane listeners on
    advertise_host: str | None = None  # address peers should dial (defaults to host)
    host_id: str = ""  # identifies the physical host (same-host transports compare it)
    #: serve a peer's transfer only under a live grant (rule 8); False: any peer that passed
    #: the handshake may touch all registered memory (a transport used on its own)
    require_grants: bool = False


@dataclasses.dataclass
class TransportStats:
    """Counters a worker aggregates into kvlink's stats (and Prometheus, in the vLLM facade)."""

    transfers: int = 0
    failed: int = 0
    refused: int = 0  # peers' transfers against our memory refused (no grant, out of bounds)
    bytes: int = 0
    descriptors: int = 0
    post_seconds: float = 0.0
    xfer_seconds: float = 0.0

    def add(self, other: TransportStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Transport(abc.ABC):
    """Base class of every transport plugin (see DESIGN.md, "Transport contract")."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.options: Mapping[str, Any] = dict(options or {})
        self.stats = TransportStats()
        self._stats_lock = threading.Lock()

    @abc.abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Register memory once; extents posted later must fall inside these regions."""

    @abc.abstractmethod
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to :meth:`connect` (sent inside the handshake)."""

    def unreachable_reason(self, peer_descriptor: bytes, same_host: bool) -> str | None:
        """Why this transport cannot serve the peer (None when it can). Checked before connect."""
        if self.capabilities.same_host_only and not same_host:
            return f"{self.name} needs both processes on one host"
        return None

    @abc.abstractmethod
    def connect(self, peer: str, descriptor: bytes) -> None:
        """Open the data path to a peer. Reconnecting an existing name replaces the old peer."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer. Its transfers still in flight are stopped where the library can stop
        them and turn FAILED once quiescent (contract rules 1 and 3); other peers' transfers
        are untouched. Posting to the peer afterwards gives a FAILED handle."""

    @abc.abstractmethod
    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",
    ) -> int:
        """Start one transfer of all extents (READ: remote -> local, WRITE: local -> remote).

        ``ticket``: the grant the peer made for it (contract rule 8; empty: none).

        Never raises for the peer's or the library's state: a transfer that cannot start gives
        a handle that polls FAILED with a reason naming the peer (contract rule 2). Raises
        :class:`~kvlink.errors.ExtentOutOfBounds` for caller bugs only (arrays that do not pair
        up, extents outside our registered memory or outside what the peer offered)."""

    @abc.abstractmethod
    def poll(self, handle: int) -> XferState:
        """Non-blocking progress check. FAILED only once nothing of the transfer can still
        move (contract rule 1); the reason is the first error seen."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Free the handle's resources; it must not be polled again. Releasing a PENDING
        handle abandons it: the transport stops what it can and forgets the rest."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain (peer agent name, message) notifications received since the last call."""

    @abc.abstractmethod
    def notify(self, peer: str, message: bytes) -> None:
        """Send a standalone notification to a connected peer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads, close listening sockets and inbound connections, release memory
        registrations; return within about 2 s whatever peers do. Idempotent.

        After close the port (if any) refuses connections and a peer's READ or WRITE fails;
        every handle still PENDING turns FAILED once quiescent (contract rule 4)."""

    def fence(self, peer: str, timeout: float) -> bool:
        """Revoke ``peer``'s one-sided access to our memory; True once no byte from transfers
        it initiated can land any more.

        The revocation lasts until :meth:`connect` is called for ``peer`` again (a new
        handshake). False means the transport cannot guarantee it within ``timeout`` seconds
        (the default: most libraries give no such handle on a remote initiator). Why: a decode
        that pushed block ids to a prefill which then stopped answering must know the prefill's
        WRITEs can no longer land before it reuses those blocks."""
        return False

    def grant(self, ticket: bytes, op: Op, extents: Extents) -> None:
        """Let peers presenting ``ticket`` run ``op`` on ``extents`` of our memory, until
        :meth:`revoke` (contract rule 8). Default: nothing to enforce with."""
        return None

    def revoke(self, ticket: bytes, timeout: float = 0.0) -> bool:
        """End the grant of ``ticket``: the owner refuses its transfers from now on. True once,
        within ``timeout`` s, no transfer under it is still touching our memory (so a WRITE
        window's blocks may be reused); False where the transport cannot tell (the default)."""
        return False

    def extents(self, n: int) -> Extents:
        """An uninitialised array of ``n`` extents in the memory this transport posts from
        fastest. Planners build a request's extents here; the default is ordinary memory.
        (cuda_ipc: pinned memory its copy kernel reads in place, saving a copy per post.)"""
        return np.empty(n, dtype=EXTENT_DTYPE)

    def expect_access(self, seconds: float, count: int = 1) -> None:
        """Hint: ``count`` one-sided transfers by peers into or out of our memory, each ending
        with a notification, will arrive within ``seconds``.

        A transport whose peers' transfers need this side's progress to complete (NIXL/UCX: the
        initiator's READ with a notification is DONE only once this side's UCX worker has
        progressed, see docs/nixl.md "Progress") can serve them promptly for that window instead
        of at its idle cadence. Default: nothing to do.
        """
        return None

    def wait(self, handle: int, timeout: float) -> XferState:
        """Poll until the handle leaves PENDING or ``timeout`` seconds pass (then FAILED)."""
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while True:
            state = self.poll(handle)
            if state.status is not XferStatus.PENDING:
                return state
            if time.monotonic() >= deadline:
                return XferState(XferStatus.FAILED, f"timed out after {timeout:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _account(self, **delta: float) -> None:
        with self._stats_lock:
            for key, value in delta.items():
                setattr(self.stats, key, getattr(self.stats, key) + value)

    def _account_post(self, seconds: float, descriptors: int) -> None:
        """:meth:`_account` of one post, without its keywords' dict and lookups (a transport's
        post and the poll that sees it done are on a request's path, and cold)."""
        with self._stats_lock:
            st = self.stats
            st.post_seconds += seconds
            st.descriptors += descriptors

    def _account_done(self, nbytes: int, seconds: float) -> None:
        """:meth:`_account` of one transfer seen DONE (see :meth:`_account_post`)."""
        with self._stats_lock:
            st = self.stats
            st.transfers += 1
            st.bytes += nbytes
            st.xfer_seconds += seconds


def check_pairs(local: Extents, remote: Extents) -> None:
    """Local and remote extents must pair up one to one with equal lengths."""
    if local.shape != remote.shape:
        raise ExtentOutOfBounds(
            f"local and remote extent counts differ: {local.shape[0]} vs {remote.shape[0]}"
        )
    if local.shape[0] and not np.array_equal(local["len"], remote["len"]):
        bad = int(np.flatnonzero(local["len"] != remote["len"])[0])
        raise ExtentOutOfBounds(
            f"extent {bad}: local length {int(local['len'][bad])} != "
            f"remote length {int(remote['len'][bad])}"
        )


class RegionTable:
    """Sorted registered regions with a vectorised "is every extent inside one region" check.

    This is the guard that keeps a remote request inside memory that was offered to it.
    """

    def __init__(self, regions: Sequence[Region]) -> None:
        order = sorted(regions, key=lambda r: r.addr)
        self.regions: tuple[Region, ...] = tuple(order)
        self.starts = np.array([r.addr for r in order], dtype=np.uint64)
        self.ends = np.array([r.addr + r.nbytes for r in order], dtype=np.uint64)
        if len(order) > 1 and np.any(self.starts[1:] < self.ends[:-1]):
            raise ExtentOutOfBounds("registered regions overlap")

    def locate(self, extents: Extents, what: str = "extent") -> npt.NDArray[np.intp]:
        """Index of the region holding each extent; raises naming the first one that is outside.
        One call of the C helper where it is built (``inside``: both sides of a tcp READ
        check every extent before a byte moves, and numpy's ~10 calls cost a 16-block READ's
        extents 19.5 us warm against 2.2: bench/results/bounds_check_3fc1440/), else numpy."""
        n = extents.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.intp)
        helpers = native.load()
        if helpers is not None and extents.dtype == EXTENT_DTYPE and extents.flags.c_contiguous:
            idx = np.empty(n, dtype=np.intp)
            bad = helpers.inside(self.starts, self.ends, extents, idx)
        else:
            idx, bad = self._locate_numpy(extents)
        if bad < 0:
            return idx
        raise ExtentOutOfBounds(
            f"{what} {bad} [0x{int(extents['addr'][bad]):x}, +{int(extents['len'][bad])}) is "
            f"outside the {len(self.regions)} registered region(s)"
        )

    def _locate_numpy(self, extents: Extents) -> tuple[npt.NDArray[np.intp], int]:
        """:meth:`locate`'s answer through numpy: (the regions, -1), or (anything, the first
        extent outside)."""
        addr = extents["addr"]
        end = addr + extents["len"]
        lo, hi = int(addr.min()), int(end.max())
        one = int(np.searchsorted(self.starts, lo, side="right")) - 1
        if one >= 0 and hi <= int(self.ends[one]) and not np.any(end < addr):
            # common case: the whole request lies in one region — three reductions, no search
            return np.full(extents.shape[0], one, dtype=np.intp), -1
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        inside = idx >= 0
        safe = np.where(inside, idx, 0)
        ok = inside & (end >= addr) & (end <= self.ends[safe]) if len(self.regions) else inside
        return safe, (-1 if np.all(ok) else int(np.flatnonzero(~ok)[0]))


# --------------------------------------------------------------------------- registry

_local_registry: dict[str, type[Transport]] = {}

# kvlink's own plugins, found even when running from a source tree that was never pip-installed
# (no entry-point metadata); an installed entry point of the same name takes precedence.
_BUILTIN = {
    "tcp": "kvlink_transports.tcp:TcpTransport",
    "nixl": "kvlink_transports.nixl:NixlTransport",
    "cuda_ipc": "kvlink_transports.cuda_ipc:CudaIpcTransport",
    "mooncake": "kvlink_transports.mooncake:MooncakeTransport",
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    eps = {
        name: metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)
        for name, value in _BUILTIN.items()
        if _module_exists(value.split(":")[0])
    }
    eps.update({ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
    return eps


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def register_transport(name: str, cls: type[Transport]) -> None:
    """Register a transport class in this process (entry points do the same across packages)."""
    _local_registry[name] = cls


def registered_transports() -> list[str]:
    names = set(_local_registry)
    names.update(_entry_points())
    return sorted(names)


def load_transport(name: str) -> type[Transport]:
    if name in _local_registry:
        return _local_registry[name]
    ep = _entry_points().get(name)
    if ep is None:
        known = ", ".join(registered_transports()) or "none"
        raise UnknownTransportError(f"unknown transport {name!r}; registered: {known}")
    try:
        cls = ep.load()
    except ImportError as exc:
        raise TransportUnavailable(
            f"transport {name!r} is registered but its library failed to import: {exc}; "
            "install it (README's transport table names the package for CPU and for GPU hosts)"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportUnavailable(f"entry point {name!r} -> {ep.value} is not a Transport")
    return cls


def create_transport(
    name: str, ctx: TransportContext, options: Mapping[str, Any] | None = None
) -> Transport:
    return load_transport(name)(ctx, options)
