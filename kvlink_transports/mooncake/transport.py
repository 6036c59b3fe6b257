"""``mooncake``: one-sided READ/WRITE through the Mooncake Transfer Engine.

One ``mooncake.engine.TransferEngine`` per transport instance, initialised with metadata
``P2PHANDSHAKE`` (no etcd: peers find each other by the engine's session id ``host:rpc_port``)
and protocol ``tcp`` (default) or ``rdma``. Registered regions go to ``register_memory``. The
descriptor a peer gets is a versioned msgspec struct: the session id, the protocol and the table of
registered regions, which bounds every remote extent we later post against that peer (local
extents are bounded by our own table); both checks run before anything is posted and raise
:class:`~kvlink.errors.ExtentOutOfBounds`.

**Posting.** One :meth:`MooncakeTransport.post` is split into sub-batches (at most ``sub_batch``
entries and ``sub_batch_bytes`` bytes each) that go to ``batch_transfer_async_write`` /
``batch_transfer_async_read``. The engine's TCP path refuses entries beyond ~1024 queued per
peer ("TCP lane queue-full rejection"), so each peer keeps at most ``max_inflight_per_peer``
entries in flight (default 1024, or ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when set) and
submits the next sub-batch as earlier ones complete.

**Completion.** One thread per peer waits on the engine: :mod:`kvlink_transports.mooncake.peer`.

**Failures.** A failed sub-batch is probed (``send_probe``): a peer that does not answer fails
every transfer queued for it at once; otherwise the sub-batch is resubmitted (re-writing the same
bytes is harmless) up to ``max_retries`` times with exponential backoff from ``retry_backoff_s``.
A handle never completes half-applied: if any sub-batch fails for good, the whole handle is
FAILED, its unsent sub-batches are dropped and the state is reported once its other in-flight
sub-batches have returned. An engine call that has not returned within ``timeout_s`` (a hung
peer) marks every transfer of that peer failed at the next :meth:`poll`: nothing more of them is
submitted, and each reports FAILED once the engine has returned every sub-batch it was given —
at the latest at the engine's own timeout (``MC_TRANSFER_TIMEOUT``, set from ``timeout_s`` unless
already set, minimum 5 s; the engine reads it when the first transport of the process starts).
Until then bytes may still land, so the handle stays PENDING (contract rule 1 in
``kvlink/transport.py``): a caller that frees blocks on FAILED never has them overwritten later
by anything this transport still waits on. (Seen on the TCP protocol: after the engine returned
a timed-out batch, its TCP session to a stopped peer was still writing the WRITE's body — bytes
the target may yet apply; only the target's fence can rule that out.)
:meth:`MooncakeTransport.post` gives a FAILED handle for an unknown peer or a closed transport;
:meth:`MooncakeTransport.close` waits at most ``_CLOSE_WAIT`` seconds for the peer threads (a
thread inside an engine call on a hung peer ends when that call returns, and the memory stays
registered).

**Notifications.** The engine has none usable here (``native_notifications=False``): the kvlink
worker sends them over its side channel; :meth:`notify` raises and :meth:`notifications` is empty.

Options: ``protocol`` ("tcp" | "rdma"), ``device_name`` (RDMA NIC filter, e.g. "mlx5_0"; empty =
all), ``metadata_server`` (default "P2PHANDSHAKE"), ``timeout_s`` (30), ``max_inflight_per_peer``
(1024), ``sub_batch`` (entries per engine batch, default ``max_inflight_per_peer // 4``),
``sub_batch_bytes`` (256 MiB), ``max_retries`` (5), ``retry_backoff_s`` (0.01), ``location``
(``register_memory`` location of cpu regions, default "*": the engine detects the NUMA node),
``probe`` (check the peer answers at :meth:`connect`, default True), ``quiet`` (default True:
sets ``MC_LOG_LEVEL=WARNING`` and ``GLOG_minloglevel=1``, each unless already set, before the
engine loads, so its INFO lines — per engine, connection and batch — stay out of the log).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import (
    ConfigError,
    TransportUnavailable,
    WireError,
)
from kvlink.options import resolve
from kvlink.staging import StreamMarks, mark_post
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
from kvlink_transports.mooncake.calls import within
from kvlink_transports.mooncake.peer import _Peer, _Xfer
from kvlink_transports.mooncake.wire import (
    _PROTOCOLS,
    _VERSION,
    _decode_descriptor,
    _Descriptor,
    _enc,
    _location,
)

log = logging.getLogger("kvlink.mooncake")

PIP_HINT = (
    "pip install 'kvlink[mooncake-cpu]' on a CPU host (= mooncake-transfer-engine-non-cuda),"
    " pip install mooncake-transfer-engine on a GPU host; it needs libibverbs1:"
    " apt-get install libibverbs1"
)
_CLOSE_WAIT = 1.5  # seconds close() waits for the peer threads before giving up on them
_WIRE_UP_BYTES = 64  # what connect reads of a peer: any transfer opens the engine's session
#: connect's scratch buffers, one per transport: a wire-up READ to a peer that hung may land
#: whenever the peer resumes, so none is ever unregistered or freed
_KEEP: list[npt.NDArray[np.uint8]] = []


def _import_engine(quiet: bool) -> Any:
    if quiet:  # (each unless already set; read when the engine loads)
        # the engine's own logger (it ignores GLOG_minloglevel, which alone left its INFO
        # lines, about ten per engine and per connection, in every log)
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake import engine
    except ImportError as exc:
        raise TransportUnavailable(
            f"the mooncake transport needs the Mooncake Transfer Engine ({exc}); install it with "
            f"`{PIP_HINT}`"
        ) from exc
    return engine


def split_bounds(lengths: npt.NDArray[np.uint64], max_entries: int, max_bytes: int) -> list[int]:
    """Cut points [0, ..., n] so each piece has <= max_entries entries and <= max_bytes bytes
    (a single entry larger than max_bytes gets a piece of its own)."""
    n = int(lengths.shape[0])
    cs = np.cumsum(lengths, dtype=np.uint64)
    cuts, i = [0], 0
    while i < n:
        base = int(cs[i - 1]) if i else 0
        j = int(np.searchsorted(cs, np.uint64(base + max_bytes), side="right"))
        j = min(max(j, i + 1), i + max_entries, n)
        cuts.append(j)
        i = j
    return cuts


def _opt_int(opts: Mapping[str, Any], key: str, lo: int, computed: int = 0) -> int:
    """``opts[key]`` (resolved: the schema's default where not given), ``computed`` where the
    schema leaves it to the transport (None); an integer >= ``lo`` or a ConfigError."""
    value = opts[key]
    if value is None:
        value = computed
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"mooncake option {key} must be an integer >= {lo}: {value!r}")
    return value


def _opt_float(opts: Mapping[str, Any], key: str, lo: float) -> float:
    value = opts[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= lo:
        raise ConfigError(f"mooncake option {key} must be a number >= {lo}: {value!r}")
    return float(value)


class MooncakeTransport(Transport):
    name = "mooncake"
    capabilities = Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}),
        memory_kinds=frozenset({"cpu", "cuda"}),  # cuda regions need a CUDA build of the engine
        same_host_only=False,
        native_notifications=False,
    )

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        opts = resolve("mooncake", self.options)
        self.protocol = str(opts["protocol"])
        if self.protocol not in _PROTOCOLS:
            raise ConfigError(
                f"mooncake option protocol must be one of {_PROTOCOLS}: {self.protocol!r}"
            )
        self.device_name = str(opts["device_name"])
        self.metadata_server = str(opts["metadata_server"])
        self.timeout = _opt_float(opts, "timeout_s", 0.001)
        env_cap = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "")
        default_cap = int(env_cap) if self.protocol == "tcp" and env_cap.isdigit() else 1024
        self.max_inflight = _opt_int(opts, "max_inflight_per_peer", 1, computed=max(default_cap, 1))
        quarter = max(self.max_inflight // 4, 1)
        self.sub_batch = min(_opt_int(opts, "sub_batch", 1, computed=quarter), self.max_inflight)
        self.sub_batch_bytes = _opt_int(opts, "sub_batch_bytes", 1)
        self.max_retries = _opt_int(opts, "max_retries", 0)
        self.retry_backoff = _opt_float(opts, "retry_backoff_s", 0.0)
        self._cpu_location = str(opts["location"])
        self._probe = bool(opts["probe"])
        #: stream order (kvlink.transport rule 6) for our VRAM: the engine copies on its own,
        #: knowing nothing of the caller's stream; None until VRAM is registered (or off)
        self._stream_order = bool(opts["stream_order"])
        self._marks: StreamMarks | None = None
        self._vram = np.zeros(0, dtype=bool)  # per region of self._table: in VRAM
        engine_cap = int(env_cap) if env_cap.isdigit() else 1024  # (the engine's default)
        if self.protocol == "tcp" and self.max_inflight > engine_cap:
            log.warning(
                "mooncake: max_inflight_per_peer=%d exceeds the engine's queue of %d entries "
                "per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER%s); expect queue-full "
                "refusals: set that variable to at least the option",
                self.max_inflight,
                engine_cap,
                f"={env_cap}" if env_cap.isdigit() else " unset: 1024",
            )
        host = ctx.advertise_host or ctx.host
        if host in ("", "0.0.0.0", "::"):
            raise TransportUnavailable(
                f"mooncake publishes its own address and cannot use "
                f"{host!r}; set advertise_host to this host's address"
            )
        self._mod = _import_engine(bool(opts["quiet"]))
        # the binding reads its batch timeout once, in the constructor
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(self.timeout))))
        self._engine: Any = self._mod.TransferEngine()
        rc = self._engine.initialize(host, self.metadata_server, self.protocol, self.device_name)
        if rc != 0:
            raise TransportUnavailable(
                f"mooncake TransferEngine.initialize({host!r}, {self.metadata_server!r}, "
                f"{self.protocol!r}, {self.device_name!r}) failed with {rc}"
            )
        self.session = f"{host}:{int(self._engine.get_rpc_port())}"
        self._lock = threading.Lock()
        self._regions: tuple[Region, ...] = ()
        self._table = RegionTable(())
        self._xfers: dict[int, _Xfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._handles = itertools.count(1)
        self._closed = False
        self._wire_scratch: npt.NDArray[np.uint8] | None = None  # (see _probe_within)
        log.info(
            "mooncake engine %s (%s, metadata %s)",
            self.session,
            self.protocol,
            self.metadata_server,
        )

    # ------------------------------------------------------------------ contract
    def register(self, regions: Sequence[Region]) -> None:
        regions = list(regions)
        locations = [_location(r.device, self._cpu_location) for r in regions]
        if any(loc.startswith("cuda") for loc in locations) and not getattr(
            self._mod, "SUPPORT_CUDA", False
        ):
            raise TransportUnavailable(
                "this Mooncake build has no CUDA support (mooncake-transfer-engine-non-cuda); "
                "use host staging (kv_buffer_device='cpu') or pip install "
                "mooncake-transfer-engine"
            )
        table = RegionTable(self._regions + tuple(regions))  # rejects overlaps before any work
        done: list[int] = []
        for r, loc in zip(regions, locations):
            rc = self._engine.register_memory(r.addr, r.nbytes, loc)
            if rc != 0:
                for addr in done:
                    self._engine.unregister_memory(addr)
                raise TransportUnavailable(
                    f"mooncake register_memory([{r.addr:#x}, +{r.nbytes}), {loc!r}) "
                    f"failed with {rc}"
                )
            done.append(r.addr)
        cuda = [loc for loc in locations if loc.startswith("cuda")]
        with self._lock:
            self._regions = self._regions + tuple(regions)
            self._table = table
            self._vram = np.array([r.device.startswith("cuda") for r in table.regions],
                                  dtype=bool)
            if cuda and self._stream_order and self._marks is None:
                self._marks = StreamMarks(int(cuda[0].partition(":")[2] or 0))

    def descriptor(self) -> bytes:
        return _enc.encode(
            _Descriptor(
                v=_VERSION,
                agent=self.ctx.agent_name,
                session=self.session,
                protocol=self.protocol,
                regions=[(r.addr, r.nbytes, r.device) for r in self._regions],
            )
        )

    def unreachable_reason(self, peer_descriptor: bytes, same_host: bool) -> str | None:
        try:
            desc = _decode_descriptor(peer_descriptor)
        except WireError as exc:
            return str(exc)
        if desc.protocol != self.protocol:
            return f"peer speaks mooncake protocol {desc.protocol!r}, we speak {self.protocol!r}"
        return super().unreachable_reason(peer_descriptor, same_host)

    def connect(self, peer: str, descriptor: bytes) -> None:
        desc = _decode_descriptor(descriptor)
        if desc.protocol != self.protocol:
            raise TransportUnavailable(
                f"mooncake peer {peer} speaks {desc.protocol!r}, we speak {self.protocol!r}"
            )
        if self._probe:
            rc = self._probe_within(desc)
            if rc != 0:
                why = (f"within timeout_s={self.timeout:g}s (peer hung)" if rc is None
                       else f"({rc})")
                raise TransportUnavailable(
                    f"mooncake peer {peer} at {desc.session} does not answer {why}")
        with self._lock:
            if self._closed:
                raise TransportUnavailable("mooncake transport is closed")
            old = self._peers.pop(peer, None)
            self._peers[peer] = _Peer(self, peer, desc)
            if old is not None:
                old.closed = True
                old.fail_all(f"mooncake: peer {peer} reconnected")

    def _probe_within(self, desc: _Descriptor) -> int | str | None:
        """0 where the peer answered ``send_probe`` and served a READ of
        ``_WIRE_UP_BYTES`` of its first region within ``timeout_s``; None where it did not
        answer in time; else what failed. Why a thread: the engine waits for a hung (stopped)
        peer in its own session setup, ~60 s whatever ``timeout_s`` says (a connect took
        60.4 s with timeout_s=2), and a handshake must not (:func:`~kvlink_transports.
        mooncake.calls.within`); the call touches nothing of ours but the scratch, which is
        never freed.

        Why the READ: ``send_probe`` does not open the engine's data session to the peer, the
        first transfer does — and a peer that hung after connect held that first transfer in
        the same ~60 s setup, past every deadline of ours (FAILED at 60.5 s with timeout_s=2,
        where a transfer on an open session fails at the engine's batch timeout, 5 s). After
        this READ every transfer finds the session open."""
        target = next((r for r in sorted(desc.regions, key=lambda r: r[2] != "cpu")
                       if r[1] > 0), None)  # (host memory first: any engine build reads it)
        scratch = self._scratch() if target is not None else 0

        def probe() -> int | str:
            rc = int(self._engine.send_probe(desc.session))
            if rc != 0 or target is None:
                return rc if rc == 0 else f"send_probe returned {rc}"
            n = min(_WIRE_UP_BYTES, int(target[1]))
            rc = int(self._engine.transfer_sync_read(desc.session, scratch, int(target[0]), n))
            return rc if rc == 0 else f"a READ of {n} bytes at {int(target[0]):#x} returned {rc}"

        return within(probe, self.timeout, f"kvlink-mooncake-probe-{desc.session}")

    def _scratch(self) -> int:
        """Our registered scratch for wire-up READs (made once per transport, kept forever)."""
        with self._lock:
            if self._wire_scratch is None:
                buf = np.zeros(4096, dtype=np.uint8)
                rc = self._engine.register_memory(buf.ctypes.data, buf.nbytes, self._cpu_location)
                if rc != 0:
                    raise TransportUnavailable(
                        f"mooncake register_memory of connect's {buf.nbytes}-byte scratch "
                        f"failed with {rc}")
                _KEEP.append(buf)
                self._wire_scratch = buf
            return int(self._wire_scratch.ctypes.data)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:
                old.closed = True
                old.fail_all(f"mooncake: peer {peer} disconnected")

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",  # not checked by the owner here (docs/security.md)
    ) -> int:
        t0 = time.perf_counter()
        if notify is not None:
            raise TransportUnavailable(
                "mooncake has no native notifications; send them over "
                "the side channel (the kvlink worker does)"
            )
        check_pairs(local, remote)
        with self._lock:
            p = self._peers.get(peer)
            li = self._table.locate(local, "local extent")
            n = int(local.shape[0])
            if self._closed or p is None:
                why = "the transport is closed" if self._closed else "it is not connected"
                return self._failed_handle(op, peer, local, remote, t0,
                                           f"mooncake: peer {peer!r}: {why}")
            p.table.locate(remote, "remote extent")
            x = _Xfer(
                op,
                p,
                np.ascontiguousarray(local),
                np.ascontiguousarray(remote),
                int(local["len"].sum()) if n else 0,
                t0,
            )
            handle = next(self._handles)
            self._xfers[handle] = x
            if n == 0:
                self._finish(x, DONE)
            else:
                x.after = self._stream_mark(li)
                p.enqueue(x, split_bounds(x.local["len"], self.sub_batch, self.sub_batch_bytes))
        self._account(post_seconds=time.perf_counter() - t0, descriptors=n)
        return handle

    def _stream_mark(self, li: np.ndarray) -> Any:
        """A mark of the caller's current CUDA stream where this post touches our VRAM and
        that stream has work pending (the peer's thread waits for it before submitting);
        else None. Without it a WRITE source (or READ destination) still being written on the
        caller's stream moves stale bytes (as NIXL's did: docs/nixl.md, "Stream order")."""
        return mark_post(self._marks, self._vram, li)

    def _await_stream(self, mark: Any) -> None:
        assert self._marks is not None
        self._marks.synchronize(mark)

    def _drop_mark(self, mark: Any) -> None:
        assert self._marks is not None
        self._marks.drop(mark)

    def _failed_handle(
        self, op: Op, peer: str, local: Extents, remote: Extents, t0: float, reason: str
    ) -> int:
        """A handle that never started (lock held): FAILED at once."""
        x = _Xfer(op, None, local, remote, 0, t0)
        handle = next(self._handles)
        self._xfers[handle] = x
        log.warning("%s", reason)
        self._finish(x, XferState(XferStatus.FAILED, reason))
        return handle

    def poll(self, handle: int) -> XferState:
        x = self._xfers.get(handle)
        if x is None:
            return XferState(XferStatus.FAILED, f"unknown or released handle {handle}")
        p = x.peer
        if x.state is PENDING and p is not None:
            since = p.call_since
            if since is not None and time.monotonic() - since > self.timeout:
                with self._lock:
                    since = p.call_since
                    if (
                        since is not None
                        and time.monotonic() - since > self.timeout
                        and any(y.failure is None for y in p.xfers)
                    ):
                        # (said where an operator looks: the engine leaves its sessions
                        # running, so a peer that hung and resumes can still land bytes of
                        # what is failed here — bench/results/mooncake_resume/)
                        log.warning(
                            "mooncake: %s: engine call blocked for %.1fs > timeout_s; "
                            "failing its transfers once the engine returns their sub-batches "
                            "(if the peer resumes, their bytes may still land: the engine "
                            "cannot cancel them, docs/mooncake.md)",
                            p.where(),
                            time.monotonic() - since,
                        )
                        p.fail_all(
                            f"mooncake: {p.where()} did not complete a transfer within "
                            f"{self.timeout:.1f}s (peer hung or unreachable)"
                        )
        return x.state

    def release(self, handle: int) -> None:
        with self._lock:
            self._xfers.pop(handle, None)

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def notify(self, peer: str, message: bytes) -> None:
        raise TransportUnavailable(
            "mooncake has no native notifications; the kvlink worker "
            "sends them over the side channel"
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            for p in peers:
                p.closed = True
                p.fail_all("mooncake transport closed")
        deadline = time.monotonic() + _CLOSE_WAIT
        for p in peers:
            p.thread.join(max(deadline - time.monotonic(), 0.0))
        if any(p.thread.is_alive() for p in peers):
            log.warning(
                "mooncake: engine calls still running at close; keeping the memory registered"
            )
            return
        for r in self._regions:
            self._engine.unregister_memory(r.addr)

    def inflight(self) -> int:
        return sum(1 for x in list(self._xfers.values()) if x.state is PENDING)

    # ------------------------------------------------------------------ internals
    def _submit(self, op: Op, session: str, local: Extents, remote: Extents) -> tuple[int, str]:
        """Hand one sub-batch to the engine: (batch id, "") or (0, why)."""
        fn = (
            self._engine.batch_transfer_async_write
            if op is Op.WRITE
            else self._engine.batch_transfer_async_read
        )
        try:
            bid = int(
                fn(session, local["addr"].tolist(), remote["addr"].tolist(), local["len"].tolist())
            )
        except Exception as exc:
            return 0, f"submit raised {exc!r}"
        return bid, "" if bid else "the engine refused the batch (submit returned 0)"

    def _settle(self, x: _Xfer, force: bool = False) -> None:
        """Decide a transfer's final state once nothing of it is in flight (lock held)."""
        if x.state is not PENDING:
            return
        if x.failure is not None:
            if x.inflight == 0 or force:
                self._finish(x, XferState(XferStatus.FAILED, x.failure))
        elif x.queued == 0 and x.inflight == 0:
            self._finish(x, DONE)

    def _finish(self, x: _Xfer, state: XferState) -> None:
        if x.peer is not None:
            x.peer.xfers.discard(x)
        if state.status is XferStatus.DONE:
            self._account(transfers=1, bytes=x.nbytes, xfer_seconds=time.perf_counter() - x.t_post)
        else:
            self._account(failed=1)
        x.state = state
