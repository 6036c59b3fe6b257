"""``cuda_ipc``: same-host GPU <-> GPU at memory speed through CUDA IPC mappings.

Each side exports IPC handles of its registered VRAM regions; the descriptor carrying them is put
into a handshake answer only for a peer whose host id (kernel boot + IPC namespace, exchanged in
the handshake) equals ours — never on assumption. The peer opens the handles once per connect;
READ and WRITE are both copies between mapped pointers, enqueued by kvlink.gpu.copy.BatchCopier on a
side stream: the extent records go to pinned memory, the device checks them against the
registered regions of both sides and translates the peer's addresses into our mappings, then one
kernel copies them; completion is a CUDA event that poll() queries. The host does no per-extent
numpy work before the launch: at 20480 extents that alone cost more than the copy.

Stream order (the manners of CUDA libraries). A post's copy starts only after the work that was
enqueued on the caller's current stream of our device (``torch.cuda.current_stream``) when post
was called: for a READ the kernels still writing or reading the destination blocks, for a WRITE
the kernels still writing the source. Where that stream has work pending, an event is recorded
on it and the side stream waits on it (kvlink.gpu.move.StreamOrder, driver calls): no host sync, so
post never blocks on the model. For KVWorker the post happens in poll(): the stream that counts
is the current stream of the thread calling poll() then. The model's stream in turn is
never made to wait: poll() reports DONE once the copy has finished, and
:meth:`CudaIpcTransport.completion_event` (an optional hook of the transport contract) gives the
copy's completion event, so a consumer can order its own stream after the copy
(``stream.wait_event(ev)``) without a host sync; whether the copy succeeded is still poll()'s
answer. The peer's side is not ordered by us (its memory is another process's): a producer
offers blocks only once their KV is computed. Option ``stream_order=False`` drops the wait (the
behaviour before it existed): only for a caller that orders its streams itself, and for
scripts/gpu_stream_order_check.py, which shows what goes wrong without it.

Mappings and peers. Peers are replaced and forgotten from the handshake thread while posts run
on the caller's: the peer table is locked. Each connect maps the peer's exports anew and each
in-flight post holds a reference on the mappings it copies through, so disconnecting (or
reconnecting) a peer while a copy is in flight never unmaps memory under the copy: the old
mappings are closed once the last copy through them has completed (seen by poll, release, a
later post, disconnect or close). A reconnected peer gets the mappings of its new descriptor,
never the old peer's (the mapper shares one mapping per allocation and exporting process, as
CUDA requires).

Contract (``kvlink/transport.py``): post never raises for peer or runtime conditions — an unknown
or disconnected peer, a CUDA error while enqueueing — it returns a handle that polls FAILED with
the reason; a handle is FAILED only when no byte of it can still land (a copy cut by a
disconnect, or one whose launch failed part way, reports FAILED only after its completion event
has completed); disconnect fails only that peer's in-flight handles.

Where IPC cannot work — another host, another IPC namespace (container), memory without legacy
IPC handles (``expandable_segments``, ``cudaMallocAsync`` pools) — connect() raises
TransportUnavailable with one line saying why, and the worker falls back to the next transport in
its list. Notifications travel over the side channel (no native ones).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError, KVLinkError, TransportUnavailable
from kvlink.gpu.copy import NO_MISMATCH, DigestLaunch
from kvlink.gpu.ends import CopyEnds
from kvlink.gpu.lane import BoardDigest, Lane
from kvlink.gpu.move import DIGEST_MAX
from kvlink.layout import check_in_range
from kvlink.options import resolve
from kvlink.transport import (
    DONE,
    PENDING,
    Capabilities,
    DigestJob,
    Extents,
    LaneDigests,
    Op,
    PerBases,
    Region,
    RegionTable,
    Runs,
    Transport,
    TransportContext,
    XferState,
    XferStatus,
    check_pairs,
)
from kvlink.wire import decode_versioned

if TYPE_CHECKING:
    import torch

    from kvlink.landing import Signal

log = logging.getLogger("kvlink.cuda_ipc")
#: copy kernels: CUDA C where NVRTC builds it, else Triton ("auto"), or one of them forced
KERNELS = ("auto", "cuda", "triton")
_VERSION = 1


class _Export(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: int  # exporter's pointer
    nbytes: int
    handle: bytes  # kvlink.gpu.ipc.IpcHandle.to_bytes()


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    host_id: str
    device_uuid: str
    exports: list[_Export]




@dataclasses.dataclass(eq=False)
class _Peer:
    """One connect of a peer: its regions, our mappings of them, and the posts through them."""

    name: str
    table: RegionTable  # the peer's own addresses
    map: Any  # kvlink.gpu.copy.RegionMap: the peer's regions -> our mappings of them
    handles: list[Any]  # kvlink.gpu.ipc.IpcHandle, one mapper reference each
    live: set[_Xfer] = dataclasses.field(default_factory=set)  # posts not yet settled
    gone: str = ""  # why it was disconnected; mappings closed once ``live`` is empty
    unmapped: bool = False


@dataclasses.dataclass(eq=False, slots=True)  # made on every post's path: slots make it faster
class _Xfer:
    pending: Any  # kvlink.gpu.copy.Pending; None: the post failed before enqueueing
    nbytes: int
    t_post: float
    local: Extents | None  # None for a post of runs (see ``runs``)
    remote: Extents | None
    peer: _Peer | None
    state: XferState = PENDING
    #: post_runs (or a lane's post: made on demand): expanded only to explain a refusal
    runs: Runs | Callable[[], Runs] | None = None
    #: a lane's post: the (local, remote) block ids it launched with, int64 (ours)
    ids: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
    cut: str = ""  # disconnected while in flight: FAILED with this once the copy has ended
    settled: bool = False  # its copy was seen complete and its mapping reference dropped
    #: when (perf_counter) its copy was enqueued, and when it should have ended, after those
    #: before it on our stream at the rate copies ran here (:meth:`CudaIpcTransport.ends_in`;
    #: 0: not known)
    t_queued: float = 0.0
    ends_at: float = 0.0
    #: when (perf_counter) :meth:`CudaIpcTransport.end_probe`'s call first saw the copy ended
    #: (0: none did): its time for the counts and the rate, which poll() may take later
    ended_at: float = 0.0


_ALIGNED = PerBases()


def _aligned(local: Any, remote: Any) -> bool:
    """Every segment base 16-byte aligned (the fused kernel moves 16-byte vectors), judged
    once per pair of base arrays (:class:`~kvlink.transport.PerBases`)."""
    return bool(_ALIGNED.get(lambda: not ((local | remote) % np.uint64(16)).any(), None,
                             local, remote))


def _unit_pages(unit: int, page_bytes: int, local: Any, remote: Any) -> int:
    """Pages in a block's ``unit`` where ``kv_move_digest`` can digest it while it copies —
    1, or K and V side by side: 2; whole 16-byte vectors, every segment base aligned to them
    — else 0. What a post of these segments' blocks shares (a lane judges it once)."""
    if page_bytes <= 0:
        return 0
    pages, rest = divmod(unit, page_bytes)
    ok = not rest and pages in (1, 2) and not unit % 16 and _aligned(local, remote)
    return pages if ok else 0


