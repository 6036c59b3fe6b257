"""``nixl``: one-sided READ/WRITE through NVIDIA NIXL (UCX backend by default).

One NIXL agent per transport instance, named ``ctx.agent_name``. KV memory is registered once
(``cpu`` regions as DRAM device 0, ``cuda:N`` regions as VRAM device N). The descriptor a peer gets
is a versioned msgspec struct: the agent's NIXL metadata, the host identity, the backends, and the
table of registered regions, which bounds every remote extent we later post against that peer.

Each :meth:`NixlTransport.post` turns the extent arrays into Nx3 ``(addr, len, devId)`` numpy
arrays (no Python loop over extents), prepares a local and a remote descriptor list with
``prep_xfer_dlist``, makes ONE transfer of all descriptors with ``make_prepped_xfer`` (NIXL merges
back-to-back descriptors there, so a run of adjacent blocks costs one UCX operation) and releases
the two lists right away (the request keeps its own copy). ``options["post_mode"] = "direct"``
uses ``initialize_xfer`` instead, which does not merge; measured on CPU DRAM it is several times
slower for many small descriptors (see docs/nixl.md). The notification rides on the transfer
(NIXL sends it after the last byte); a transfer whose extents mix DRAM and VRAM is split into one
NIXL request per memory pair and the notification is sent once all of them are done.

Options: ``backends`` (list of NIXL backend names, default ``["UCX"]``), ``post_mode``
(``"prepped"`` | ``"direct"``), ``progress_thread`` (NIXL's own progress thread; it busy-spins
a core, so it is off by default), ``progress_interval`` (seconds, default 0.001: without NIXL's
thread, a light kvlink thread progresses UCX this often — a target that never polls must still
answer the initiator's connection wire-up, and over TCP serve its RMA; 0 turns it off, and then
the owner must call :meth:`notifications` regularly; over TCP between hosts prefer
``progress_thread=True``), ``progress_fast_interval`` (seconds, default 0.00005: the cadence of
that thread while :meth:`NixlTransport.expect_access` says peers' transfers are due — an
initiator's READ or WRITE with a notification is DONE only after THIS side's UCX worker has
progressed, so at the idle cadence every such transfer would take up to ``progress_interval``;
see docs/nixl.md "Progress"), ``num_threads`` (backend worker threads), ``telemetry`` (capture
NIXL per-transfer telemetry, see :meth:`NixlTransport.xfer_telemetry`), ``ucx_probe`` (predict
UCX's transport per peer with ``ucx_info`` and warn on TCP / host-staged fallbacks; default
True), ``timeout_s`` (seconds, default 30, like tcp and mooncake: the deadline of every
transfer, see below). The probe runs ``ucx_info`` (0.5 s on an idle machine, tens of seconds on a
loaded one), so it runs on a background thread after :meth:`NixlTransport.connect`, never on a
handshake's path (:meth:`NixlTransport.wait_probes` waits for it).

Contract (``kvlink/transport.py``): a handle reports FAILED only once none of its NIXL requests
can move a byte any more. NIXL 1.5.1 cannot stop a UCX request in flight: releasing it returns
success while UCX's READ goes on (``ucp_request_cancel`` does nothing to RMA), and removing the
remote agent makes NIXL answer NOT_FOUND for it without asking UCX, which still completes it
(measured: 4-64 MiB landed in a FAILED READ's destination after the peer resumed; docs/nixl.md
"Deadlines"). So a failed handle keeps asking NIXL about each request until UCX has ended it,
and what ends a request that hangs is UCX failing its endpoint: when a transfer outlives
``timeout_s``, when its peer is disconnected or replaced, and at close, the transport shuts
down the TCP connections its UCX opened to that peer (found at :meth:`NixlTransport.connect`,
``_ucx.new_ucx_connections``); UCX then fails the endpoint at its next progress, which aborts
every request on it, and NIXL reports them ERR (NIXL_ERR_REMOTE_DISCONNECT) and drops the
peer's metadata itself. kvlink removes a remote agent only once none of its requests is in
flight (until then the peer is "draining"), so a NOT_FOUND answer always comes after such an
endpoint failure. :meth:`NixlTransport.post` gives a FAILED handle, never an exception, for an
unknown peer or a closed transport.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvlink.errors import (
    ConfigError,
    HandshakeError,
    TransferError,
    TransportUnavailable,
    WireError,
)
from kvlink.options import check_options
from kvlink.transport import (
    DONE,
    PENDING,
    Capabilities,
    Extents,
    Op,
    Region,
    RegionTable,
    Transport,
    TransportContext,
    XferState,
    XferStatus,
    check_pairs,
)
from kvlink.wire import decode_versioned
from kvlink_transports import _ucx

log = logging.getLogger("kvlink.nixl")

PIP_HINT = "pip install 'kvlink[nixl]'  (or: pip install nixl)"
_VERSION = 1
_MAX_DESCRIPTOR = 64 << 20
_MAX_REGIONS = 1 << 16
_MEM_NAMES = ("DRAM", "VRAM")  # index = memory code used in the per-region arrays
_DRAIN_WAIT = 2.0  # connect: how long to wait for a dropped peer's requests before re-adding it
_CLOSE_DRAIN = 0.5  # close: how long torn-down endpoints get to end their requests
_OPS = {Op.READ: "READ", Op.WRITE: "WRITE"}

_warned: set[str] = set()
_warned_lock = threading.Lock()
#: verdicts on the UCX path of GPU pairs, per (same host, UCX settings): measured once per
#: process (same host: a NIXL VRAM READ+WRITE between two probe processes), else predicted
_gpu_verdicts: dict[tuple[Any, ...], _ucx.LaneVerdict] = {}


def _warn_once(key: str, msg: str, *args: object) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("!!! " + msg, *args)


# ----------------------------------------------------------------------------- wire format


class _RegionWire(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: int
    nbytes: int
    device: str


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    host: str
    metadata: bytes
    backends: list[str]
    regions: list[_RegionWire]


_enc = msgspec.msgpack.Encoder()


def _decode_descriptor(buf: bytes) -> _Descriptor:
    desc = decode_versioned(buf, _Descriptor, _VERSION, "nixl descriptor", _MAX_DESCRIPTOR)
    if not desc.agent or not desc.metadata:
        raise WireError("nixl descriptor lacks the agent name or its metadata")
    if len(desc.regions) > _MAX_REGIONS:
        raise WireError(f"nixl descriptor offers {len(desc.regions)} regions (max {_MAX_REGIONS})")
    for r in desc.regions:
        if not (0 < r.addr < 1 << 64 and 0 < r.nbytes < 1 << 64 and r.addr + r.nbytes < 1 << 64):
            raise WireError(f"nixl descriptor region [{r.addr:#x}, +{r.nbytes}) is invalid")
        _mem_of(r.device, WireError)
    return desc


def _mem_of(device: str, exc: type[Exception] = ConfigError) -> tuple[int, int]:
    """Region.device -> (memory code, NIXL devId): cpu -> (DRAM, 0), cuda:N -> (VRAM, N)."""
    kind, _, idx = device.partition(":")
    if kind == "cpu" and not idx:
        return 0, 0
    if kind == "cuda" and (not idx or idx.isdigit()):
        return 1, int(idx or 0)
    raise exc(f"region device {device!r} is not 'cpu' or 'cuda:N'")


class _Side:
    """Regions of one side with per-region memory code and devId, in RegionTable order."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.table = RegionTable(regions)
        codes = [_mem_of(r.device) for r in self.table.regions]
        self.mem = np.array([c[0] for c in codes], dtype=np.int8)
        self.dev = np.array([c[1] for c in codes], dtype=np.uint64)

    @property
    def one_kind(self) -> int | None:
        """The memory code of every region when they share one (no per-extent lookup)."""
        m = self.mem
        return int(m[0]) if m.size and int(m.min()) == int(m.max()) else None

    @property
    def has_vram(self) -> bool:
        return bool(np.any(self.mem == 1))


