"""The GPU all-reduce's shared memory: one IPC buffer per rank and the device pointer tables.

Each rank allocates one dedicated ``cuMemAlloc`` block (never from PyTorch's caching allocator, so
``expandable_segments`` or pool settings cannot break its IPC handle), zeroes its flags, exports
it, and maps every peer's. The kernels never see Python: they get int64 *tables* of addresses in
device memory (peer flag bases, peer staging inputs, peer two-shot buffers), so a captured CUDA
graph keeps pointing at the same tables.

Graph registration. A kernel captured into a CUDA graph may read the caller's input tensor in
place instead of a staging copy. At capture time the address of each peer's input is not known
yet, so the call takes the next row of ``graph_table`` (zeros) and remembers its own pointer;
after capture, :meth:`IpcBuffers.register_graph_inputs` exchanges ``(handle, offset)`` for every
new row over the CPU group, opens the peers' allocations and fills the rows with one host-to-device
copy. Replays then need no host work at all. A rank whose input cannot be registered (misaligned,
or ``expandable_segments``) puts its staging buffer in its column and copies into it inside the
graph; that choice is per rank and needs no agreement, because peers just read whatever address
the row holds.

Buffer layout (bytes)::

    0                 start flags  int32[FLAG_BLOCKS][MAX_WORLD]
    FLAGS_BYTES       end flags    int32[FLAG_BLOCKS][MAX_WORLD]
    2*FLAGS_BYTES     counters     int32[FLAG_BLOCKS]
    DATA_OFFSET       staging input (capacity)
    DATA_OFFSET+cap   two-shot reduce-scatter output (capacity)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kvlink.allreduce._dist import agree, all_gather_obj
from kvlink.allreduce.config import FLAG_BLOCKS, MAX_WORLD
from kvlink.errors import AllReduceError
from kvlink.gpu import ipc
from kvlink.gpu.ipc import CudaIpcError

log = logging.getLogger("kvlink.allreduce")

FLAGS_BYTES = FLAG_BLOCKS * MAX_WORLD * 4
END_FLAGS_OFFSET = FLAGS_BYTES
COUNTERS_OFFSET = 2 * FLAGS_BYTES
DATA_OFFSET = 16384
assert COUNTERS_OFFSET + FLAG_BLOCKS * 4 <= DATA_OFFSET


@contextlib.contextmanager
def _as_allreduce_error() -> Iterator[None]:
    """A CUDA IPC failure leaves the all-reduce as an ``AllReduceError`` (same message, the
    ``CudaIpcError`` as its cause): what the all-reduce's callers catch."""
    try:
        yield
    except CudaIpcError as exc:
        raise AllReduceError(str(exc)) from exc


@dataclasses.dataclass(frozen=True)
class _GraphInput:
    """One reserved graph-table row: what this rank put in its own column."""

    ptr: int
    nbytes: int
    staged: bool


