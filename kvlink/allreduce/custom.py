"""The custom GPU all-reduce: IPC buffers + Triton one-shot/two-shot kernels, eager and graphs.

Why a custom kernel: a decode step all-reduces ~128 KiB 160 times, and at that size NCCL's fixed
cost (protocol setup, channel handshakes) dominates. Here a call is one kernel with two flag
barriers, reading peers' memory directly over NVLink/P2P, with the epoch kept on the device so the
call can live inside a CUDA graph and replay without the host.

Eager call: copy the input into our staging buffer (peers read it there), launch the kernel on the
current stream. Captured call: reserve a pointer-table row and read the caller's tensor in place
(see ``ipc_buffers.py``); call :meth:`CustomAllReduce.register_graph_buffers` (or use
:meth:`CustomAllReduce.capture`) once capture ends and before the first replay.

One communicator serves one stream: its flags and epochs assume calls are stream-ordered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kvlink.allreduce._dist import agree, all_gather_obj, rank_and_world
from kvlink.allreduce.config import (
    FLAG_BLOCKS,
    MAX_WORLD,
    AllReduceConfig,
    ModeArg,
    choose_mode,
    one_shot_limit,
)
from kvlink.errors import AllReduceError

log = logging.getLogger("kvlink.allreduce")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Alignment of every buffer the kernels read (16-byte vector loads).
ALIGN = 16
_CHUNK_ALIGN_ELEMS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _local_checks(world: int, device: torch.device) -> str:
    """Why this rank cannot run the custom kernels ("" if it can)."""
    if world < 2:
        return f"world size {world} (nothing to reduce)"
    if world > MAX_WORLD:
        return f"world size {world} > {MAX_WORLD} (flag rows are {MAX_WORLD} wide)"
    if not torch.cuda.is_available() or device.type != "cuda":
        return f"device {device} is not a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return ""


def _p2p_check(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """All ranks on one host, and every pair of distinct GPUs with peer access ("" if fine).

    Devices are compared by UUID (ordinals differ under per-process CUDA_VISIBLE_DEVICES).
    Several ranks on one GPU is fine: IPC works between processes on the same device.
    """
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", f"ordinal-{device.index}"))
    mine = (socket.gethostname(), uuid)
    everyone = all_gather_obj(mine, group)
    hosts = {h for h, _ in everyone}
    if len(hosts) > 1:
        return f"ranks span {len(hosts)} hosts ({', '.join(sorted(hosts))})"
    visible: dict[str, int] = {}
    for idx in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(idx)
        visible[str(getattr(p, "uuid", f"ordinal-{idx}"))] = idx
    me = int(device.index or 0)
    for peer_rank, (_, peer_uuid) in enumerate(everyone):
        if peer_uuid == uuid:
            continue
        peer_idx = visible.get(peer_uuid)
        if peer_idx is None:
            continue  # not visible here: cuIpcOpenMemHandle below is the test
        if not torch.cuda.can_device_access_peer(me, peer_idx):
            return f"P2P check failed: cuda:{me} cannot access rank {peer_rank}'s cuda:{peer_idx}"
    return ""


class CustomAllReduce:
    """Sum CUDA tensors (bf16/fp16/fp32, up to ``config.max_bytes``) over a single-host group.

    ``group`` is a CPU (gloo) group used for setup and graph registration only. Construction is
    collective and raises :class:`~kvlink.errors.AllReduceError` on every rank (with the reason of
    the rank that failed) if any rank cannot take part.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device | int | None = None,
        config: AllReduceConfig | None = None,
    ) -> None:
        self.config = config or AllReduceConfig()
        self.group = group
        self.rank, self.world_size = rank_and_world(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._closed = True

        problem = _local_checks(self.world_size, device)
        verdict = agree(not problem, problem, group)
        if verdict is not None:
            raise AllReduceError(f"custom all-reduce disabled: {verdict}")
        torch.cuda.set_device(device)
        problem = _p2p_check(group, device)
        verdict = agree(not problem, problem, group)
        if verdict is not None:
            raise AllReduceError(f"custom all-reduce disabled: {verdict}")

        from kvlink.allreduce import kernels  # Triton import is deferred to here on purpose
        from kvlink.allreduce.ipc_buffers import END_FLAGS_OFFSET, IpcBuffers

        self._kernels: Any = kernels
        self._end_off = END_FLAGS_OFFSET
        self.buffers = IpcBuffers(
            group,
            self.rank,
            self.world_size,
            int(device.index or 0),
            self.config.max_bytes,
            self.config.max_graph_slots,
        )
        # every block must be resident at once (a block spins until its peers' twins arrive)
        sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
        self._max_blocks = max(1, min(self.config.max_blocks, FLAG_BLOCKS, sms))
        self._closed = False
        self._register_inputs = not _expandable_segments()
        self._warned_full = False

    # ------------------------------------------------------------------ capability
    @property
    def one_shot_max_bytes(self) -> int:
        return one_shot_limit(self.world_size, self.config, cpu=False)

    def unsupported(self, x: torch.Tensor) -> str | None:
        """Why this call cannot run here (None if it can). Depends only on rank-symmetric facts."""
        if self._closed:
            return "closed"
        if x.dtype not in SUPPORTED_DTYPES:
            return f"dtype {x.dtype} (supports bf16/fp16/fp32)"
        nbytes = x.numel() * x.element_size()
        if nbytes > self.config.max_bytes:
            return f"size {nbytes} B > buffer {self.config.max_bytes} B"
        if x.device != self.device:
            return f"tensor on {x.device}, communicator on {self.device}"
        return None

    # ------------------------------------------------------------------ hot path
    def all_reduce(
        self, x: torch.Tensor, out: torch.Tensor | None = None, *, mode: ModeArg = "auto"
    ) -> torch.Tensor:
        """Return the sum over ranks of ``x`` (a new tensor, or ``out``; ``out`` may be ``x``)."""
        reason = self.unsupported(x)
        if reason is not None:
            raise AllReduceError(f"custom all-reduce cannot take this call: {reason}")
        src = x if x.is_contiguous() else x.contiguous()
        if out is None:
            out = torch.empty_like(src, memory_format=torch.contiguous_format)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise AllReduceError("out must be a contiguous tensor of x's shape and dtype")
        n = src.numel()
        if n == 0:
            return out
        nbytes = n * src.element_size()
        buffers = self.buffers
        capturing = torch.cuda.is_current_stream_capturing()
        in_table: torch.Tensor
        if capturing and buffers.free_graph_slots > 0:
            ptr = src.data_ptr()
            staged = not self._register_inputs or ptr % ALIGN != 0 or _overlaps(src, out)
            in_table = buffers.reserve_graph_slot(ptr, nbytes, staged)
            if staged:
                self._stage(src, nbytes)
        else:
            if capturing and not self._warned_full:
                self._warned_full = True
                log.warning("all-reduce graph table full: captured calls now copy their input")
            self._stage(src, nbytes)
            in_table = buffers.staging_table
        self._launch(in_table, out, n, src.element_size(), mode)
        return out

    def _stage(self, src: torch.Tensor, nbytes: int) -> None:
        self.buffers.staging[:nbytes].copy_(src.view(-1).view(torch.uint8))

    def _launch(
        self, in_table: torch.Tensor, out: torch.Tensor, n: int, elem_size: int, mode: ModeArg
    ) -> None:
        cfg = self.config
        world = self.world_size
        block = cfg.num_warps * 32 * (16 // elem_size)
        resolved = choose_mode(n * elem_size, world, cfg, mode, cpu=False)
        k = self._kernels
        b = self.buffers
        if resolved == "one_shot":
            grid = min(self._max_blocks, _cdiv(n, block))
            k.one_shot_kernel[(grid,)](
                in_table,
                b.flag_table,
                out,
                b.counters,
                self.rank,
                n,
                WORLD=world,
                BLOCK=block,
                END_OFF=self._end_off,
                num_warps=cfg.num_warps,
            )
        else:
            chunk = _cdiv(_cdiv(n, world), _CHUNK_ALIGN_ELEMS) * _CHUNK_ALIGN_ELEMS
            grid = min(self._max_blocks, _cdiv(chunk, block))
            k.two_shot_kernel[(grid,)](
                in_table,
                b.tmp_table,
                b.flag_table,
                out,
                b.counters,
                self.rank,
                n,
                chunk,
                WORLD=world,
                BLOCK=block,
                END_OFF=self._end_off,
                num_warps=cfg.num_warps,
            )

    # ------------------------------------------------------------------ CUDA graphs
    def register_graph_buffers(self) -> int:
        """Collective, after capture and before replay: publish captured inputs to peers."""
        return self.buffers.register_graph_inputs(self.group)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap a ``torch.cuda.graph`` capture: registers the captured inputs when it ends."""
        try:
            yield
        finally:
            self.register_graph_buffers()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Collective: wait for our kernels, then for every rank, then unmap and free."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.buffers.close()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges intersect (graph inputs must not alias the output)."""
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1
