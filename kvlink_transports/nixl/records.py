"""What the nixl transport keeps of one peer and of one transfer (its bookkeeping).

Plain records, shared by the modules that handle them (handshake, posting, teardown, the UCX
path checks); separate so that none of those has to import another just for a record type.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvlink.transport import PENDING, XferState
from kvlink_transports.nixl.memory import _Prep, _Side


@dataclasses.dataclass
class _Peer:
    key: str
    agent: str
    descriptor: bytes
    side: _Side
    host: str
    #: remote ends of the TCP connections our UCX opened to it at connect (its tcp interfaces):
    #: what a teardown shuts down
    ucx: frozenset[tuple[str, int]] = frozenset()
    torn: bool = False  # its connections were shut down once (warn once)
    prep: _Prep | None = None  # its regions prepped once at connect (None: per-request lists)
    #: posts to it fail with this reason (a GPU pair on a slow UCX path, see allow_slow_gpu)
    blocked: str | None = None


@dataclasses.dataclass
class _Xfer:
    peer: str
    agent: str
    reqs: list[Any]  # nixl_xfer_handle, one per memory pair (usually exactly one); None: freed
    done: list[bool]  # per request: it can move no more bytes (DONE, ERR, or cancelled)
    nbytes: int
    ndesc: int
    t_post: float
    notify: bytes | None = None  # sent by poll when the request was split
    state: XferState = PENDING
    failure: str | None = None  # first error; reported once every request is done
    telemetry: list[Any] = dataclasses.field(default_factory=list)
    op: str = ""
    deadline: float = math.inf  # time.monotonic() bound (timeout_s after post)
    expired: bool = False  # the deadline passed and its peer was torn down
    t_transfer: float = 0.0  # perf_counter() as the first NIXL transfer() call began
    t_posted: float = 0.0  # perf_counter() as post returned
    path: str = ""  # "prepped" (lists prepped at connect), "per-request" or "direct"
    #: stream order: (mark of the caller's stream at post, what _issue takes) until poll finds
    #: the device past the mark and hands the descriptors to NIXL; None once issued
    after: tuple[Any, tuple[Any, ...]] | None = None
    #: released by its caller while a request of it was in flight: kept, answering no call,
    #: until UCX ends it (:meth:`~kvlink_transports.nixl.requests._Requests._abandon`)
    abandoned: bool = False