def _dlist(ext: Extents, dev: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    out = np.empty((ext.shape[0], 3), dtype=np.uint64)
    out[:, 0] = ext["addr"]
    out[:, 1] = ext["len"]
    out[:, 2] = dev
    return out


_BLOCK_MIN = 4096


def _auto_block(regions: Sequence[Region], cap: int) -> int:
    """The prepped-list block: 4 KiB, doubled until ``regions`` need at most ``cap`` of them."""
    b = _BLOCK_MIN
    while sum(r.nbytes // b for r in regions) > cap:
        b *= 2
    return b


@dataclasses.dataclass
class _Prep:
    """Descriptor lists prepped ONCE for one side (ours, or a peer's) at one block size: every
    region cut into ``block``-byte descriptors, one prepped list per memory kind (NIXL's
    strided Nx5 form, one row per region). A request then names descriptors by index
    (:func:`_block_indices`), so ``post`` builds no list: ``make_prepped_xfer`` with two index
    arrays, which NIXL merges back to back."""

    block: int
    handles: dict[int, Any]  # memory code -> nixl_prepped_dlist_handle
    start: npt.NDArray[np.uint64]  # per region (RegionTable order): its address
    base: npt.NDArray[np.int64]  # index of its first block in its memory kind's list
    nblocks: npt.NDArray[np.int64]  # whole blocks in it (a shorter tail is not prepped)
    tail: npt.NDArray[np.bool_]  # it ends in such a tail
    side: _Side | None = None  # the region table it was made from (used only with that one)

    @property
    def shift(self) -> int:
        """log2(block) when block is a power of two, else -1."""
        return self.block.bit_length() - 1 if self.block & (self.block - 1) == 0 else -1

    @property
    def descriptors(self) -> int:
        return int(self.nblocks.sum())

    def release(self) -> None:
        for h in self.handles.values():
            try:
                h.release()
            except Exception as exc:
                log.debug("nixl prepped dlist release: %s", _nixl_reason(exc))
        self.handles = {}


def _make_prep(agent: Any, who: str, side: _Side, block: int) -> _Prep:
    """Prep ``side``'s regions at ``block`` (``who``: "NIXL_INIT_AGENT" or the peer's agent)."""
    regions = side.table.regions
    n = len(regions)
    start = np.array([r.addr for r in regions], dtype=np.uint64)
    nblocks = np.array([r.nbytes // block for r in regions], dtype=np.int64)
    base = np.zeros(n, dtype=np.int64)
    handles: dict[int, Any] = {}
    tail = np.array([r.nbytes % block != 0 for r in regions], dtype=np.bool_)
    prep = _Prep(block, handles, start, base, nblocks, tail, side)
    try:
        for mem in (0, 1):
            sel = np.flatnonzero((side.mem == mem) & (nblocks > 0))
            if sel.size == 0:
                continue
            counts = nblocks[sel]
            base[sel] = np.cumsum(counts) - counts
            rows = np.empty((sel.size, 5), dtype=np.uint64)
            rows[:, 0] = start[sel]
            rows[:, 1] = block
            rows[:, 2] = side.dev[sel]
            rows[:, 3] = block
            rows[:, 4] = counts.astype(np.uint64)
            handles[mem] = agent.prep_xfer_dlist(who, rows, _MEM_NAMES[mem])
    except BaseException:
        prep.release()
        raise
    return prep


def _first_blocks(
    prep: _Prep, ri: npt.NDArray[np.intp], ext: Extents
) -> npt.NDArray[np.int64] | None:
    """Index of the first prepped block of each extent (extent i lies in region ``ri[i]``);
    None when one does not start and end on whole prepped blocks of its region."""
    b = prep.block
    one = prep.start.shape[0] == 1
    r0 = 0 if one else int(ri[0])
    if one or bool((ri == r0).all()):  # the common case: scalars instead of gathers
        off = ext["addr"] - prep.start[r0]
    else:
        off = ext["addr"] - prep.start[ri]
    first: npt.NDArray[np.int64]
    if prep.shift >= 0:  # a power of two: masks and shifts (uint64 % and // are slow)
        if ((off | ext["len"]) & np.uint64(b - 1)).any():
            return None
        first = (off >> np.uint64(prep.shift)).view(np.int64)
    else:
        if ((off | ext["len"]) % np.uint64(b)).any():
            return None
        first = (off // np.uint64(b)).view(np.int64)
    if one or bool((ri == r0).all()):
        if prep.tail[r0] and int((off + ext["len"]).max()) > int(prep.nblocks[r0]) * b:
            return None
        first += prep.base[r0]
        return first
    if (first + (ext["len"] // np.uint64(b)).view(np.int64) > prep.nblocks[ri]).any():
        return None
    first += prep.base[ri]
    return first


def _pair_indices(
    lprep: _Prep, li: npt.NDArray[np.intp], local: Extents,
    rprep: _Prep, ri: npt.NDArray[np.intp], remote: Extents,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
    """Local and remote indices into the prepped lists of the blocks making up the extent
    pairs (same block size both sides; lengths pair up, check_pairs), in order; None when an
    extent is not made of whole prepped blocks. Vectorised: no Python loop over extents."""
    lf = _first_blocks(lprep, li, local)
    rf = _first_blocks(rprep, ri, remote) if lf is not None else None
    if lf is None or rf is None:
        return None
    b = lprep.block
    ln = local["len"]
    if int(ln.min()) == b and int(ln.max()) == b:  # one block per extent
        return lf.astype(np.int32), rf.astype(np.int32)
    cnt = (ln // np.uint64(b)).view(np.int64)
    ends = cnt.cumsum()
    total = int(ends[-1])
    if total >= 1 << 31:
        return None
    ends -= cnt  # each extent's first position in the index arrays
    ar = np.arange(total, dtype=np.int32)
    li_ = (lf - ends).astype(np.int32).repeat(cnt)
    li_ += ar
    ri_ = (rf - ends).astype(np.int32).repeat(cnt)
    ri_ += ar
    return li_, ri_


# ----------------------------------------------------------------------------- bookkeeping


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


def _progress_loop(ref: weakref.ref[NixlTransport], stop: threading.Event, wake: threading.Event,
                   interval: float, fast: float) -> None:
    """Progress UCX every ``interval`` seconds while the transport lives (see progress_interval),
    every ``fast`` seconds while peers' transfers are expected (see expect_access); ``wake``
    ends the current sleep early (a new expectation, or close)."""
    delay = interval
    while True:
        wake.wait(delay)
        wake.clear()
        if stop.is_set():
            return
        t = ref()
        if t is None:
            return
        with t._lock:
            if t._closed:
                return
            try:
                t._drain_notifs()
            except Exception as exc:
                log.debug("nixl progress: %s", _nixl_reason(exc))
            delay = fast if t._expecting() else interval
        del t


def quiet_third_party_logs(verbose: int = 0) -> None:
    """NIXL's and Mooncake's own logs: warnings only by default (NIXL's Python logger prints
    every agent and backend creation at INFO on stdout), their INFO with ``verbose`` >= 1 and
    DEBUG with >= 2. A value the user set in NIXL_LOG_LEVEL / MC_LOG_LEVEL is kept. Call it
    before the first transport is made (``kvlink -v``); the transports call it with 0 when
    kvlink's own loggers are quieter than INFO."""
    nixl_level, mc_level = ("WARN", "WARNING") if verbose <= 0 else (
        ("INFO", "INFO") if verbose == 1 else ("DEBUG", "INFO"))
    os.environ.setdefault("NIXL_LOG_LEVEL", nixl_level)
    os.environ.setdefault("MC_LOG_LEVEL", mc_level)
    py = {"WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG}
    lvl = py.get(os.environ["NIXL_LOG_LEVEL"].upper(), logging.WARNING)
    logging.getLogger("nixl").setLevel(lvl)


_ucx_env_logged = False


def _import_nixl() -> Any:
    if not logging.getLogger("kvlink").isEnabledFor(logging.INFO):
        quiet_third_party_logs(0)
    try:
        from nixl import _api
    except ImportError as exc:
        raise TransportUnavailable(
            f"the nixl transport needs the NIXL Python package ({exc}); install it with "
            f"`{PIP_HINT}`"
        ) from exc
    if "NIXL_LOG_LEVEL" in os.environ:  # NIXL's dictConfig at import reset its logger's level
        quiet_third_party_logs(0)
    return _api


def _nixl_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class NixlTransport(Transport):
    name = "nixl"
    capabilities = Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}),
        memory_kinds=frozenset({"cpu", "cuda"}),
        same_host_only=False,
        native_notifications=True,
    )

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        api = _import_nixl()
        opts = check_options("nixl", self.options)
        backends = opts.get("backends", ["UCX"])
        if (
            isinstance(backends, str)
            or not backends
            or not all(isinstance(b, str) and b for b in backends)
        ):
            raise ConfigError(
                f"nixl option backends must be a non-empty list of names: {backends!r}"
            )
        self._backends: list[str] = list(backends)
        self._post_mode = str(opts.get("post_mode", "prepped"))
        if self._post_mode not in ("prepped", "direct"):
            raise ConfigError(
                f"nixl option post_mode must be 'prepped' or 'direct': {self._post_mode!r}"
            )
        self._telemetry = bool(opts.get("telemetry", False))
        self._ucx_probe = bool(opts.get("ucx_probe", True))
        nixl_progress = bool(opts.get("progress_thread", False))
        interval = float(opts.get("progress_interval", 0.001))
        if interval < 0:
            raise ConfigError(f"nixl option progress_interval must be >= 0: {interval!r}")
        fast = float(opts.get("progress_fast_interval", 0.00005))
        if fast <= 0:
            raise ConfigError(f"nixl option progress_fast_interval must be > 0: {fast!r}")
        self._timeout = float(opts.get("timeout_s", 30.0))
        if not self._timeout > 0:
            raise ConfigError(f"nixl option timeout_s must be > 0: {self._timeout!r}")
        self._prep_block = int(opts.get("prep_block_bytes", 0))
        self._prep_max = int(opts.get("prep_max_descriptors", 1 << 22))
        if self._prep_block < 0 or self._prep_max <= 0:
            raise ConfigError(
                f"nixl options prep_block_bytes must be >= 0 and prep_max_descriptors > 0: "
                f"{self._prep_block!r}, {self._prep_max!r}"
            )
        self._allow_slow_gpu = bool(opts.get("allow_slow_gpu", False))
        ehm = opts.get("ucx_error_handling_mode")
        if ehm is not None and ehm not in ("peer", "none"):
            raise ConfigError(f"nixl option ucx_error_handling_mode must be 'peer' or 'none': "
                              f"{ehm!r}")
        num_threads = int(opts.get("num_threads", 0))
        cfg = api.nixl_agent_config(
            enable_prog_thread=nixl_progress,
            capture_telemetry=self._telemetry,
            num_threads=num_threads,
            backends=[],  # made below, with their init parameters
        )
        #: UCX settings this transport added to the environment (the user's own are kept)
        self.ucx_env: dict[str, str] = {}
        if "UCX" in self._backends:
            if _ucx.apply_safe_env():
                log.info("nixl: no RDMA devices here, set UCX_MODULES=^ib (avoids a crash at "
                         "exit)")
            self.ucx_env = _ucx.apply_kvlink_env()
            global _ucx_env_logged
            if self.ucx_env or not _ucx_env_logged:
                _ucx_env_logged = True
                log.info(
                    "nixl: UCX settings %s (%s)",
                    {k: os.environ.get(k) for k in _ucx.KVLINK_UCX_DEFAULTS},
                    f"set by kvlink: {sorted(self.ucx_env)}" if self.ucx_env
                    else "kept as found",
                )
        try:
            self._agent: Any = api.nixl_agent(ctx.agent_name, cfg)
            plugins = set(self._agent.get_plugin_list())
            for b in self._backends:
                if b not in plugins:
                    continue
                init: dict[str, str] = {}
                if num_threads > 0 and b in ("UCX", "OBJ", "LIBFABRIC"):
                    init["num_threads"] = str(num_threads)
                if b == "UCX" and ehm is not None:
                    init["ucx_error_handling_mode"] = str(ehm)
                self._agent.create_backend(b, init)
        except Exception as exc:
            raise TransportUnavailable(
                f"nixl agent {ctx.agent_name!r} with backends {self._backends} failed to start: "
                f"{_nixl_reason(exc)} (UCX needs tcp in UCX_TLS for its wire-up, see docs/nixl.md)"
            ) from exc
        missing = [b for b in self._backends if b not in self._agent.backends]
        if missing:
            raise TransportUnavailable(
                f"nixl backends {missing} are not available here; plugins found: "
                f"{sorted(self._agent.get_plugin_list())}"
            )
        self._lock = threading.RLock()
        self._probe_pool: cf.ThreadPoolExecutor | None = None  # ucx_info, off the handshake path
        self._probes: list[cf.Future[None]] = []
        self._regions: list[Region] = []
        self._local = _Side([])
        self._reg_dlists: list[Any] = []
        self._lpreps: dict[int, _Prep] = {}  # block size -> our regions prepped at it
        self._peers: dict[str, _Peer] = {}
        self._by_agent: dict[str, str] = {}
        # agents dropped (disconnect, reconnect, deadline, close) while requests to them were in
        # flight: NIXL keeps them loaded until those requests are over (see the module doc)
        self._draining: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._zombies: list[Any] = []  # NIXL requests whose release failed; retried later
        self._ids = itertools.count(1)
        self._host = ctx.host_id or socket.gethostname()
        self._closed = False
        self._notes: list[tuple[str, bytes]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._expect_lock = threading.Lock()  # guards the next two; taken after self._lock
        self._expected = 0  # peers' transfers announced by expect_access, not yet notified
        self._expect_until = 0.0  # time.monotonic() bound of that window
        self._progress: threading.Thread | None = None
        if interval > 0 and not nixl_progress:
            self._progress = threading.Thread(
                target=_progress_loop,
                args=(weakref.ref(self), self._stop, self._wake, interval, min(fast, interval)),
                name=f"kvlink-nixl-progress-{ctx.agent_name}",
                daemon=True,
            )
            self._progress.start()
        log.info(
            "nixl agent %s up (backends %s, post_mode %s)",
            ctx.agent_name,
            self._backends,
            self._post_mode,
        )

    # ------------------------------------------------------------------ memory and handshake

    def register(self, regions: Sequence[Region]) -> None:
        new = list(regions)
        for r in new:
            if r.addr <= 0 or r.nbytes <= 0:
                raise ConfigError(f"cannot register region [{r.addr:#x}, +{r.nbytes})")
            _mem_of(r.device)
        with self._lock:
            self._check_open()
            side = _Side(self._regions + new)  # raises on overlap with what is registered
            self._ensure_cuda_device(new)
            groups: dict[tuple[int, int], list[Region]] = {}
            for r in new:
                groups.setdefault(_mem_of(r.device), []).append(r)
            for (mem, dev), rs in sorted(groups.items()):
                arr = np.array([[r.addr, r.nbytes, dev] for r in rs], dtype=np.uint64)
                try:
                    self._reg_dlists.append(self._agent.register_memory(arr, _MEM_NAMES[mem]))
                except Exception as exc:
                    raise TransportUnavailable(
                        f"nixl could not register {len(rs)} {_MEM_NAMES[mem]} region(s) on "
                        f"device {dev}: {_nixl_reason(exc)}"
                    ) from exc
            self._regions += new
            self._local = side
            old, self._lpreps = self._lpreps, {}
            for p in old.values():
                p.release()
            for block in sorted(set(old) | {self._local_block()}):
                self._local_prep(block)

    def _local_block(self) -> int:
        return self._prep_block or _auto_block(self._regions, self._prep_max)

    def _local_prep(self, block: int) -> _Prep | None:
        """Our regions prepped at ``block`` (made once, lock held); None if NIXL refused."""
        prep = self._lpreps.get(block)
        if prep is None and self._regions and self._post_mode == "prepped":
            try:
                prep = _make_prep(self._agent, "NIXL_INIT_AGENT", self._local, block)
            except Exception as exc:
                _warn_once(f"lprep{block}", "nixl could not prep our %d region(s) at %d-byte "
                           "blocks (%s): every post builds its own descriptor lists",
                           len(self._regions), block, _nixl_reason(exc))
                return None
            self._lpreps[block] = prep
        return prep

    def descriptor(self) -> bytes:
        with self._lock:
            self._check_open()
            desc = _Descriptor(
                v=_VERSION,
                agent=self.ctx.agent_name,
                host=self._host,
                metadata=bytes(self._agent.get_agent_metadata()),
                backends=list(self._backends),
                regions=[_RegionWire(r.addr, r.nbytes, r.device) for r in self._regions],
            )
        return _enc.encode(desc)

    def unreachable_reason(self, peer_descriptor: bytes, same_host: bool) -> str | None:
        try:
            desc = _decode_descriptor(peer_descriptor)
        except WireError as exc:
            return str(exc)
        common = set(desc.backends) & set(self._backends)
        if not common:
            return f"no common NIXL backend: ours {self._backends}, peer's {desc.backends}"
        return None

    def connect(self, peer: str, descriptor: bytes) -> None:
        desc = _decode_descriptor(descriptor)
        if desc.agent == self.ctx.agent_name:
            raise HandshakeError(f"nixl peer {peer!r} has our own agent name {desc.agent!r}")
        regions = [Region(r.addr, r.nbytes, r.device) for r in desc.regions]
        side = _Side(regions)
        with self._lock:
            self._check_open()
            old = self._peers.get(peer)
            if old is not None and old.descriptor == descriptor:
                return
            if old is not None:
                log.info(
                    "nixl peer %s reconnects with new metadata (agent %s -> %s): dropping the "
                    "old agent",
                    peer,
                    old.agent,
                    desc.agent,
                )
                self._drop_peer(old, "peer reconnected with new metadata")
            other = self._by_agent.get(desc.agent)
            if other is not None:
                log.warning(
                    "nixl agent %s was peer %r, now %r: dropping the old peer",
                    desc.agent,
                    other,
                    peer,
                )
                self._drop_peer(self._peers[other], f"agent {desc.agent} reconnected as {peer!r}")
            if desc.agent in self._draining and not self._await_drained(desc.agent, _DRAIN_WAIT):
                busy = sum(
                    x.agent == desc.agent and x.state.status is XferStatus.PENDING
                    for x in self._xfers.values()
                )
                raise HandshakeError(
                    f"nixl peer {peer!r} (agent {desc.agent}): {busy} transfer(s) of its previous "
                    f"connection are still in flight (UCX has not ended them); connect again later"
                )
            self._ensure_cuda_device(self._regions)
            before = _ucx.tcp_sockets() if "UCX" in self._backends else []
            try:
                name = self._agent.add_remote_agent(desc.metadata)
            except Exception as exc:
                if "NOT_ALLOWED" not in str(exc):
                    raise HandshakeError(
                        f"nixl could not load peer {peer!r} (agent {desc.agent}): "
                        f"{_nixl_reason(exc)}"
                    ) from exc
                # NIXL still holds other metadata under this name: never use it, replace it.
                self._remove_remote(desc.agent)
                try:
                    name = self._agent.add_remote_agent(desc.metadata)
                except Exception as exc2:
                    raise HandshakeError(
                        f"nixl could not load peer {peer!r} (agent {desc.agent}): "
                        f"{_nixl_reason(exc2)}"
                    ) from exc2
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != desc.agent:
                self._remove_remote(name)
                raise HandshakeError(
                    f"nixl peer {peer!r}: descriptor names agent {desc.agent!r}, "
                    f"its metadata {name!r}"
                )
            ucx: frozenset[tuple[str, int]] = frozenset()
            if "UCX" in self._backends:  # the connections UCX's endpoint creation just dialled
                ucx = _ucx.new_ucx_connections(before, _ucx.tcp_sockets(), desc.metadata)
                if not ucx:
                    log.info(
                        "nixl peer %s: UCX opened no TCP connection to it at connect (it reuses "
                        "one the peer opened, or has no tcp lane): a transfer that outlives "
                        "timeout_s cannot be torn down (docs/nixl.md 'Deadlines')",
                        peer,
                    )
            entry = _Peer(peer, name, descriptor, side, desc.host, ucx)
            entry.prep = self._prep_peer(entry)
            if (bad := _gpu_verdicts.get(self._gpu_key(desc.host == self._host))) is not None:
                self._judge_gpu_path(entry, bad, side.has_vram or self._local.has_vram)
            self._peers[peer] = entry
            self._by_agent[name] = peer
        self._check_ucx_path(peer, desc.host == self._host, side.has_vram or self._local.has_vram)

    def _prep_peer(self, p: _Peer) -> _Prep | None:
        """Prep the peer's regions once, at the block our own regions are prepped at (or a
        larger one when its memory needs it); None: posts build per-request lists."""
        if self._post_mode != "prepped" or not p.side.table.regions:
            return None
        block = self._prep_block or max(
            self._local_block(), _auto_block(p.side.table.regions, self._prep_max)
        )
        if self._local_prep(block) is None:
            return None
        t0 = time.perf_counter()
        try:
            prep = _make_prep(self._agent, p.agent, p.side, block)
        except Exception as exc:
            log.warning("nixl peer %s: could not prep its regions at %d-byte blocks (%s): its "
                        "posts build their own descriptor lists", p.key, block, _nixl_reason(exc))
            return None
        log.info("nixl peer %s: prepped %d + %d descriptors of %d bytes in %.1f ms", p.key,
                 self._lpreps[block].descriptors, prep.descriptors, block,
                 (time.perf_counter() - t0) * 1e3)
        return prep

    def disconnect(self, peer: str) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p, "peer disconnected")

    def _drop_peer(self, p: _Peer, reason: str) -> None:
        """Forget the peer (lock held); its transfers turn FAILED, each once quiescent (rule 1).

        With requests to it still in flight, its UCX connections are torn down (UCX then fails
        the endpoint, which ends them) and its NIXL agent stays loaded, "draining", until they
        are over: removing it first would make NIXL stop asking UCX about them. Without any, the
        agent is removed now."""
        self._peers.pop(p.key, None)
        if self._by_agent.get(p.agent) == p.key:
            del self._by_agent[p.agent]
        if p.prep is not None:  # requests made from it hold their own copy of the descriptors
            p.prep.release()
            p.prep = None
        live = []
        for x in self._xfers.values():
            if x.peer != p.key or x.agent != p.agent:
                continue
            if x.state.status is XferStatus.PENDING:
                live.append(x)
            else:
                self._release_reqs(x)
        in_flight = sum(self._check_reqs(x) for x in live)
        if in_flight:
            self._draining[p.agent] = p
            self._teardown(p, in_flight)
        for x in live:
            self._fail(x, f"{reason} (peer {p.key!r}, agent {p.agent})")
        if not in_flight:
            self._remove_remote(p.agent)

    def _teardown(self, p: _Peer, in_flight: int) -> int:
        """Shut down the TCP connections our UCX opened to ``p`` (lock held): UCX then fails
        the endpoint at its next progress, which ends every request on it (NIXL reports them
        NIXL_ERR_REMOTE_DISCONNECT). Returns how many were shut down."""
        first = not p.torn
        p.torn = True
        shut = _ucx.shutdown_connections(p.ucx) if p.ucx else 0
        if shut and first:
            log.warning(
                "nixl: tearing down peer %r (agent %s): shut down %d UCX TCP connection(s) to "
                "%s; its %d transfer(s) in flight end when UCX fails the endpoint",
                p.key, p.agent, shut, sorted(p.ucx), in_flight,
            )
        elif not shut and first:
            log.warning(
                "nixl: cannot tear down peer %r (agent %s): no TCP connection of this process "
                "goes to its UCX interfaces (%s); its %d transfer(s) in flight stay PENDING until "
                "UCX ends them (docs/nixl.md 'Deadlines')",
                p.key, p.agent, sorted(p.ucx) or "none seen at connect", in_flight,
            )
        return shut

    def _settle_draining(self) -> None:
        """Remove the NIXL agents of dropped peers none of whose requests is in flight any more
        (lock held)."""
        for agent in list(self._draining):
            if any(
                x.agent == agent and x.state.status is XferStatus.PENDING
                for x in self._xfers.values()
            ):
                continue
            del self._draining[agent]
            if agent not in self._by_agent:
                self._remove_remote(agent)

    def _await_drained(self, agent: str, timeout: float) -> bool:
        """Progress the requests of a draining agent until none is in flight (True) or
        ``timeout`` seconds pass (False). Lock held."""
        end = time.monotonic() + timeout
        while True:
            for x in list(self._xfers.values()):
                if x.agent == agent and x.state.status is XferStatus.PENDING:
                    self._fail(x, f"peer dropped (agent {agent})")
            self._settle_draining()
            if agent not in self._draining:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def _remove_remote(self, agent: str) -> None:
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:  # NIXL already dropped it (e.g. after a remote disconnect)
            log.debug("nixl remove_remote_agent(%s): %s", agent, _nixl_reason(exc))

    # ------------------------------------------------------------------ transfers

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",  # not checked by the owner here (docs/security.md)
    ) -> int:
        t0 = time.perf_counter()
        check_pairs(local, remote)
        notif = bytes(notify) if notify else None
        with self._lock:
            li = self._local.table.locate(local, "local extent")
            p = self._peers.get(peer)
            if self._closed or p is None:
                why = "the transport is closed" if self._closed else "it is not connected"
                return self._failed_handle(peer, f"nixl: peer {peer!r}: {why}")
            ri = p.side.table.locate(remote, "remote extent")
            if p.blocked is not None:
                return self._failed_handle(peer, p.blocked)
            if self._zombies:
                self._reap_zombies()
            n = int(local.shape[0])
            x = _Xfer(p.key, p.agent, [], [], int(local["len"].sum()) if n else 0, n, t0,
                      op=_OPS[op], deadline=time.monotonic() + self._timeout)
            handle = next(self._ids)
            self._xfers[handle] = x
            if n == 0:  # nothing moves; DONE unless its notification cannot be sent
                if notif is None or self._send_notif(x, p.agent, notif):
                    x.state = DONE
            else:
                parts: list[tuple[npt.NDArray[np.bool_] | None, int, int]]
                lk, rk = self._local.one_kind, p.side.one_kind
                if lk is not None and rk is not None:  # no per-extent lookup
                    parts = [(None, lk, rk)]
                else:
                    lmem, rmem = self._local.mem[li], p.side.mem[ri]
                    if lmem.min() == lmem.max() and rmem.min() == rmem.max():
                        parts = [(None, int(lmem[0]), int(rmem[0]))]
                    else:
                        pair = lmem.astype(np.int16) * 2 + rmem
                        parts = [(pair == k, int(k) // 2, int(k) % 2) for k in np.unique(pair)]
                        x.notify = notif
                lprep = self._lpreps.get(p.prep.block) if p.prep is not None else None
                for mask, lm, rm in parts:
                    lx, rx = (local, remote) if mask is None else (local[mask], remote[mask])
                    lr, rr = (li, ri) if mask is None else (li[mask], ri[mask])
                    idx: tuple[Any, Any] | None = None
                    if (lprep is not None and p.prep is not None
                            and lprep.side is self._local and p.prep.side is p.side
                            and lm in lprep.handles and rm in p.prep.handles):
                        pair_idx = _pair_indices(lprep, lr, lx, p.prep, rr, rx)
                        if pair_idx is not None:
                            idx = (lprep.handles[lm], pair_idx[0]), (p.prep.handles[rm],
                                                                     pair_idx[1])
                        elif not x.path:
                            _warn_once(
                                f"unaligned{p.prep.block}", "nixl: a request's extents are not "
                                "whole %d-byte blocks of the registered regions: it builds its "
                                "own descriptor lists (slower; set option prep_block_bytes to "
                                "the KV block size)", p.prep.block)
                    msg = notif if mask is None else None
                    if idx is not None:
                        x.path = x.path or "prepped"
                        err = self._post_indexed(x, _OPS[op], idx[0], idx[1], msg)
                    else:
                        x.path = x.path or ("direct" if self._post_mode == "direct"
                                            else "per-request")
                        err = self._post_one(x, _OPS[op], p.agent,
                                             _dlist(lx, self._local.dev[lr]), _MEM_NAMES[lm],
                                             _dlist(rx, p.side.dev[rr]), _MEM_NAMES[rm], msg)
                    if err is not None:  # parts already posted are cancelled or awaited
                        self._fail(x, f"nixl {op.value} to {p.key!r} failed at post: {err} "
                                   f"({x.ndesc} extents, {x.nbytes} bytes)")
                        break
        x.t_posted = time.perf_counter()
        self._account(post_seconds=x.t_posted - t0)
        return handle

    def xfer_timing(self, handle: int) -> dict[str, float | str]:
        """Host time of one post: ``pre_transfer_s`` from the post call to NIXL's transfer()
        starting (bounds checks, index computation, ``make_prepped_xfer``), ``post_call_s`` the
        whole call (over cma the copy runs inside transfer()), and ``path``: "prepped" (lists
        prepped at connect, no list built), "per-request" or "direct"."""
        with self._lock:
            x = self._xfers.get(handle)
            if x is None:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            return {
                "pre_transfer_s": (x.t_transfer or x.t_posted) - x.t_post,
                "post_call_s": x.t_posted - x.t_post,
                "path": x.path,
            }

    def _failed_handle(self, peer: str, reason: str) -> int:
        """A handle that never started (lock held): FAILED at once, nothing to wait for."""
        handle = next(self._ids)
        x = _Xfer(peer, "", [], [], 0, 0, time.perf_counter())
        self._xfers[handle] = x
        self._fail(x, reason)
        return handle

    def _post_one(
        self,
        x: _Xfer,
        op: str,
        agent: str,
        ld: npt.NDArray[np.uint64],
        lmem: str,
        rd: npt.NDArray[np.uint64],
        rmem: str,
        notif: bytes | None,
    ) -> str | None:
        a = self._agent
        msg = notif or b""
        try:
            if self._post_mode == "prepped":
                lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", ld, lmem)
                try:
                    rh = a.prep_xfer_dlist(agent, rd, rmem)
                    try:
                        idx = np.arange(ld.shape[0], dtype=np.int32)
                        req = a.make_prepped_xfer(op, lh, idx, rh, idx, notif_msg=msg)
                    finally:
                        rh.release()
                finally:
                    lh.release()
            else:
                req = a.initialize_xfer(
                    op, a.get_xfer_descs(ld, lmem), a.get_xfer_descs(rd, rmem), agent, notif_msg=msg
                )
        except Exception as exc:
            return _nixl_reason(exc)
        return self._start(x, req)

    def _post_indexed(self, x: _Xfer, op: str, local: tuple[Any, Any], remote: tuple[Any, Any],
                      notif: bytes | None) -> str | None:
        """One NIXL request from the lists prepped at connect, by index (lock held)."""
        try:
            req = self._agent.make_prepped_xfer(op, local[0], local[1], remote[0], remote[1],
                                                notif_msg=notif or b"")
        except Exception as exc:
            return _nixl_reason(exc)
        return self._start(x, req)

    def _start(self, x: _Xfer, req: Any) -> str | None:
        x.reqs.append(req)
        x.done.append(False)
        if not x.t_transfer:
            x.t_transfer = time.perf_counter()
        try:
            state = self._agent.transfer(req)
        except Exception as exc:
            return _nixl_reason(exc)
        if state == "ERR":
            return "NIXL returned ERR"
        return None

    def poll(self, handle: int) -> XferState:
        with self._lock:
            x = self._xfers.get(handle)
            if x is None:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            if x.state.status is not XferStatus.PENDING:
                return x.state
            pending = self._check_reqs(x)
            if pending and not x.expired and time.monotonic() >= x.deadline:
                self._expire(x)  # may report it FAILED already
                if x.state.status is not XferStatus.PENDING:
                    return x.state
                pending = self._check_reqs(x)
            if x.failure is not None:
                if not pending:
                    self._failed(x)
                return x.state
            if pending:
                return x.state
            if x.notify is not None and not self._send_notif(x, x.agent, x.notify):
                return x.state
            x.state = DONE
            if self._telemetry:
                for req in x.reqs:
                    try:
                        x.telemetry.append(self._agent.get_xfer_telemetry(req))
                    except Exception as exc:
                        log.debug("nixl telemetry: %s", _nixl_reason(exc))
        self._account(
            transfers=1,
            bytes=x.nbytes,
            descriptors=x.ndesc,
            xfer_seconds=time.perf_counter() - x.t_post,
        )
        return DONE

    def release(self, handle: int) -> None:
        with self._lock:
            x = self._xfers.pop(handle, None)
            if x is not None:
                self._release_reqs(x)
            if self._zombies:
                self._reap_zombies()
            if self._draining:
                self._settle_draining()

    def xfer_telemetry(self, handle: int) -> list[dict[str, float]]:
        """NIXL telemetry of a DONE transfer (needs ``options["telemetry"]``), one dict per NIXL
        request: start_us, post_us, xfer_us, bytes, descriptors (after NIXL's merging)."""
        with self._lock:
            x = self._xfers.get(handle)
            if x is None:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            out = []
            for t in x.telemetry:
                out.append(
                    {
                        "start_us": float(getattr(t, "startTime", 0)),
                        "post_us": float(getattr(t, "postDuration", 0)),
                        "xfer_us": float(getattr(t, "xferDuration", 0)),
                        "bytes": float(getattr(t, "totalBytes", 0)),
                        "descriptors": float(getattr(t, "descCount", 0)),
                    }
                )
            return out

    def _fail(self, x: _Xfer, reason: str) -> None:
        """Fail ``x`` (lock held): FAILED with the first error once none of its requests is in
        flight; until then it stays PENDING and poll keeps asking NIXL about them. (Releasing
        one would not stop it, only hide it: see the module doc.)"""
        if x.state.status is not XferStatus.PENDING:
            return
        if x.failure is None:
            x.failure = reason
            log.warning("%s", reason)
        if not self._check_reqs(x):
            self._failed(x)

    def _failed(self, x: _Xfer) -> None:
        """``x`` has a failure and nothing in flight (lock held): report it FAILED."""
        if x.state.status is not XferStatus.PENDING:
            return
        x.state = XferState(XferStatus.FAILED, x.failure or "nixl transfer failed")
        self._account(failed=1)
        if x.agent in self._draining:
            self._settle_draining()

    def _check_reqs(self, x: _Xfer) -> bool:
        """Ask NIXL about each request of ``x`` not known to be over (lock held); a request
        that is no longer PROC is over (DONE, or ended by an error). Records the first error in
        ``x.failure``. True while one is still in flight."""
        pending = False
        for i, req in enumerate(x.reqs):
            if x.done[i] or req is None:
                continue
            try:
                s = self._agent.check_xfer_state(req)
            except Exception as exc:
                s, err = "ERR", _nixl_reason(exc)
            else:
                err = "NIXL returned ERR"
            if s == "PROC":
                pending = True
                continue
            x.done[i] = True
            if s != "DONE" and x.failure is None:  # the others may still be moving bytes
                x.failure = f"nixl transfer with {x.peer!r} (agent {x.agent}) failed: {err}"
        return pending

    def _expire(self, x: _Xfer) -> None:
        """``x`` outlived its deadline with requests in flight (lock held): fail it, and tear
        down its peer so that UCX ends them (every transfer of that peer fails with it)."""
        x.expired = True
        why = (
            f"nixl {x.op or 'transfer'} {'from' if x.op == 'READ' else 'to'} peer {x.peer!r} "
            f"(agent {x.agent}) did not complete within timeout_s={self._timeout:g}s (peer hung "
            f"or unreachable)"
        )
        if x.failure is None:
            x.failure = why
            log.warning("%s", why)
        p = self._peers.get(x.peer)
        if p is not None and p.agent == x.agent:
            self._drop_peer(
                p, f"torn down: a transfer to it outlived timeout_s={self._timeout:g}s"
            )
        elif (d := self._draining.get(x.agent)) is not None:
            self._teardown(d, 1)  # dropped already; UCX may have dialled it again since

    def _send_notif(self, x: _Xfer, agent: str, msg: bytes) -> bool:
        try:
            self._agent.send_notif(agent, msg)
        except Exception as exc:
            self._fail(x, f"nixl notification to {x.peer!r} failed: {_nixl_reason(exc)}")
            return False
        return True

    def _release_reqs(self, x: _Xfer) -> None:
        for req in x.reqs:
            if req is None:
                continue
            try:
                req.release()
            except Exception as exc:
                log.debug("nixl release_xfer_handle deferred: %s", _nixl_reason(exc))
                self._zombies.append(req)
        x.reqs = []
        x.done = []

    def _reap_zombies(self) -> None:
        keep = []
        for req in self._zombies:
            try:
                req.release()
            except Exception:
                keep.append(req)
        self._zombies = keep

    def _handle_counts(self) -> dict[str, int]:
        """Sizes of the internal tables (tests check they drain)."""
        with self._lock:
            return {
                "xfers": len(self._xfers),
                "nixl_requests": sum(
                    sum(r is not None for r in x.reqs) for x in self._xfers.values()
                ),
                "zombies": len(self._zombies),
                "peers": len(self._peers),
            }

    # ------------------------------------------------------------------ notifications

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._closed:
                return []
            self._drain_notifs()
            out, self._notes = self._notes, []
        return out

    def _drain_notifs(self) -> None:
        """Progress UCX and move new NIXL notifications into our queue (lock held)."""
        new = self._agent.get_new_notifs()
        for agent, msgs in new.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            self._notes.extend((name, bytes(m)) for m in msgs)
            if self._expected:
                with self._expect_lock:
                    self._expected = max(0, self._expected - len(msgs))

    def expect_access(self, seconds: float, count: int = 1) -> None:
        """Progress UCX every ``progress_fast_interval`` until ``count`` more notifications have
        arrived or ``seconds`` pass. Why: NIXL sends an initiator's notification after its
        transfer, and the initiator sees the transfer DONE only once this side's UCX worker has
        progressed; measured on one host over cma (2-16 blocks of 4 x 32 KiB), NIXL's
        ``xferDuration`` of a READ is ~1 ms with this side progressing every 1 ms and ~0.2 ms
        every 20-100 us. Polling that fast all the time would cost a core, so the owner says when
        transfers are due (kvlink's producer: when it answers a read intent). Without our own
        progress thread (``progress_thread`` or ``progress_interval`` 0) this does nothing."""
        if self._progress is None or seconds <= 0 or count <= 0 or self._closed:
            return
        # callers answer peers on a side-channel thread: never wait for self._lock (held across
        # NIXL calls), only for the two counters' own lock
        with self._expect_lock:
            if self._expect_until < time.monotonic():
                self._expected = 0
            self._expected += int(count)
            self._expect_until = max(self._expect_until, time.monotonic() + float(seconds))
        self._wake.set()

    def _expecting(self) -> bool:
        """Whether announced transfers are still due."""
        with self._expect_lock:
            if self._expected and time.monotonic() >= self._expect_until:
                self._expected = 0
            return self._expected > 0

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._check_open()
            p = self._peers.get(peer)
            if p is None:
                raise TransferError(f"nixl: peer {peer!r} is not connected")
            try:
                self._agent.send_notif(p.agent, bytes(message))
            except Exception as exc:
                raise TransferError(
                    f"nixl notification to {peer!r} (agent {p.agent}) failed: {_nixl_reason(exc)}"
                ) from exc

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Fail every transfer, forget every peer, deregister memory, stop our threads.

        Peers with requests in flight are torn down (their UCX connections shut down) and get
        up to 0.5 s for UCX to end them. A transfer still in flight after that stays PENDING
        (poll still works) and then the memory stays registered: deregistering it under an
        active request would let the request touch memory NIXL no longer accounts for."""
        self._stop.set()
        self._wake.set()
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=False, cancel_futures=True)
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(2.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for x in self._xfers.values():
                if x.state.status is XferStatus.PENDING:
                    self._fail(x, "nixl transport closed")
                else:
                    self._release_reqs(x)
            for p in list(self._peers.values()):
                self._drop_peer(p, "transport closed")  # tears down peers with requests in flight
            end = time.monotonic() + _CLOSE_DRAIN  # UCX fails those endpoints at next progress
            for agent in list(self._draining):
                self._await_drained(agent, max(0.0, end - time.monotonic()))
            self._reap_zombies()
            stuck = sum(x.state.status is XferStatus.PENDING for x in self._xfers.values())
            if stuck:
                log.warning("nixl: %d transfer(s) could not be cancelled at close; keeping the "
                            "memory registered", stuck)
                return
            for prep in self._lpreps.values():
                prep.release()
            self._lpreps = {}
            for dl in self._reg_dlists:
                try:
                    self._agent.deregister_memory(dl)
                except Exception as exc:
                    log.warning("nixl deregister_memory failed: %s", _nixl_reason(exc))
            self._reg_dlists = []
            self._zombies = []

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("nixl transport is closed")

    # ------------------------------------------------------------------ environment checks

    def _ensure_cuda_device(self, regions: Sequence[Region]) -> None:
        """UCX only enables cuda_ipc with a CUDA context current on the calling thread."""
        for r in regions:
            mem, dev = _mem_of(r.device)
            if mem == 1:
                import torch

                torch.cuda.set_device(int(dev))
                return

    def _check_ucx_path(self, peer: str, same_host: bool, vram: bool) -> None:
        """Start the UCX path check of a new peer on the probe thread (see ``ucx_probe``)."""
        if not self._ucx_probe or "UCX" not in self._backends or self._closed:
            return
        if self._probe_pool is None:
            self._probe_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvlink-ucx-probe")
        self._probes = [f for f in self._probes if not f.done()]
        self._probes.append(self._probe_pool.submit(self._probe_ucx_path, peer, same_host, vram))

    def wait_probes(self, timeout: float) -> bool:
        """Wait for the UCX path checks started so far; True if all finished in time."""
        _done, pending = cf.wait(list(self._probes), timeout)
        return not pending

    @staticmethod
    def _gpu_key(same_host: bool) -> tuple[Any, ...]:
        return (same_host, tuple(sorted((k, v or "") for k, v in _ucx.ucx_settings().items())))

    def _gpu_device(self) -> int:
        for r in self._regions:
            mem, dev = _mem_of(r.device)
            if mem == 1:
                return int(dev)
        return 0

    def _gpu_verdict(self, same_host: bool) -> _ucx.LaneVerdict:
        """What carries a GPU pair's bytes (cached per process and UCX settings)."""
        key = self._gpu_key(same_host)
        v = _gpu_verdicts.get(key)
        if v is not None:
            return v
        if same_host:
            pr = _ucx.nixl_probe("VRAM", 64 << 20, 2, timeout=120, device=self._gpu_device())
            v = _ucx.classify_lanes(pr.lanes, vram=True, same_host=True,
                                    protocols=pr.protocols)
            if not pr.ok and v.verdict == "unknown":
                v = _ucx.LaneVerdict("unknown", f"the NIXL VRAM probe failed: {pr.error}")
            log.info("nixl: measured NIXL VRAM path on this host: lanes %s, GB/s %s -> %s",
                     pr.lanes, {k: round(g, 1) for k, g in pr.gbps.items()}, v.verdict)
        else:
            rma = _ucx.rma_transports("inter")
            lanes = {"read": [f"{t}/" for t in rma], "write": [f"{t}/" for t in rma]}
            v = _ucx.classify_lanes(lanes, vram=True, same_host=False)
            if rma:
                v = dataclasses.replace(v, reason=f"{v.reason} (predicted by ucx_info)")
        _gpu_verdicts[key] = v
        return v

    def _judge_gpu_path(self, p: _Peer, v: _ucx.LaneVerdict, vram: bool) -> None:
        """A GPU pair on tcp / cuda_copy / emulation: its posts fail unless allow_slow_gpu
        (lock held)."""
        if not vram or v.verdict != "slow":
            return
        why = (f"nixl peer {p.key!r}: GPU memory would move over a slow UCX path: {v.reason}. "
               f"Fix: UCX_TLS must allow cuda_ipc (same host) or rc/dc with GPUDirect RDMA "
               f"(other hosts), UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, the CUDA device set before "
               f"connect; see `kvlink doctor`. To accept it, set nixl option "
               f"allow_slow_gpu=True")
        if self._allow_slow_gpu:
            _warn_once(f"slowgpu-{v.reason}", "%s (allowed: allow_slow_gpu)", why)
            return
        if p.blocked is None:
            log.error("!!! %s; its transfers fail until then", why)
        p.blocked = why

    def _probe_ucx_path(self, peer: str, same_host: bool, vram: bool) -> None:
        placement = "intra" if same_host else "inter"
        rma = _ucx.rma_transports(placement)
        log.info(
            "nixl peer %s: %s host, UCX RMA predicted over %s",
            peer,
            "same" if same_host else "other",
            ",".join(rma) or "unknown (no ucx_info)",
        )
        if not same_host and _ucx.tcp_fallback_between_hosts() is True:
            _warn_once(
                "tcp",
                "NIXL/UCX moves KV between hosts over TCP (peer %s; UCX RMA lanes: %s; "
                "transports here: %s). Expect ~1 GB/s instead of the NIC's line rate: install "
                "RDMA drivers (rdma-core) and check UCX_TLS.",
                peer,
                ",".join(rma),
                ",".join(_ucx.ucx_transports()),
            )
        if vram:
            v = self._gpu_verdict(same_host)
            with self._lock:
                p = self._peers.get(peer)
                if p is not None:
                    self._judge_gpu_path(p, v, True)
            if v.verdict != "unknown":
                return
        if vram and _ucx.gpu_staged(same_host) is True:
            _warn_once(
                "cuda_copy",
                "NIXL/UCX stages GPU memory for peer %s through host buffers (cuda_copy): no "
                "%s among UCX transports %s. Set the CUDA device before connect and check "
                "UCX_TLS includes cuda_ipc / rc.",
                peer,
                "cuda_ipc" if same_host else "GPUDirect RDMA transport",
                ",".join(_ucx.ucx_transports()),
            )
