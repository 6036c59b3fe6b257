"""Second GPU backend: PyTorch symmetric memory's one-shot/two-shot all-reduce (no multicast).

Why keep it: when the custom kernels are unavailable (no Triton, world size > 8) or for A/B
measurements, torch's own P2P kernels still beat NCCL at decode sizes. NVLink multicast (the
``multimem`` path, ``cuMulticastCreate``) must stay off: on shared hosts a program that uses it
can take the host's GPUs out of service. We therefore set ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
when it is unset, refuse to enable this backend when it is set to anything else, and only call
the ``one_shot``/``two_shot`` ops (never ``multimem_*``).

The input is copied into a registered symmetric buffer (the ops require it). Two buffers are used
alternately so that a call never overwrites the one a slow peer may still be reading from the
previous call: each op's entry barrier orders call ``k+2``'s write after every peer left call ``k``.
Each buffer is its own allocation, so the ops always see storage offset 0.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from kvlink.allreduce._dist import agree, rank_and_world
from kvlink.allreduce.config import AllReduceConfig, ModeArg, choose_mode
from kvlink.errors import AllReduceError

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def require_multicast_off() -> str:
    """Force NVLink multicast off for torch symmetric memory; "" if it is off, else the reason."""
    value = os.environ.get(MULTICAST_ENV)
    if value is None:
        os.environ[MULTICAST_ENV] = "1"
        return ""
    if value.strip() != "1":
        return f"{MULTICAST_ENV}={value!r} (kvlink requires 1: NVLink multicast must stay off)"
    return ""


class SymmMemAllReduce:
    """torch.distributed._symmetric_memory one-/two-shot all-reduce over ``device_group``.

    ``cpu_group`` carries the enable/disable agreement; ``device_group`` (NCCL) names the
    symmetric-memory rendezvous. Raises :class:`AllReduceError` on all ranks if any rank can't.
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup | None,
        device_group: dist.ProcessGroup,
        device: torch.device,
        config: AllReduceConfig | None = None,
    ) -> None:
        self.config = config or AllReduceConfig()
        self.rank, self.world_size = rank_and_world(cpu_group)
        self.device = device
        self._closed = True
        problem = require_multicast_off()
        if not problem and self.world_size < 2:
            problem = f"world size {self.world_size}"
        if not problem and device.type != "cuda":
            problem = f"device {device} is not CUDA"
        symm: Any = None
        if not problem:
            try:
                import torch.distributed._symmetric_memory as symm
            except ImportError as exc:
                problem = f"torch has no symmetric memory ({exc})"
        verdict = agree(not problem, problem, cpu_group)
        if verdict is not None:
            raise AllReduceError(f"symm_mem all-reduce disabled: {verdict}")
        self._half = self.config.max_bytes
        self._group_name = str(device_group.group_name)
        self._bufs: list[torch.Tensor] = []
        try:
            for _ in range(2):
                buf = symm.empty(self._half, dtype=torch.uint8, device=device)
                symm.rendezvous(buf, device_group)
                self._bufs.append(buf)
        except Exception as exc:  # torch raises RuntimeError/ValueError/... by build
            problem = f"rendezvous failed: {type(exc).__name__}: {exc}"[:300]
        verdict = agree(not problem, problem, cpu_group)
        if verdict is not None:
            raise AllReduceError(f"symm_mem all-reduce disabled: {verdict}")
        self._parity = 0
        self._closed = False

    def unsupported(self, x: torch.Tensor) -> str | None:
        if self._closed:
            return "closed"
        if x.dtype not in SUPPORTED_DTYPES:
            return f"dtype {x.dtype}"
        nbytes = x.numel() * x.element_size()
        if nbytes > self._half:
            return f"size {nbytes} B > buffer {self._half} B"
        if nbytes % 16:
            return f"size {nbytes} B is not a multiple of 16 (alignment)"
        if x.device != self.device:
            return f"tensor on {x.device}"
        return None

    def all_reduce(
        self, x: torch.Tensor, out: torch.Tensor | None = None, *, mode: ModeArg = "auto"
    ) -> torch.Tensor:
        reason = self.unsupported(x)
        if reason is not None:
            raise AllReduceError(f"symm_mem all-reduce cannot take this call: {reason}")
        src = x if x.is_contiguous() else x.contiguous()
        if out is None:
            out = torch.empty_like(src, memory_format=torch.contiguous_format)
        nbytes = src.numel() * src.element_size()
        staged = self._bufs[self._parity][:nbytes]
        self._parity ^= 1
        staged.copy_(src.view(-1).view(torch.uint8))
        inp = staged.view(src.dtype)
        flat_out = out.view(-1)
        resolved = choose_mode(nbytes, self.world_size, self.config, mode, cpu=False)
        if resolved == "two_shot" and nbytes % (16 * self.world_size) == 0:
            torch.ops.symm_mem.two_shot_all_reduce_out(inp, "sum", self._group_name, flat_out)
        else:
            torch.ops.symm_mem.one_shot_all_reduce_out(inp, "sum", self._group_name, flat_out)
        return out

    def close(self) -> None:
        self._closed = True
        self._bufs = []
