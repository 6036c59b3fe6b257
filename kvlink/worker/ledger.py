"""What callers read back about ended transfers and finished requests, written off their path.

A request is over for its caller once :meth:`KVWorker.poll` reports it; the records of it
(:class:`Transfer` per transfer, :attr:`KVWorker.xfer_seconds`, :attr:`KVWorker.phases`, the
byte and descriptor counts) and the release of its transports' handles change nothing about
that outcome. Made on the poll that reports the request, they were on its path: on one H200
host the transfer's record and release alone took 13.5 of the 75 us from DONE seen to the
poll's return, cold, before the report's counts (bench/results/gpu_stamps_head/). So that
poll only notes what ended (:attr:`Ledger.ended`, :attr:`Ledger.reported`), and
:meth:`settle` writes it all later: on a poll that finds its requests
still moving (their copies are running), on a whole poll, before any of it is read (the
worker's properties call it), and at close. Separate because it is the one place that
decides what a caller reads back, and when it is written.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from kvlink.errors import KVLinkError
from kvlink.plan import Plan
from kvlink.transport import Runs, Transport
from kvlink.worker.records import Moved, Phases, Transfer, _Request

log = logging.getLogger("kvlink.worker")
V = TypeVar("V")

_XFER_SECONDS_KEPT = 4096  # finished requests whose times xfer_seconds and phases keep
_TRANSFERS_KEPT = 65536  # ended transfers kept until a caller takes them
#: entries owed past which a poll runs whole, so they are written (bench/e2e_request.py's
#: sleeping caller has no poll that finds its request still moving: each first poll sees it
#: DONE)
OWED_MAX = 64


class _Spent(NamedTuple):
    """One transfer that ended, as it was when its poll saw it (a part may be posted again
    before it is written down: its fields then describe the new post)."""

    req: _Request
    transport: Transport
    handle: int
    ok: bool
    t_post: float  # perf_counter at the post, and at the poll that saw it end
    t_done: float
    post_seconds: float
    nbytes: int
    plan: Plan | Runs | Moved | None  # what it posted (read for its descriptor counts)


class Ledger:
    """The records callers read, and those owed to them (see the module docstring)."""

    def __init__(self) -> None:
        #: every transfer posted that ended, in order (see KVWorker.transfers)
        self.transfers: collections.deque[Transfer] = collections.deque(maxlen=_TRANSFERS_KEPT)
        self.xfer_seconds: dict[str, float] = {}  # see KVWorker.xfer_seconds
        self.phases: dict[str, Phases] = {}  # see KVWorker.phases
        self.finished_bytes = 0
        self.raw_descriptors = 0  # before coalescing, over finished requests
        self.descriptors = 0
        #: what polls noted, for :meth:`settle` to write: transfers that ended (DONE or
        #: FAILED, quiescent; their handles released there), and requests reported finished
        #: (with the perf_counter of the report). The poll that sees them end appends here
        #: itself: a method per note was a frame more on a request's path, cold
        self.ended: list[_Spent] = []
        self.reported: list[tuple[_Request, float]] = []
        #: records owed by a poll that reported a request on its transports' word alone (the
        #: worker's ``_end_early``): each call notes that request's parts and report here
        self.later: list[Callable[[], None]] = []

    def owed(self) -> int:
        return len(self.ended) + len(self.reported) + len(self.later)

    def settle(self) -> None:
        """Write down everything owed, in the order it happened; release the handles."""
        if self.later:
            later, self.later = self.later, []
            for note in later:
                note()
        if self.ended:
            ended, self.ended = self.ended, []
            for s in ended:
                self._record(s)
        if self.reported:
            reported, self.reported = self.reported, []
            for req, now in reported:
                self._count(req, now)

    def _record(self, s: _Spent) -> None:
        xfer = _transport_seconds(s)
        req = s.req
        req.phases.transfer = max(req.phases.transfer, s.t_done - s.t_post)
        req.xfer_seconds = max(req.xfer_seconds, xfer)
        descriptors = s.plan.descriptors if s.plan is not None else 0
        if s.ok and s.plan is not None:
            req.raw_descriptors += s.plan.raw_descriptors
            req.descriptors += descriptors
        self.transfers.append(Transfer(s.transport.name, s.post_seconds, s.nbytes,
                                       descriptors, xfer, s.ok))
        try:
            s.transport.release(s.handle)
        except Exception:  # a plugin's bug: the handle leaks, nothing else is lost
            log.exception("%s: releasing a transfer's handle failed", s.transport.name)

    def _count(self, req: _Request, now: float) -> None:
        self.finished_bytes += req.nbytes
        self.raw_descriptors += req.raw_descriptors
        self.descriptors += req.descriptors
        req.phases.verdict = max((now - p.t_done for p in req.parts if p.t_done), default=0.0)
        _remember(self.xfer_seconds, req.req_id, req.xfer_seconds)
        _remember(self.phases, req.req_id, req.phases)


def _transport_seconds(s: _Spent) -> float:
    """Post to completion of one transfer: the transport's own timing if it keeps one
    (``xfer_telemetry``: NIXL's ``xferDuration``, what vLLM's NixlConnector reports as
    ``vllm:nixl_xfer_time_seconds``), else our clock from post() to the poll that saw it
    end."""
    telemetry = getattr(s.transport, "xfer_telemetry", None)
    if telemetry is not None:
        try:
            entries = telemetry(s.handle)
        except KVLinkError:
            entries = []
        us = sum(float(e.get("xfer_us", 0.0)) for e in entries)
        if us > 0:
            return us / 1e6
    return s.t_done - s.t_post


def _remember(kept: dict[str, V], key: str, value: V) -> None:
    kept[key] = value
    if len(kept) > _XFER_SECONDS_KEPT:  # nobody reads them: bounded
        del kept[next(iter(kept))]
