"""What the worker keeps per request, per part and per push: plain records, no behaviour.

A request (:class:`_Request`) is one :meth:`KVWorker.read`/:meth:`KVWorker.write` or one push;
it has a part (:class:`_Part`) per remote rank it moves heads to or from, each allowed to post
by a :class:`_Go`. A layer-wise push being written is a :class:`_Layered` (prefill side), a
push being awaited an :class:`_Awaiting` (decode side). :class:`Phases` and :class:`Transfer`
are what callers read back. Separate so that every job's module can name them without
importing another job, and so the state is readable in one place.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvlink import wire
from kvlink.channel import Pending
from kvlink.headmap import HeadRead
from kvlink.holdboard import AfterCheck
from kvlink.integrity import RangeDigests
from kvlink.landing import EndCheck, LandingView
from kvlink.peers import Peer, RemoteEngine
from kvlink.plan import Plan, PlanTable
from kvlink.push import PushKey, PushWait
from kvlink.transport import Op, Runs

_NOTES_KEPT = 65536  # "written" notifications waiting for poll()


class _Go(NamedTuple):
    """A part may be posted: the peer, and the generation its READ is validated against (with
    the local deadline of an intent's grant; a READ told its generation has none). A tuple:
    made on every request's path before its launch (a frozen dataclass's init is slower)."""

    peer: Peer
    generation: int = 0
    deadline: float = float("inf")


@dataclasses.dataclass(slots=True)  # one or more per request: slots make and read faster
class Phases:
    """Where one finished request's time went, in seconds (see :attr:`KVWorker.phases`):
    ``wait`` handshake or read intent before the first post, ``plan`` block planning, ``post``
    the transports' post calls, ``transfer`` post to the last part's DONE, ``verdict`` DONE to
    the producer's answer (pull) — all on the caller's thread, measured by its clock."""

    wait: float = 0.0
    plan: float = 0.0
    post: float = 0.0
    transfer: float = 0.0
    verdict: float = 0.0


class Transfer(NamedTuple):
    """One transfer this rank posted, once the transport said DONE or FAILED (see
    :attr:`KVWorker.transfers`): a plain tuple, so recording it costs one append on the poll
    path. A request has one per part it posted (more with heterogeneous TP, or a READ posted
    again after a refusal)."""

    transport: str  # the transport this peer was reached over (chosen per peer)
    post_seconds: float  # host time inside the transport's post call
    nbytes: int
    descriptors: int  # extents posted (after kvlink's coalescing)
    xfer_seconds: float  # post to completion (see KVWorker.xfer_seconds for the clock)
    ok: bool  # DONE; False: FAILED (refused ones included), nothing more can land


class Moved(NamedTuple):
    """What a part posted through a lane moves (in place of its plan, which a lane does not
    make): read back for its accounting."""

    nbytes: int
    descriptors: int  # extents posted
    raw_descriptors: int  # before coalescing (the planner's count)


@dataclasses.dataclass(slots=True)
class _PeerLane:
    """A peer's lane for one (heads, op) (kvlink.transport's optional ``lane`` hook), and the
    plan table it was bound from; ``lane`` None: this pair posts the general way."""

    peer: Peer
    lane: Any
    table: PlanTable | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Leg:
    """One part of a :class:`_Route`: its heads, the peer's handshake (the future every part
    holds, and its result) and the lane its READs took."""

    read: HeadRead
    future: cf.Future[Peer]
    peer: Peer
    lane: _PeerLane
    #: what one block pair moves: (bytes, extents, extents before coalescing); a post of n
    #: moves n times that (Moved)
    per_block: tuple[int, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    """How a READ from one remote engine went when every part of it took a lane: what the
    next READ told its generation launches before any record of it is made (see
    ``_Requests._read_now``). Valid while the worker's handshakes are those it was bound to
    (``epoch``, :attr:`kvlink.peers.PeerTable.epoch`) and integrity is on or off as then."""

    epoch: int
    digests: bool
    legs: tuple[_Leg, ...]
    #: every leg's lane takes the caller's ids as they come (lists of ints, int64 arrays),
    #: converting them in its launch (kvlink_transports.cuda_ipc: ``_Lane.takes_lists``)
    lists: bool = False
    #: the remote's ranks holding our heads that no leg reads (told "released" at the end)
    others: frozenset[int] = frozenset()


@dataclasses.dataclass(slots=True)  # one or more per request: slots make and read faster
class _Part:
    read: HeadRead
    peer: cf.Future[Peer]
    intent: Pending | None = None  # READ without a generation: the grant, asked
    handle: int | None = None
    go: _Go | None = None
    done: bool = False
    error: str | None = None
    plan: Plan | Runs | Moved | None = None
    verdict: Pending | None = None  # READ: the producer's answer to ReadDone
    asks: int = 0  # "not held yet" answers so far
    retry_at: float = 0.0  # when to ask again after "not held yet"
    restarts: int = 0  # "stale" answers: the producer restarted, handshake again
    reask: bool = False  # a READ's report answered "not held yet": report again at retry_at
    refused: bool = False  # the owner refused the READ (nothing moved): verdict = its intent
    failure: str | None = None  # a READ told its generation FAILED: did the producer restart?
    #: READ validated on the producer's hold board once it is DONE: the check, bound at post
    check: AfterCheck | None = None
    #: a lane's post: how its copy ended, read without the transport's bookkeeping (the
    #: transport's optional ``end_probe``: kvlink.transport, rule 7)
    probe: Callable[[], int | None] | None = None
    #: READ with integrity on, digested and compared by the copy kernel (a digest lane, or
    #: kvlink.transport.DigestJob); once DONE its answer — -1 all matched, else the first
    #: index that differed; None: not compared — and the producer's rows it compared
    fusing: bool = False
    fused: int | None = None
    fused_rows: int = 0
    nbytes: int = 0  # bytes this part's post moves
    t_post: float = 0.0
    post_seconds: float = 0.0  # inside the transport's post call
    t_done: float = 0.0  # perf_counter at the poll that saw its last transfer end

    @property
    def settled(self) -> bool:
        """Nothing of this part is moving or awaited any more."""
        return self.done or (self.error is not None and self.handle is None
                             and self.verdict is None)

    def describe(self, now: float) -> str:
        """Where this part stands, in words, in the order kvlink.worker.parts._Parts._advance
        takes its steps (``now``: time.monotonic()). For :meth:`KVWorker.explain`."""
        not_yet = f"{self.asks} 'not held yet' answer(s)"
        if self.done:
            return "done"
        if self.error is not None:
            return (f"failed: {self.error}" if self.settled else
                    f"failing ({self.error}); waiting until nothing of it can still land")
        if self.reask:
            return f"reported; the producer had not held it yet ({not_yet}): reporting again"
        if self.verdict is not None and self.refused:
            return ("refused by the producer's transport before any byte moved; asking "
                    f"whether it holds the request ({not_yet})")
        if self.verdict is not None:
            return "waiting for the producer's answer to its report"
        if self.handle is not None:
            name = self.go.peer.transport.name if self.go is not None else "?"
            return f"moving over {name} (transfer handle {self.handle})"
        if self.go is not None:
            return "granted; not posted yet"
        if not self.peer.done():
            return "waiting for the handshake with the producer"
        if self.intent is not None:
            return f"read intent asked ({not_yet})"
        if self.retry_at:
            return f"trying again in {max(0.0, self.retry_at - now) * 1e3:.0f} ms ({not_yet})"
        return "handshake done; starts at the next poll"


@dataclasses.dataclass(slots=True)  # one or more per request: slots make and read faster
class _Request:
    req_id: str
    op: Op
    remote: RemoteEngine
    local_ids: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    parts: list[_Part]
    t_start: float
    generation: int | None = None  # READ: the hold's, passed with the block ids (no intent)
    t_mono: float = dataclasses.field(default_factory=time.monotonic)  # start, monotonic
    nbytes: int = 0
    phases: Phases = dataclasses.field(default_factory=Phases)
    push: wire.PushRequest | None = None  # prefill side of a push: the decode's request
    push_key: PushKey | None = None
    lease: tuple[str, int] | None = None  # a push from held blocks: (request, generation)
    fingerprint: int | None = None  # of remote_ids, for the hold board (once per request)
    #: a push with integrity on: (decode block ids, digests, folded) for its "written" note,
    #: or those taken as it was pushed, read once it is DONE (kvlink.integrity.RangeDigests)
    digests: tuple[list[int], bytes, bool] | RangeDigests | None = None
    #: one layer range of a layer-wise push: [from, to), and the push's id (see _Layered)
    layers: tuple[int, int] | None = None
    layered: str | None = None
    #: a push to a same-host decode's landing board (kvlink.landing): (board, slot, tag); its
    #: WRITE is posted with a signal where it is one part on a transport that signals
    landing: tuple[LandingView, int, int] | None = None
    signalled: bool = False  # its WRITE was posted with that signal
    #: a READ on a route: the remote's ranks holding our heads it does not read, as the
    #: route knows them (None: worked out at its report)
    others: frozenset[int] | None = None
    #: a READ launched on this route whose records (what it moves, its after-check) are owed:
    #: made by the first look at it (kvlink.worker.requests._Requests._record_launch)
    route: _Route | None = None
    early: bool = False  # every part has a probe and an after-check: _Requests._end_early
    #: over its transfers, as written down (kvlink.worker.ledger): the slowest one's
    #: transport seconds, and the descriptors of those that were DONE
    xfer_seconds: float = 0.0
    descriptors: int = 0
    raw_descriptors: int = 0


@dataclasses.dataclass
class _Layered:
    """Prefill side of one layer-wise push (:meth:`KVWorker.push` with ``layers``): each call
    posts one range as its own WRITE; the decode hears of each range once it landed, and of
    the push ("written", or why not) once every range is DONE, or once it failed and nothing
    of it is in flight."""

    msg: wire.PushRequest
    key: PushKey
    layers: int  # the cache's: the push is written when [0, layers) is
    lease: tuple[str, int] | None  # (held request, generation): validated once at the end
    #: with integrity on, its digests, taken range by range as the layers are written, sent
    #: whole with "written" (kvlink.integrity.RangeDigests)
    digests: RangeDigests | None
    next_layer: int = 0
    inflight: set[str] = dataclasses.field(default_factory=set)  # its ranges' request ids
    error: str | None = None
    #: ranges DONE since the last poll, told the decode at the poll's end, merged (an 80-layer
    #: push that lands while the caller waits on its forward is one note, not 80)
    landed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    landing: tuple[LandingView, int, int] | None = None  # as _Request.landing, every range
    #: every range so far was posted with its signal: the decode reads what landed on its
    #: board, so no "layers" note is sent (its side channel stays quiet as the push ends)
    signalled: bool = True


@dataclasses.dataclass
class _Awaiting:
    """Push mode, decode side: the request's remote and its ownership state."""

    remote: RemoteEngine
    wait: PushWait
    local_ids: npt.NDArray[np.int64]  # the blocks reserved for it (checked at "written")
    asked: list[Pending] = dataclasses.field(default_factory=list)
    #: layer-wise pushes: per prefill rank, the layer ranges that have landed
    layers: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    cancels: dict[int, Pending] = dataclasses.field(default_factory=dict)
    #: our landing board's slot per prefill rank asked (kvlink.landing): a rank whose flag
    #: shows every layer, from a hold still shown, counts as written without its note
    landing: dict[int, int] = dataclasses.field(default_factory=dict)
    tag: int = 0  # the push's tag on that board (kvlink.landing.tag_of)
    #: prefill ranks holding our heads that were not asked (told "released" at the end)
    others: frozenset[int] = frozenset()
    #: per prefill rank, the check of its end on our landing board, bound once its hold
    #: is written there (kvlink.landing.EndCheck)
    ends: dict[int, EndCheck] = dataclasses.field(default_factory=dict)
    #: the prefill handed us this request itself (expect_push's ``live``): it was serving
    live: bool = False
    #: the prefill's hold, where the caller knew it (expect_push's ``generation``): what the
    #: replicas in ``others`` are released under
    generation: int | None = None


def _push_rid(msg: wire.PushRequest) -> str:
    """The id :meth:`KVWorker.poll` reports a push under (one per decode rank and attempt)."""
    return f"push:{msg.engine_id}/{msg.tp_rank}/{msg.push_id}/{msg.req_id}"