class IpcBuffers:
    """This rank's buffer, the mapped peer buffers, and the device tables the kernels read."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        device: int,
        capacity: int,
        max_graph_slots: int,
    ) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.capacity = capacity
        self.total = DATA_OFFSET + 2 * capacity
        self.mapper = ipc.IpcMapper(device)
        self._own_ptr = 0
        self._closed = False
        dev = torch.device("cuda", device)

        problem = ""
        record = b""
        try:
            ipc.ensure_context(device)
            self._own_ptr = ipc.mem_alloc(self.total)
            self.own = ipc.tensor_from_pointer(self._own_ptr, self.total, device)
            self.own[:DATA_OFFSET].zero_()
            torch.cuda.synchronize(dev)
            record = ipc.export_pointer(self._own_ptr, self.total, device).to_bytes()
        except (AllReduceError, CudaIpcError, RuntimeError) as exc:
            problem = f"buffer allocation/export failed: {exc}"
        verdict = agree(not problem, problem, group)
        if verdict is not None:
            self.close()
            raise AllReduceError(f"custom all-reduce disabled: {verdict}")

        records = all_gather_obj(record, group)
        bases: list[int] = []
        try:
            for peer, rec in enumerate(records):
                if peer == rank:
                    bases.append(self._own_ptr)
                else:
                    bases.append(self.mapper.open(ipc.IpcHandle.from_bytes(rec)))
        except (AllReduceError, CudaIpcError) as exc:
            problem = f"opening a peer's IPC buffer failed: {exc}"
        verdict = agree(not problem, problem, group)
        if verdict is not None:
            self.close()
            raise AllReduceError(f"custom all-reduce disabled: {verdict}")

        self.bases = bases
        self.staging_addrs = [b + DATA_OFFSET for b in bases]
        self.tmp_addrs = [b + DATA_OFFSET + capacity for b in bases]
        self.flag_table = torch.tensor(bases, dtype=torch.int64, device=dev)
        self.staging_table = torch.tensor(self.staging_addrs, dtype=torch.int64, device=dev)
        self.tmp_table = torch.tensor(self.tmp_addrs, dtype=torch.int64, device=dev)
        self.counters = self.own[COUNTERS_OFFSET : COUNTERS_OFFSET + FLAG_BLOCKS * 4].view(
            torch.int32
        )
        self.staging = self.own[DATA_OFFSET : DATA_OFFSET + capacity]
        self.graph_table = torch.zeros((max_graph_slots, world), dtype=torch.int64, device=dev)
        self._graph_inputs: list[_GraphInput] = []
        self._registered = 0
        self._graph_handles: list[ipc.IpcHandle] = []
        torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def free_graph_slots(self) -> int:
        return self.graph_table.shape[0] - len(self._graph_inputs)

    @property
    def pending_graph_slots(self) -> int:
        return len(self._graph_inputs) - self._registered

    def reserve_graph_slot(self, ptr: int, nbytes: int, staged: bool) -> torch.Tensor:
        """Take the next graph-table row for a call being captured; returns that row (int64[world]).

        ``staged`` means this rank copies its input into its staging buffer inside the graph and
        publishes the staging address instead of ``ptr``.
        """
        k = len(self._graph_inputs)
        if k >= self.graph_table.shape[0]:
            raise AllReduceError(f"graph pointer table full ({k} rows); raise max_graph_slots")
        self._graph_inputs.append(_GraphInput(ptr, nbytes, staged))
        return self.graph_table[k]

    def register_graph_inputs(self, group: dist.ProcessGroup | None) -> int:
        """Collective: exchange handles of rows reserved since the last call and fill them.

        Every rank must have captured the same sequence of all-reduce calls; a mismatch in the
        number of new rows is reported instead of silently pairing unrelated calls.
        """
        new = self._graph_inputs[self._registered :]
        mine: list[bytes | None] = []
        problem = ""
        try:
            for item in new:
                if item.staged:
                    mine.append(None)
                else:
                    mine.append(
                        ipc.export_pointer(item.ptr, item.nbytes, self.device).to_bytes()
                    )
        except (AllReduceError, CudaIpcError) as exc:
            problem = f"cannot export a captured input: {exc}"
        everyone = all_gather_obj((problem, mine), group)
        for peer, (peer_problem, peer_rows) in enumerate(everyone):
            if peer_problem:
                raise AllReduceError(f"graph registration failed on rank {peer}: {peer_problem}")
            if len(peer_rows) != len(new):
                counts = [len(rows) for _, rows in everyone]
                raise AllReduceError(
                    "ranks captured different numbers of all-reduce calls since the last "
                    f"registration: {counts} (every rank must capture the same sequence)"
                )
        rows: list[list[int]] = []
        with _as_allreduce_error():
            for k, item in enumerate(new):
                row: list[int] = []
                for peer in range(self.world):
                    if peer == self.rank:
                        row.append(self.staging_addrs[peer] if item.staged else item.ptr)
                        continue
                    rec = everyone[peer][1][k]
                    if rec is None:
                        row.append(self.staging_addrs[peer])
                    else:
                        handle = ipc.IpcHandle.from_bytes(rec)
                        row.append(self.mapper.open(handle))
                        self._graph_handles.append(handle)
                rows.append(row)
        if rows:
            lo = self._registered
            host = torch.tensor(rows, dtype=torch.int64)
            self.graph_table[lo : lo + len(rows)].copy_(host)
            torch.cuda.synchronize(torch.device("cuda", self.device))
        self._registered = len(self._graph_inputs)
        return len(rows)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unmap peers' buffers and free ours. Peers must have stopped using it (collective)."""
        if self._closed:
            return
        self._closed = True
        with _as_allreduce_error():
            try:
                self.mapper.close_all()
            finally:
                if self._own_ptr:
                    self.__dict__.pop("own", None)
                    self.__dict__.pop("counters", None)
                    self.__dict__.pop("staging", None)
                    ipc.mem_free(self._own_ptr)
                    self._own_ptr = 0
