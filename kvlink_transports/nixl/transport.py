"""``nixl``: one-sided READ/WRITE through NVIDIA NIXL (UCX backend by default).

One NIXL agent per transport instance, named ``ctx.agent_name``. KV memory is registered once
(``cpu`` regions as DRAM device 0, ``cuda:N`` regions as VRAM device N). The descriptor a peer gets
is a versioned msgspec struct: the agent's NIXL metadata, the host identity, the backends, and the
table of registered regions, which bounds every remote extent we later post against that peer.

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
transfer, see :mod:`kvlink_transports.nixl.requests`). The probe runs ``ucx_info`` (0.5 s on
an idle machine, tens of seconds on a loaded one), so it runs on a background thread after
:meth:`NixlTransport.connect`, never on a handshake's path (:meth:`NixlTransport.wait_probes`
waits for it).

The jobs are split by module, bottom to top: ``agent`` (NIXL as a library: import, logs, the
agent and its backends), ``memory`` (memory kinds, descriptor lists prepped once, block indices,
the mixed-memory split), ``wire`` (the descriptor), ``records`` (what is kept per peer and per
transfer), ``progress`` (the light progress thread and the expect window), ``requests`` (how a
transfer's requests end: failure once quiescent, deadlines, teardown, draining, zombies),
``transfers`` (post and poll, timing and telemetry), ``lanes`` (which UCX lanes carry a peer's
bytes), and this one: options, registration, the handshake, notifications and close.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvlink.errors import (
    ConfigError,
    HandshakeError,
    TransferError,
    TransportUnavailable,
    WireError,
)
from kvlink.options import resolve
from kvlink.staging import StreamMarks
from kvlink.transport import Capabilities, Op, PerBases, Region, TransportContext, XferStatus
from kvlink_transports import _ucx
from kvlink_transports.nixl.agent import _import_nixl, _nixl_reason, _warn_once, start_agent
from kvlink_transports.nixl.lanes import _LaneChecks
from kvlink_transports.nixl.memory import (
    _MEM_NAMES,
    _auto_block,
    _check_block,
    _make_prep,
    _mem_of,
    _Prep,
    _Side,
)
from kvlink_transports.nixl.progress import ProgressThread
from kvlink_transports.nixl.records import _Peer
from kvlink_transports.nixl.wire import _VERSION, _decode_descriptor, _Descriptor, _enc, _RegionWire
from kvlink_transports.nixl.wireup import _WireUp

log = logging.getLogger("kvlink.nixl")

_DRAIN_WAIT = 2.0  # connect: how long to wait for a dropped peer's requests before re-adding it
_CLOSE_DRAIN = 0.5  # close: how long torn-down endpoints get to end their requests


class NixlTransport(_LaneChecks, _WireUp):
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
        opts = resolve("nixl", self.options)
        backends = opts["backends"]
        if (
            isinstance(backends, str)
            or not backends
            or not all(isinstance(b, str) and b for b in backends)
        ):
            raise ConfigError(
                f"nixl option backends must be a non-empty list of names: {backends!r}"
            )
        self._backends: list[str] = list(backends)
        self._post_mode = str(opts["post_mode"])
        if self._post_mode not in ("prepped", "direct"):
            raise ConfigError(
                f"nixl option post_mode must be 'prepped' or 'direct': {self._post_mode!r}"
            )
        self._telemetry = bool(opts["telemetry"])
        self._ucx_probe = bool(opts["ucx_probe"])
        nixl_progress = bool(opts["progress_thread"])
        interval = float(opts["progress_interval"])
        if interval < 0:
            raise ConfigError(f"nixl option progress_interval must be >= 0: {interval!r}")
        fast = float(opts["progress_fast_interval"])
        if fast <= 0:
            raise ConfigError(f"nixl option progress_fast_interval must be > 0: {fast!r}")
        self._timeout = float(opts["timeout_s"])
        if not self._timeout > 0:
            raise ConfigError(f"nixl option timeout_s must be > 0: {self._timeout!r}")
        self._prep_block = int(opts["prep_block_bytes"])
        self._prep_max = int(opts["prep_max_descriptors"])
        if self._prep_block < 0 or self._prep_max <= 0:
            raise ConfigError(
                f"nixl options prep_block_bytes must be >= 0 and prep_max_descriptors > 0: "
                f"{self._prep_block!r}, {self._prep_max!r}"
            )
        self._allow_slow_gpu = bool(opts["allow_slow_gpu"])
        #: stream order (kvlink.transport rule 6): a post touching our VRAM is handed to NIXL
        #: once the caller's current stream ran what it held at the post; False: the caller
        #: orders its streams itself (synchronized before posting)
        self._stream_order = bool(opts["stream_order"])
        self._marks: StreamMarks | None = None
        ehm = opts["ucx_error_handling_mode"]
        if ehm is not None and ehm not in ("peer", "none"):
            raise ConfigError(f"nixl option ucx_error_handling_mode must be 'peer' or 'none': "
                              f"{ehm!r}")
        num_threads = int(opts["num_threads"])
        #: UCX settings this transport added to the environment (the user's own are kept)
        self.ucx_env: dict[str, str]
        self._agent, self.ucx_env = start_agent(
            api, ctx.agent_name, self._backends, progress_thread=nixl_progress,
            telemetry=self._telemetry, num_threads=num_threads, error_handling=ehm,
        )
        # the state the jobs share; what each field holds is said where it is declared
        # (requests, transfers, lanes)
        self._lock = threading.RLock()
        self._probe_pool = None
        self._probes = []
        self._regions = []
        self._local = _Side([])
        self._reg_dlists: list[Any] = []
        self._lpreps = {}
        self._run_firsts = PerBases()
        self._peers = {}
        self._by_agent = {}
        self._draining = {}
        self._xfers = {}
        self._zombies = []
        self._abandoned = []
        self._owner_calls = 0
        self._ids = itertools.count(1)
        self._host = ctx.host_id or socket.gethostname()
        self._closed = False
        self._notes: list[tuple[str, bytes]] = []
        self._progress: ProgressThread | None = None
        if interval > 0 and not nixl_progress:
            self._progress = ProgressThread(self, interval, min(fast, interval),
                                            name=f"kvlink-nixl-progress-{ctx.agent_name}")
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
            if self._prep_block and self._post_mode == "prepped":
                _check_block(self._prep_block, self._regions + new, self._prep_max)
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
            self._run_firsts.clear()
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
            self._judge_known(entry, desc.host == self._host,
                              side.has_vram or self._local.has_vram)
            self._peers[peer] = entry
            self._by_agent[name] = peer
        self._wire_up(entry)  # HandshakeError (and the peer dropped) if it does not answer
        self._check_ucx_path(peer, desc.host == self._host, side.has_vram or self._local.has_vram)

    def _prep_peer(self, p: _Peer) -> _Prep | None:
        """Prep the peer's regions once, at the block our own regions are prepped at (or a
        larger one when its memory needs it); None: posts build per-request lists."""
        if self._post_mode != "prepped" or not p.side.table.regions:
            return None
        block = self._prep_block or max(
            self._local_block(), _auto_block(p.side.table.regions, self._prep_max)
        )
        try:
            _check_block(block, p.side.table.regions, self._prep_max)
        except ConfigError as exc:  # (its memory, not ours: its posts list their extents)
            log.warning("nixl peer %s: %s; its posts build their own descriptor lists", p.key,
                        exc)
            return None
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
            if self._progress is not None:
                self._progress.arrived(len(msgs))

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
        # NIXL calls), only for the window's own lock
        self._progress.expect(seconds, count)

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
        if self._progress is not None:
            self._progress.stop()
        self._stop_probes()
        if self._progress is not None:
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
            if self._abandoned:
                self._reap_abandoned()
            self._reap_zombies()
            stuck = sum(x.state.status is XferStatus.PENDING for x in self._xfers.values())
            if stuck:
                log.warning("nixl: %d transfer(s) could not be cancelled at close; keeping the "
                            "memory registered", stuck)
                return
            for prep in self._lpreps.values():
                prep.release()
            self._lpreps = {}
            self._run_firsts.clear()
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
        """UCX only enables cuda_ipc with a CUDA context current on the calling thread; our
        VRAM's posts wait for the caller's stream (:class:`kvlink.staging.StreamMarks`)."""
        for r in regions:
            mem, dev = _mem_of(r.device)
            if mem == 1:
                import torch

                torch.cuda.set_device(int(dev))
                if self._stream_order and self._marks is None:
                    self._marks = StreamMarks(int(dev))
                return
