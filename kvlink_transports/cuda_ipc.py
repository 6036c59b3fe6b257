"""``cuda_ipc``: same-host GPU <-> GPU at memory speed through CUDA IPC mappings.

Each side exports IPC handles of its registered VRAM regions; the descriptor carrying them is put
into a handshake answer only for a peer whose host id (kernel boot + IPC namespace, exchanged in
the handshake) equals ours — never on assumption. The peer opens the handles once and caches the
mappings (closed on disconnect or when the peer reconnects). READ and WRITE are both copies
between mapped pointers, enqueued by _gpucopy.BatchCopier on a side stream so the model's stream
is never blocked: the extent records go to pinned memory, the device checks them against the
registered regions of both sides and translates the peer's addresses into our mappings, then one
kernel copies them; completion is a CUDA event that poll() queries. The host does no per-extent
numpy work before the launch: at 20480 extents that alone cost more than the copy.

Where IPC cannot work — another host, another IPC namespace (container), memory without legacy
IPC handles (``expandable_segments``, ``cudaMallocAsync`` pools) — connect() raises
TransportUnavailable with one line saying why, and the worker falls back to the next transport in
its list. Notifications travel over the side channel (no native ones).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from kvlink.errors import ConfigError, KVLinkError, TransportUnavailable
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

log = logging.getLogger("kvlink.cuda_ipc")
#: copy kernels: CUDA C where NVRTC builds it, else Triton ("auto"), or one of them forced
KERNELS = ("auto", "cuda", "triton")
_VERSION = 1


class _Export(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    addr: int  # exporter's pointer
    nbytes: int
    handle: bytes  # kvlink.cuda_ipc.IpcHandle.to_bytes()


class _Descriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    v: int
    agent: str
    host_id: str
    device_uuid: str
    exports: list[_Export]




@dataclasses.dataclass
class _Peer:
    table: RegionTable  # the peer's own addresses
    map: Any  # _gpucopy.RegionMap: the peer's regions -> our mappings of them
    handles: list[Any]


@dataclasses.dataclass
class _Xfer:
    pending: Any  # _gpucopy.Pending
    nbytes: int
    t_post: float
    local: Extents
    remote: Extents
    peer_table: RegionTable | None
    state: XferState = PENDING


def _device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


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
        chunk = self.options.get("chunk_bytes")  # part of a long extent one program moves
        self.chunk = None if chunk is None else int(chunk)  # None: the kernel's own default
        self.piece = int(self.options.get("piece_extents", 4096))  # extents per launch
        self.kernel = str(self.options.get("kernel", "auto"))
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
        self._device = -1
        self._regions: tuple[Region, ...] = ()
        self._exports: list[_Export] = []
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._mapper: Any = None
        self._stream: Any = None
        self._copier: Any = None
        self._local_map: Any = None

    def register(self, regions: Sequence[Region]) -> None:
        from kvlink import cuda_ipc

        devices = {r.device for r in regions}
        if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
            raise TransportUnavailable(
                f"cuda_ipc moves memory of one CUDA device; got {sorted(devices)}"
            )
        self._device = _device_index(devices.pop())
        torch = self._torch
        torch.cuda.set_device(self._device)
        self._mapper = cuda_ipc.IpcMapper(self._device)
        self._stream = torch.cuda.Stream(self._device)
        from kvlink_transports._gpucopy import BatchCopier

        self._copier = BatchCopier(torch.device("cuda", self._device), chunk=self.chunk,
                                   piece=self.piece, kernel=self.kernel)
        log.info("cuda_ipc: %s copy kernel on cuda:%d", self._copier.kernel, self._device)
        exports = []
        for r in regions:  # a region may span several allocations: one handle per allocation
            start, end = r.addr, r.addr + r.nbytes
            while start < end:
                base, size = cuda_ipc.allocation_range(start)
                piece = min(end, base + size) - start
                try:
                    h = cuda_ipc.export_pointer(start, piece, self._device)
                except KVLinkError as exc:
                    raise TransportUnavailable(
                        f"cuda_ipc cannot export 0x{start:x}: {exc}"
                    ) from exc
                exports.append(_Export(start, piece, h.to_bytes()))
                start += piece
        self._regions += tuple(regions)
        self._exports += exports
        self._table = RegionTable(self._regions)
        from kvlink_transports._gpucopy import RegionMap

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
        from kvlink import cuda_ipc

        desc = self._decode(descriptor)
        why = self.unreachable_reason(descriptor, desc.host_id == self.ctx.host_id)
        if why:
            raise TransportUnavailable(why)
        self.disconnect(peer)
        handles, mapped = [], []
        try:
            for e in desc.exports:
                h = cuda_ipc.IpcHandle.from_bytes(e.handle)
                mapped.append(self._mapper.open(h))
                handles.append(h)
        except KVLinkError as exc:
            for h in handles:
                self._mapper.close(h)
            raise TransportUnavailable(f"cuda_ipc cannot map {peer}'s memory: {exc}") from exc
        from kvlink_transports._gpucopy import RegionMap

        table = RegionTable([Region(e.addr, e.nbytes, "cuda") for e in desc.exports])
        order = {e.addr: m for e, m in zip(desc.exports, mapped)}
        ours = np.array([order[r.addr] for r in table.regions], dtype=np.uint64)
        delta = ours.astype(np.int64) - table.starts.astype(np.int64)
        rmap = RegionMap(table.starts, table.ends, delta, self._torch.device("cuda", self._device))
        self._peers[peer] = _Peer(table, rmap, handles)
        log.info(
            "cuda_ipc: mapped %d allocation(s) of %s (GPU %s)",
            len(handles),
            peer,
            desc.device_uuid or "?",
        )

    def disconnect(self, peer: str) -> None:
        old = self._peers.pop(peer, None)
        if old is not None:
            self._stream.synchronize()  # nothing of ours may still touch the mapping
            for h in old.handles:
                self._mapper.close(h)

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None
    ) -> int:
        t0 = time.perf_counter()
        handle = next(self._handles)
        target = self._peers.get(peer)
        if target is None:
            self._xfers[handle] = _Xfer(None, 0, t0, local, remote, None,
                                        XferState(XferStatus.FAILED, f"peer {peer} not connected"))
            return handle
        if op is Op.READ:
            args = (remote, target.map, local, self._local_map, self._stream)
        else:
            args = (local, self._local_map, remote, target.map, self._stream)
        cuda = self._torch.cuda
        if cuda.current_device() == self._device:  # the common case: skip the context switch
            pending = self._copier.copy(*args)
        else:
            with cuda.device(self._device):
                pending = self._copier.copy(*args)
        # the copy is running: bookkeeping from here on is off the transfer's critical path
        nbytes = int(local["len"].sum())
        self._xfers[handle] = _Xfer(pending, nbytes, t0, local, remote, target.table)
        self._account(post_seconds=time.perf_counter() - t0, descriptors=int(local.shape[0]))
        return handle

    def extents(self, n: int) -> Extents:
        if self._copier is None:  # not registered yet: nothing to post with anyway
            return super().extents(n)
        return self._copier.host_extents(n)  # type: ignore[no-any-return]

    def _refusal(self, x: _Xfer) -> str:
        """Why the device refused an extent: the host checks, run only on this slow path."""
        try:
            check_pairs(x.local, x.remote)
            self._table.locate(x.local, "local extent")
            if x.peer_table is not None:
                x.peer_table.locate(x.remote, "remote extent")
        except KVLinkError as exc:
            return str(exc)
        return "an extent was refused by the device-side bounds check"

    def poll(self, handle: int) -> XferState:
        x = self._xfers.get(handle)
        if x is None:
            return XferState(XferStatus.FAILED, f"unknown or released handle {handle}")
        if x.state.status is XferStatus.PENDING and x.pending.done():
            if x.pending.failed():
                x.state = XferState(XferStatus.FAILED, self._refusal(x))
            else:
                x.state = DONE
                self._account(transfers=1, bytes=x.nbytes,
                              xfer_seconds=time.perf_counter() - x.t_post)
        return x.state

    def release(self, handle: int) -> None:
        self._xfers.pop(handle, None)

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def notify(self, peer: str, message: bytes) -> None:
        raise TransportUnavailable("cuda_ipc has no native notifications; use the side channel")

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