def _views_fit(planes: int, heads: int, segments: int, pages: int) -> bool:
    """Whether views of ``planes`` planes of ``heads`` heads are those of ``segments`` segments
    of ``pages`` pages each, with heads within what the fused kernel can sum."""
    return planes == segments * pages and pages * heads <= DIGEST_MAX


def _job_fits(digest: DigestJob, blocks: int, segments: int, pages: int) -> bool:
    """Whether ``digest``'s rows are those of a post of ``blocks`` blocks over ``segments``
    segments of ``pages`` pages each (:func:`_views_fit`)."""
    return digest.blocks == blocks and _views_fit(digest.planes, digest.heads, segments, pages)


def _launched_ids(launched: npt.NDArray[np.int64], n: int, op: Op
                  ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(local, remote) ids of a lane's post: views of what its launch took (source ids, then
    destination ids; int64, ours)."""
    src, dst = launched[:n], launched[n:]
    return (dst, src) if op is Op.READ else (src, dst)


def _explained_ids(local_ids: Any, remote_ids: Any
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Our copies of a post's ids, to explain its refusal (the caller may reuse theirs), where
    no launch took them (the ctypes launch, or a copy that failed before its launch: then
    they may not even be ids, and its handle FAILED says why anyway)."""
    try:
        return np.array(local_ids, dtype=np.int64), np.array(remote_ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


class _Lane:
    """:meth:`CudaIpcTransport.lane`: what one peer pair's posts of whole blocks bind once.
    A post after the peer connected anew rebinds its mappings; one after it disconnected
    fails like any post to an unknown peer.

    ``post(local_ids, remote_ids, generation=0, sample=False, signal=None) -> int | None``:
    post blocks ``remote_ids`` -> ``local_ids`` (READ; WRITE the other way), both int64 (an
    id out of range is refused on the device: the handle polls FAILED naming it): a handle
    (the transport's contract: never raises, FAILED says why), or None where this lane
    cannot take the request (too many blocks for a launch's table; a digest lane without the
    hold's ``generation``; a landing ``signal`` whose board cannot be mapped here): post it
    the general way. ``signal``: a push's landing flag, moved after the copy (as
    :meth:`CudaIpcTransport.post` takes it). ``sample`` (a digest lane): its kernel checks
    the blocks ``sample`` picks, as the producer picked them (kvlink.integrity.checked, by
    the generation), else every block. Where :attr:`takes_lists`, the ids may also be lists
    of ints, converted by the launch itself; ids it cannot take then raise TypeError,
    ValueError or OverflowError, and nothing was posted. It is
    :meth:`CudaIpcTransport._post_lane` bound to the lane, one call: a READ's host time
    before its launch is its latency, cold (a method calling it was one frame more)."""

    __slots__ = ("_owner", "blocks", "local_base", "moves", "op", "peer", "post",
                 "remote_base", "target")

    def __init__(self, owner: CudaIpcTransport, op: Op, peer: str, target: _Peer,
                 moves: Lane, local_base: npt.NDArray[np.uint64],
                 remote_base: npt.NDArray[np.uint64], blocks: tuple[int, int]) -> None:
        self._owner, self.op, self.peer, self.target, self.moves = owner, op, peer, target, moves
        self.local_base, self.remote_base, self.blocks = local_base, remote_base, blocks
        self.post: Callable[..., int | None] = functools.partial(owner._post_lane, self)

    def posted_ids(self, handle: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """The (local, remote) block ids ``handle``'s post launched with: int64 arrays of the
        transport's own (not to be written), so a caller that handed lists needs no copy of
        its own (None: not a lane's post, released, or no launch took them — its copy failed
        before one)."""
        x = self._owner._xfers.get(handle)
        return None if x is None else x.ids

    @property
    def takes_lists(self) -> bool:
        """Whether :meth:`post` takes the caller's ids as they come (lists of ints, int64
        arrays): the C launcher copies them into the launch (kvlink.native), so a READ's
        ids need no conversion before its launch."""
        copier = self._owner._copier
        return copier is not None and bool(copier.takes_lists)

    def runs(self, local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64]
             ) -> Runs:
        """What a post of these blocks moved, as post_runs would have taken it (to explain
        a refusal: the slow path); raises BlockIdOutOfRange naming an id the device refused
        as out of range."""
        check_in_range(local_ids, self.blocks[0], "local")
        check_in_range(remote_ids, self.blocks[1], "remote")
        return Runs.of_blocks(self.local_base, self.remote_base, local_ids, remote_ids,
                              self.moves.unit, len(local_ids) * self.moves.segments)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    capabilities = Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}),
        memory_kinds=frozenset({"cuda"}),
        same_host_only=True,
        native_notifications=False,
    )

    def __init__(self, ctx: TransportContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        self.options = resolve("cuda_ipc", self.options)  # defaults: kvlink.options.CudaIpcOptions
        chunk = self.options["chunk_bytes"]  # one program's part
        self.chunk = None if chunk is None else int(chunk)  # None: the kernel's own default
        self.piece = int(self.options["piece_extents"])  # extents per launch
        self.kernel = str(self.options["kernel"])
        if self.kernel not in KERNELS:
            raise ConfigError(f"cuda_ipc option kernel={self.kernel!r}: expected one of "
                              f"{', '.join(KERNELS)}")
        try:
            import torch
        except ImportError as exc:
            raise TransportUnavailable(f"cuda_ipc needs torch: {exc}") from exc
        if not torch.cuda.is_available():
            raise TransportUnavailable("cuda_ipc needs a CUDA device; none is visible here")
        self._torch = torch
        # raw handle of the caller's current stream: torch's own getter (what Triton uses) costs
        # a fraction of building a torch.cuda.Stream object
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current_stream: Any = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
        self._current_device: Any = (getattr(torch._C, "_cuda_getDevice", None)
                                     or torch.cuda.current_device)
        self._device = -1
        self._regions: tuple[Region, ...] = ()
        self._exports: list[_Export] = []
        self.stream_order = bool(self.options["stream_order"])
        #: how the worker should plan for post_runs (see kvlink.plan.PlanTable.runs)
        self.coalesce_runs = bool(self.options["coalesce_runs"])
        self._peers: dict[str, _Peer] = {}  # guarded by _lock, like _xfers and _released
        self._xfers: dict[int, _Xfer] = {}
        self._released: list[_Xfer] = []  # released before their copy ended: settled later
        self._gone: list[_Peer] = []  # disconnected with copies in flight: mapped until they end
        self._closed = False
        self._ends = CopyEnds()  # when each copy should end (ends_in); under _lock
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._mapper: Any = None
        self._stream: Any = None
        self._copier: Any = None
        self._local_map: Any = None
        self._host_maps: dict[int, int] = {}  # landing boards registered: host base -> device
        #: hold boards let go (forget_host_region): (host base, an event after every copy
        #: that may read it), unregistered once it has passed
        self._retiring: list[tuple[int, int | None]] = []

    def register(self, regions: Sequence[Region]) -> None:
        from kvlink.gpu import ipc

        devices = {r.device for r in regions}
        if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
            raise TransportUnavailable(
                f"cuda_ipc moves memory of one CUDA device; got {sorted(devices)}"
            )
        self._device = _device_index(devices.pop())
        torch = self._torch
        torch.cuda.set_device(self._device)
        self._mapper = ipc.IpcMapper(self._device)
        self._stream = torch.cuda.Stream(self._device)
        from kvlink.gpu.copy import BatchCopier

        self._copier = BatchCopier(torch.device("cuda", self._device), chunk=self.chunk,
                                   piece=self.piece, kernel=self.kernel)
        log.info("cuda_ipc: %s copy kernel on cuda:%d", self._copier.kernel, self._device)
        exports = []
        for r in regions:  # a region may span several allocations: one handle per allocation
            start, end = r.addr, r.addr + r.nbytes
            while start < end:
                base, size = ipc.allocation_range(start)
                piece = min(end, base + size) - start
                try:
                    h = ipc.export_pointer(start, piece, self._device)
                except KVLinkError as exc:
                    raise TransportUnavailable(
                        f"cuda_ipc cannot export 0x{start:x}: {exc}"
                    ) from exc
                exports.append(_Export(start, piece, h.to_bytes()))
                start += piece
        self._regions += tuple(regions)
        self._exports += exports
        self._table = RegionTable(self._regions)
        from kvlink.gpu.copy import RegionMap

        t = self._table
        self._local_map = RegionMap(t.starts, t.ends, np.zeros_like(t.starts),
                                    torch.device("cuda", self._device))

    def descriptor(self) -> bytes:
        props = self._torch.cuda.get_device_properties(self._device)
        return msgspec.msgpack.encode(
            _Descriptor(
                v=_VERSION,
                agent=self.ctx.agent_name,
                host_id=self.ctx.host_id,
                device_uuid=str(getattr(props, "uuid", "")),
                exports=self._exports,
            )
        )

    def _decode(self, descriptor: bytes) -> _Descriptor:
        return decode_versioned(descriptor, _Descriptor, _VERSION, "cuda_ipc descriptor")

    def unreachable_reason(self, peer_descriptor: bytes, same_host: bool) -> str | None:
        desc = self._decode(peer_descriptor)
        if not same_host or desc.host_id != self.ctx.host_id:
            return "cuda_ipc: the peer is on another host or IPC namespace (host ids differ)"
        return None

    def connect(self, peer: str, descriptor: bytes) -> None:
        from kvlink.gpu import ipc

        desc = self._decode(descriptor)
        why = self.unreachable_reason(descriptor, desc.host_id == self.ctx.host_id)
        if why:
            raise TransportUnavailable(why)
        # map the new descriptor first (outside the lock: opening a mapping takes milliseconds
        # and posts to other peers go on meanwhile); the old peer, if any, is retired after
        handles, mapped = [], []
        try:
            for e in desc.exports:
                h = ipc.IpcHandle.from_bytes(e.handle)
                mapped.append(self._mapper.open(h))
                handles.append(h)
        except KVLinkError as exc:
            for h in handles:
                self._mapper.close(h)
            raise TransportUnavailable(f"cuda_ipc cannot map {peer}'s memory: {exc}") from exc
        from kvlink.gpu.copy import RegionMap

        table = RegionTable([Region(e.addr, e.nbytes, "cuda") for e in desc.exports])
        order = {e.addr: m for e, m in zip(desc.exports, mapped)}
        ours = np.array([order[r.addr] for r in table.regions], dtype=np.uint64)
        delta = ours.astype(np.int64) - table.starts.astype(np.int64)
        rmap = RegionMap(table.starts, table.ends, delta, self._torch.device("cuda", self._device))
        new = _Peer(peer, table, rmap, handles)
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = new
            closable = (self._retire_locked(old, f"peer {peer} reconnected") if old is not None
                        else [])
        self._unmap(closable)
        log.info(
            "cuda_ipc: mapped %d allocation(s) of %s (GPU %s)",
            len(handles),
            peer,
            desc.device_uuid or "?",
        )

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``: its in-flight posts turn FAILED once their copies have ended, and
        its mappings are closed then (never under a running copy). Other peers are untouched."""
        with self._lock:
            old = self._peers.pop(peer, None)
            closable = (self._retire_locked(old, f"peer {peer} disconnected") if old is not None
                        else [])
            closable += self._reap_locked()
        self._unmap(closable)

    # ------------------------------------------------------------ mapping references
    def _retire_locked(self, p: _Peer, why: str) -> list[_Peer]:
        """Mark a replaced or forgotten peer gone; its copies still in flight will fail. The
        peer is returned (to unmap) if no copy of it is left in flight."""
        p.gone = why
        closable: list[_Peer] = []
        for x in list(p.live):
            if x.pending.done():  # ended before the disconnect: it keeps its own outcome
                closable += self._settle_locked(x)
            else:
                x.cut = f"{why} while the copy was in flight (its bytes may have landed in part)"
        if not p.live and not p.unmapped:
            p.unmapped = True
            closable.append(p)
        elif p.live:
            self._gone.append(p)  # unmapped when its last copy is seen ended
        return closable

    def _settle_locked(self, x: _Xfer) -> list[_Peer]:
        """A post whose copy has ended drops its reference on the peer's mappings; returns the
        peer if that was the last reference of a gone peer."""
        if x.settled:
            return []
        x.settled = True
        p = x.peer
        if p is None:
            return []
        p.live.discard(x)
        if p.gone and not p.live and not p.unmapped:
            p.unmapped = True
            if p in self._gone:
                self._gone.remove(p)
            return [p]
        return []

    def _reap_locked(self) -> list[_Peer]:
        """Settle released posts whose copies have ended since."""
        closable: list[_Peer] = []
        keep = []
        for x in self._released:
            if x.pending.done():
                closable += self._settle_locked(x)
            else:
                keep.append(x)
        self._released = keep
        return closable

    def _unmap(self, peers: list[_Peer]) -> None:
        for p in peers:
            for h in p.handles:
                try:
                    self._mapper.close(h)
                except KVLinkError as exc:  # a dead context: nothing more to release
                    log.warning("cuda_ipc: closing a mapping of %s failed: %s", p.name, exc)

    # ------------------------------------------------------------ transfers
    @property
    def signals(self) -> bool:
        """Whether posts take a landing ``signal`` (kvlink.landing): the CUDA C kernel runs it
        on the device after the copy (not the Triton fallback)."""
        return self._copier is not None and bool(self._copier.computes_addresses)

    def _device_signal(self, signal: Signal | None) -> tuple[int, int, int] | None:
        """``signal`` as the copier takes it: its board registered with CUDA on first use (a
        board that cannot be is left to the push's note: None)."""
        if signal is None or not self.signals:
            return None
        dev = self._host_map(signal.region, False, "landing board not mapped (%s): pushes "
                             "end by note")
        return (dev + signal.offset, signal.expect, signal.value) if dev else None

    def forget_host_region(self, region: tuple[int, int]) -> None:
        """Optional hook (kvlink.peers, for a dropped peer's hold board): a host mapping
        registered for the device is let go. Unregistered once every copy posted before now
        has ended — an event on our stream: a copy still running may read it, and a device
        read of an unregistered page kills the context — so at a later poll (or close) where
        one still runs. A producer that restarts would otherwise leave its old board pinned
        (66 MiB) for good, each time."""
        with self._lock:
            dev = self._host_maps.pop(region[0], None)
        if not dev:
            return
        event = None
        if self._copier is not None:
            try:
                event = self._copier.mark(self._stream)
            except RuntimeError as exc:  # no way to know when its readers end: keep it
                log.warning("cuda_ipc: a let-go hold board stays registered (%s)", exc)
                return
        with self._lock:
            self._retiring.append((region[0], event))
        self._retire_host_maps()

    def _retire_host_maps(self) -> None:
        """Unregister the host mappings let go whose readers have all ended."""
        with self._lock:
            ready: list[tuple[int, int | None]] = []
            keep: list[tuple[int, int | None]] = []
            for base, event in self._retiring:
                done = event is None or self._copier is None or self._copier.passed(event)
                (ready if done else keep).append((base, event))
            self._retiring = keep
        if not ready:
            return
        from kvlink.gpu import ipc

        for base, _ in ready:
            try:
                ipc.host_unregister(base)
            except KVLinkError as exc:
                log.warning("cuda_ipc: unregistering a hold board: %s", exc)

    def _host_map(self, region: tuple[int, int], read_only: bool, why: str) -> int:
        """The device pointer of a shared host mapping (a landing board, a producer's hold
        board), registered with CUDA on first use; 0 (``why`` logged once) where it cannot."""
        base, nbytes = region
        if self._retiring and any(b == base for b, _ in self._retiring):
            self._retire_host_maps()  # a new mapping where a let-go one was: not till it goes
            if any(b == base for b, _ in self._retiring):
                return 0
        dev = self._host_maps.get(base)
        if dev is None:
            from kvlink.gpu import ipc

            try:
                dev = ipc.host_register(base, nbytes, read_only)
            except KVLinkError as exc:
                log.warning("cuda_ipc: " + why, exc)
                dev = 0
            self._host_maps[base] = dev
        return dev

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",  # not checked by the owner here (docs/security.md)
        signal: Signal | None = None,
    ) -> int:
        """Enqueue the copy after the caller's current stream (see the module docstring);
        never raises for peer or runtime conditions: such a post polls FAILED. ``signal``
        (with :attr:`signals`): moved on the device once the copy has landed, unless the copy
        refused an extent; nothing is signalled for a post that fails before its copy."""
        sig = self._device_signal(signal)
        extra = {} if sig is None else {"signal": sig}

        def copy(copier: Any, target: _Peer, after: int | None) -> Any:
            if op is Op.READ:
                return copier.copy(remote, target.map, local, self._local_map, self._stream,
                                   after, **extra)
            return copier.copy(local, self._local_map, remote, target.map, self._stream, after,
                               **extra)

        return self._post(peer, copy, local, remote, None, int(local["len"].sum()),
                          int(local.shape[0]))

    #: post_runs takes ``digest`` (kvlink.transport.DigestJob): a READ of one run per block
    #: digests what it lands in the copy kernel itself and compares (:meth:`landed_check`)
    fuses_digests = True

    def post_runs(self, op: Op, peer: str, runs: Runs, *, ticket: bytes = b"",
                  signal: Signal | None = None, digest: DigestJob | None = None) -> int:
        """Optional hook (the worker uses it where a plan takes the RUNS form): :meth:`post`
        of ``runs.expand()`` without expanding it — the kernel computes each extent's
        addresses from the segment bases and runs, so the host writes a few kilobytes instead
        of segments x runs records. Same contract as post (stream order, never raises).
        ``digest``: where the READ's shape allows (:meth:`_fusable`), the copy kernel also
        digests what it lands (``kv_move_digest``; no launch, upload or sync of its own)."""
        if self._copier is None or not self._copier.computes_addresses:
            plan = runs.expand(self.extents)
            return self.post(op, peer, plan.local, plan.remote, signal=signal)
        pages = self._fusable(op, runs, digest) if signal is None else 0
        if pages:
            assert digest is not None
            return self._post_digest(peer, runs, digest, pages)
        sig = self._device_signal(signal)
        extra = {} if sig is None else {"signal": sig}
        ours, theirs = (runs.local_base, runs.local_at), (runs.remote_base, runs.remote_at)
        segments, count = int(runs.local_base.shape[0]), int(runs.lens.shape[0])

        def copy(copier: Any, target: _Peer, after: int | None) -> Any:
            (src, smap), (dst, dmap) = (((theirs, target.map), (ours, self._local_map))
                                        if op is Op.READ else
                                        ((ours, self._local_map), (theirs, target.map)))
            table = np.concatenate([src[0], dst[0], src[1], dst[1], runs.lens])
            return copier.copy_runs(table, segments, count, smap, dmap, self._stream, after,
                                    runs.longest_run, **extra)

        return self._post(peer, copy, None, None, runs, runs.nbytes, runs.descriptors)

    @staticmethod
    def _fusable(op: Op, runs: Runs, digest: DigestJob | None) -> int:
        """Pages per unit (1, or 2: K and V side by side) where ``kv_move_digest`` can take
        this post — a READ of one whole unit per block, 16-byte aligned, as many units as the
        digest's rows say, planes that match the segments — else 0 (the caller digests)."""
        if digest is None or op is not Op.READ:
            return 0
        n, unit = int(runs.lens.shape[0]), runs.longest_run
        pages = _unit_pages(unit, digest.page_bytes, runs.local_base, runs.remote_base)
        fits = pages and runs.run_bytes == n * unit and _job_fits(
            digest, n, int(runs.local_base.shape[0]), pages)
        return pages if fits else 0

    def _post_digest(self, peer: str, runs: Runs, digest: DigestJob, pages: int) -> int:
        expect = self._host_map(digest.region, True, "hold board not mapped (%s): digests "
                                "compared on the host")
        if not expect:
            return self.post_runs(Op.READ, peer, runs)
        segments, n = int(runs.local_base.shape[0]), int(runs.lens.shape[0])
        unit = runs.longest_run
        # the blocks' rows travel with the launch (a unit not checked then reads nothing
        # else); the digests stay on the producer's board, read in place by the units checked
        rows = digest.rows.view(np.uint64)
        launch = DigestLaunch(digest.geometry, digest.weights, pages, digest.page_bytes,
                              digest.count, expect=expect + digest.expect - digest.region[0])

        def copy(copier: Any, target: _Peer, after: int | None) -> Any:
            table = np.concatenate([runs.remote_base, runs.local_base, runs.remote_at,
                                    runs.local_at, rows])
            return copier.copy_digest(table, segments, n, unit, target.map, self._local_map,
                                      self._stream, after, launch)

        return self._post(peer, copy, None, None, runs, runs.nbytes, runs.descriptors)

    def landed_check(self, handle: int) -> tuple[int, int] | None:
        """For a DONE READ posted with a ``digest`` it fused, or through a digest lane: (-1
        when every digest of what it landed equals the producer's, else the first (row,
        plane, head) index that differs; the producer's rows compared); None where nothing
        was compared, or not all of it (the caller digests itself)."""
        x = self._xfers.get(handle)
        if x is None or x.pending is None or x.state is not DONE:
            return None
        p = x.pending
        got = p.mismatch
        if got is None:
            return None
        return (-1, p.compared) if got == NO_MISMATCH else (int(got), p.compared)

    def lane(self, op: Op, peer: str, local_base: npt.NDArray[np.uint64],
             remote_base: npt.NDArray[np.uint64], unit: int, blocks: tuple[int, int],
             digests: LaneDigests | None = None) -> _Lane | None:
        """Optional hook (kvlink.transport): posts of whole ``unit``-byte blocks between
        ``peer``'s segments and ours bound once (kvlink.gpu.lane) — the post_runs of one run per
        block with nothing worked out per request: the kernel takes the block ids and refuses
        one at or past ``blocks`` (ours, the peer's). ``digests``: a READ lane whose kernel
        digests what it lands and compares it with the rows it finds on the producer's hold
        board (:meth:`landed_check`); None where this pair cannot have one (not connected, the
        Triton kernel, a unit or views the fused kernel cannot take, a board CUDA cannot map):
        post the general way."""
        if self._copier is None or not self._copier.computes_addresses:
            return None
        with self._lock:
            target = self._peers.get(peer)
        if target is None:
            return None
        digest = None
        if digests is not None:
            pages = _unit_pages(unit, digests.page_bytes, local_base, remote_base)
            if (op is not Op.READ or not pages
                    or not _views_fit(digests.planes, digests.heads, len(local_base), pages)):
                return None
            board = self._host_map(digests.board, True, "hold board not mapped (%s): digests "
                                   "compared on the host")
            if not board:
                return None
            digest = BoardDigest(pages, digests.page_bytes, digests.geometry, digests.weights,
                                 board, digests.layout, digests.board[0])
        ours, theirs = (local_base, self._local_map, blocks[0]), (remote_base, target.map,
                                                                   blocks[1])
        (src, smap, sb), (dst, dmap, db) = (theirs, ours) if op is Op.READ else (ours, theirs)
        lane = self._copier.lane(src, dst, unit, (sb, db), smap, dmap, digest)
        return None if lane is None else _Lane(self, op, peer, target, lane, local_base,
                                               remote_base, blocks)

    def _post_lane(self, lane: _Lane, local_ids: npt.NDArray[np.int64],
                   remote_ids: npt.NDArray[np.int64], generation: int = 0,
                   sample: bool = False, signal: Signal | None = None) -> int | None:
        """``_Lane.post``: one post through ``lane`` (None: it cannot take this one).
        ``signal`` (a push's WRITE into a landing board, kvlink.landing): the flag moved after
        the copy, in stream order; None where the board cannot be mapped here (post it the
        general way, which ends that push by its note).

        The common case — the peer as the lane bound it, our device current — takes a path
        of its own, the launch first and the bookkeeping after: a READ's host time before its
        launch is its latency, cold (bench/results/gpu_checks_61d7f7e_stamps: 38 us from the
        lane's call to the launcher's through the general post's closure and layers). Any
        other case takes :meth:`_post`, which rebinds or fails the post saying why."""
        moves, n = lane.moves, len(local_ids)
        if ((n not in moves.launches and not moves.fits(n))
                or (moves.digest is not None and not generation)):
            return None
        sig = None if signal is None else self._device_signal(signal)
        if signal is not None and sig is None:
            return None
        src, dst = (remote_ids, local_ids) if lane.op is Op.READ else (local_ids, remote_ids)
        copier, nbytes = self._copier, n * moves.segments * moves.unit
        t0 = time.perf_counter()
        with self._lock:
            target = self._peers.get(lane.peer)
            try:
                common = (target is lane.target and target is not None and copier is not None
                          and self._current_device() == self._device)
                after = (self._current_stream(self._device) if common and self.stream_order
                         else None)
            except (RuntimeError, OSError):  # a dead context: _post fails it, saying so
                common = False
            if common:
                assert target is not None and copier is not None
                pending = copier.copy_lane(moves, src, dst, self._stream, after, generation,
                                           sample, sig)  # (its launch's errors make it fail)
                handle = next(self._handles)
                ids = (None if pending.ids is None else _launched_ids(pending.ids, n, lane.op))
                closable = self._keep_locked(handle, _Xfer(
                    pending, nbytes, t0, None, None, target, ids=ids,
                    runs=functools.partial(lane.runs, *(ids or _explained_ids(
                        local_ids, remote_ids)))))
        if common:
            self._posted(closable, t0, n * moves.segments)
            return handle

        def copy(copier: Any, target: _Peer, after: int | None) -> Any:
            if target is not lane.target:  # connected anew since the lane was bound
                lane.target = target
                ours, theirs = self._local_map, target.map
                moves.rebind((theirs, ours) if lane.op is Op.READ else (ours, theirs))
            return copier.copy_lane(moves, src, dst, self._stream, after, generation, sample,
                                    sig)

        return self._post(lane.peer, copy, None, None,
                          functools.partial(lane.runs, *_explained_ids(local_ids, remote_ids)),
                          nbytes, n * moves.segments)

    def _post(self, peer: str, copy: Callable[[Any, _Peer, int | None], Any],
              local: Extents | None, remote: Extents | None,
              runs: Runs | Callable[[], Runs] | None, nbytes: int, descriptors: int) -> int:
        """Both posts: ``copy(copier, target, after)`` enqueues on our stream after the
        caller's; anything that stops it before it is enqueued makes a FAILED handle."""
        t0 = time.perf_counter()
        cuda = self._torch.cuda
        with self._lock:
            handle = next(self._handles)
            target = self._peers.get(peer)
            why = ""
            if target is None or self._copier is None:
                why = ("cuda_ipc: transport closed" if self._closed else
                       f"peer {peer} not connected" if self._copier is not None
                       else "cuda_ipc: post before register()")
            else:
                try:
                    after = self._current_stream(self._device) if self.stream_order else None
                    if self._current_device() == self._device:  # common: no context switch
                        pending = copy(self._copier, target, after)
                    else:
                        with cuda.device(self._device):
                            pending = copy(self._copier, target, after)
                except (RuntimeError, OSError) as exc:
                    # the copier turns errors of its launches into a failing copy; this is one
                    # before anything was enqueued (or of a dead context): nothing can land
                    why = f"cuda_ipc: {type(exc).__name__}: {exc}"
            if why:
                self._xfers[handle] = _Xfer(None, 0, t0, local, remote, None,
                                            XferState(XferStatus.FAILED, why), settled=True,
                                            runs=runs)
                self._account(failed=1)
                return handle
            assert target is not None
            # the copy is running: bookkeeping from here on is off the transfer's critical path
            closable = self._keep_locked(handle, _Xfer(pending, nbytes, t0, local, remote,
                                                       target, runs=runs))
        self._posted(closable, t0, descriptors)
        return handle

    def _keep_locked(self, handle: int, x: _Xfer) -> list[_Peer]:
        """A post whose copy is enqueued: its handle, its reference on the peer's mappings,
        when it should end (:meth:`ends_in`); returns the peers whose released copies ended
        meanwhile (to unmap)."""
        assert x.peer is not None
        x.peer.live.add(x)
        self._xfers[handle] = x
        # timed from the enqueue, not from the post's start: the host's time before a launch
        # (tens of microseconds, cold) is no part of a copy's, and a copy queued behind
        # others ends one device copy after them — with the post's start, each queued copy
        # added that host time again, and a poll never found the last of 8 in flight about
        # to end (bench/results/gpu_grace_enqueue/)
        x.t_queued = time.perf_counter()
        x.ends_at = self._ends.posted(x.t_queued, x.nbytes)  # (0: not known yet)
        copier = self._copier
        if copier is not None and getattr(copier, "timed", None):  # times read once in
            for nbytes, seconds in copier.device_times():  # (after this post's launch)
                self._ends.timed(nbytes, seconds)
        return self._reap_locked() if self._released else []

    def device_seconds(self) -> dict[str, list[float]]:
        """The lane copies timed on the device so far (one post in 32, the first few), in
        seconds, by kind: "plain", or a digest lane's "sample" and "full" — for a bench to
        tell the kernel's part of a request's time from the host's around it."""
        copier = self._copier
        if copier is None:
            return {}
        return {kind: list(times) for kind, times in copier.seconds_by_kind.items()}

    @property
    def copy_rate(self) -> float:
        """Bytes a second our copies are expected to run at (what :meth:`ends_in` counts
        with: the median of the last few timed on the device); 0 while not known."""
        return self._ends.rate

    def end_probe(self, handle: int) -> Callable[[], int | None] | None:
        """Optional hook (kvlink.transport, rule 7): for a lane's post, a call that reads how
        its copy ended — the end word its stream marks and a digest lane's check words, taken
        by the copier's ``Pending.done`` — without this transport's bookkeeping of the end
        (the peer's mapping reference, the counts, the rate), which :meth:`poll` or
        :meth:`release` does later: on the poll that reports a READ that bookkeeping was
        ~10 us cold on one H100 host, on the request's path (docs/e2e.md). None while the
        copy runs; -1 where :meth:`poll` must say (it failed or was cut, or its kernel did
        not find every digest equal); else the digest rows found equal (0: a plain lane).
        None (no call) where the handle is no lane's copy in flight."""
        x = self._xfers.get(handle)
        p = None if x is None else x.pending
        if x is None or p is None or p.end is None or x.state is not PENDING:
            return None
        checks = p.checks_lane

        def probe() -> int | None:
            if not p.done():  # (a copy long not seen ended has its stream asked: as poll)
                return None
            if not x.ended_at:
                x.ended_at = time.perf_counter()
            if p.failed() or x.cut:
                return -1
            if not checks:
                return 0
            return int(p.compared) if p.mismatch == NO_MISMATCH else -1

        return probe

    def ends_in(self, handle: int) -> float | None:
        """Optional hook (kvlink.transport, rule 6): seconds until ``handle``'s copy should
        have ended (:class:`~kvlink.gpu.ends.CopyEnds`: after the copies before it on our
        stream, at the best rate our copies ran at lately); 0 where that time has passed. None
        where not known: no copy seen DONE yet, or the handle not in flight. A poll of the
        worker waits for a copy about to end (``poll_grace_us``)."""
        x = self._xfers.get(handle)
        if x is None or not x.ends_at or x.state.status is not XferStatus.PENDING:
            return None
        return max(0.0, x.ends_at - time.perf_counter())

    def _posted(self, closable: list[_Peer], t0: float, descriptors: int) -> None:
        """After the lock: unmap what :meth:`_keep_locked` found, count the post."""
        if closable:
            self._unmap(closable)
        self._account_post(time.perf_counter() - t0, descriptors)

    def completion_event(self, handle: int) -> torch.cuda.Event | None:
        """Optional hook: the CUDA event recorded after this post's copy, for a caller that
        orders its own stream after the copy without a host sync (``stream.wait_event(ev)``).
        None for a handle without a copy (failed at post, unknown or released). The event only
        says that the copy has ended; whether it succeeded is poll()'s answer. Valid until the
        handle is released (a copy already seen complete gives an event that is complete)."""
        x = self._xfers.get(handle)
        if x is None or x.pending is None:
            return None
        return x.pending.completion_event()  # type: ignore[no-any-return]

    def extents(self, n: int) -> Extents:
        if self._copier is None:  # not registered yet: nothing to post with anyway
            return super().extents(n)
        return self._copier.host_extents(n)  # type: ignore[no-any-return]

    def _refusal(self, x: _Xfer) -> str:
        """Why the device refused an extent: the host checks, run only on this slow path."""
        local, remote = x.local, x.remote
        try:
            if x.runs is not None:
                plan = (x.runs() if callable(x.runs) else x.runs).expand()
                local, remote = plan.local, plan.remote
            assert local is not None and remote is not None
            check_pairs(local, remote)
            self._table.locate(local, "local extent")
            if x.peer is not None:
                x.peer.table.locate(remote, "remote extent")
        except KVLinkError as exc:
            return str(exc)
        return "an extent was refused by the device-side bounds check"

    def poll(self, handle: int) -> XferState:
        x = self._xfers.get(handle)
        if x is None:
            return XferState(XferStatus.FAILED, f"unknown or released handle {handle}")
        if x.state.status is XferStatus.PENDING and x.pending.done():
            if not x.ended_at:  # (its end, once, for the rate and the counts below)
                x.ended_at = time.perf_counter()
            with self._lock:
                closable = self._settle_locked(x)
                if x.state.status is XferStatus.PENDING:  # not decided by another thread
                    if x.cut:
                        x.state = XferState(XferStatus.FAILED, x.cut)
                    elif x.pending.failed():
                        x.state = XferState(XferStatus.FAILED,
                                            x.pending.error or self._refusal(x))
                    else:
                        x.state = DONE
                        self._ends.ended(x.nbytes, x.ended_at - x.t_queued)
            if closable:  # (the last copy of a peer gone meanwhile)
                self._unmap(closable)
            if x.state is DONE:
                self._account_done(x.nbytes, x.ended_at - x.t_post)
            else:
                self._account(failed=1)
            if self._retiring:
                self._retire_host_maps()
        return x.state

    def release(self, handle: int) -> None:
        """Forget the handle. A copy still running keeps its mapping reference until it ends;
        one that ended without a poll seeing it (its end read by :meth:`end_probe`'s call) is
        taken as :meth:`poll` takes it first, so the counts hold every transfer."""
        x = self._xfers.get(handle)
        if x is not None and x.state.status is XferStatus.PENDING:
            self.poll(handle)
        with self._lock:
            x = self._xfers.pop(handle, None)
            if x is None or x.settled:
                return
            if x.pending.done():
                closable = self._settle_locked(x)
            else:
                self._released.append(x)
                return
        self._unmap(closable)

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def notify(self, peer: str, message: bytes) -> None:
        raise TransportUnavailable("cuda_ipc has no native notifications; use the side channel")

    def close(self, timeout: float = 2.0) -> None:
        """Forget every peer; copies in flight fail once they have ended (contract rule 4).
        Waits up to ``timeout`` seconds for them, to close their mappings here; a copy still
        waiting longer (on a caller's stream that does not finish) keeps its mapping until a
        poll sees it end. Idempotent."""
        with self._lock:
            self._closed = True
            closable: list[_Peer] = []
            for name in list(self._peers):
                closable += self._retire_locked(self._peers.pop(name), "transport closed")
            closable += self._reap_locked()
        self._unmap(closable)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                closable = []
                for p in list(self._gone):
                    for x in list(p.live):
                        if x.pending.done():
                            closable += self._settle_locked(x)
                self._released = [x for x in self._released if not x.settled]
                left = len(self._gone)
            self._unmap(closable)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        if left:
            log.warning("cuda_ipc: closed with %d peer(s) still mapped under copies in flight",
                        left)
        elif self._host_maps or self._retiring:  # no copy (nor its signal) can touch a
            # board any more
            from kvlink.gpu import ipc

            bases = [b for b, dev in self._host_maps.items() if dev]
            bases += [b for b, _ in self._retiring]
            for base in bases:
                try:
                    ipc.host_unregister(base)
                except KVLinkError as exc:
                    log.warning("cuda_ipc: unregistering a landing board: %s", exc)
            self._host_maps.clear()
            self._retiring = []
