"""Pick an all-reduce backend per call, in a fixed order, and say once which ones are on and why.

Order on CUDA: custom (IPC + Triton) -> torch symmetric memory (one/two-shot, multicast off) ->
NCCL. On CPU: shared memory -> gloo. Each backend declares, per call, whether it takes the tensor
(dtype, size, alignment, device); the first that does runs it. Those checks depend only on facts
that are the same on every rank (shape, dtype, configuration), never on a rank's own pointer, so
all ranks pick the same backend and their halves of the protocol meet.

At construction one INFO line on logger ``kvlink.allreduce`` lists the enabled backends in
dispatch order with the calls each one takes, and every disabled backend with the reason (world
size, P2P check, missing Triton, multicast setting, ...). Construction is collective.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from kvlink.allreduce._dist import rank_and_world
from kvlink.allreduce.config import AllReduceConfig, one_shot_limit
from kvlink.errors import AllReduceError

log = logging.getLogger("kvlink.allreduce")


class Backend(Protocol):
    """What the dispatcher needs from a backend."""

    name: str

    def unsupported(self, x: torch.Tensor) -> str | None: ...

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


class _Custom:
    name = "custom"

    def __init__(self, impl: object) -> None:
        from kvlink.allreduce.custom import CustomAllReduce

        assert isinstance(impl, CustomAllReduce)
        self.impl = impl

    def unsupported(self, x: torch.Tensor) -> str | None:
        return self.impl.unsupported(x)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self.impl.all_reduce(x, out)

    def describe(self) -> str:
        return (
            f"custom[one-shot<={_size(self.impl.one_shot_max_bytes)}, "
            f"two-shot<={_size(self.impl.config.max_bytes)}, bf16/fp16/fp32, "
            "graph inputs read in place if 16B-aligned]"
        )

    def close(self) -> None:
        self.impl.close()


class _Symm:
    name = "symm_mem"

    def __init__(self, impl: object, world: int, config: AllReduceConfig) -> None:
        from kvlink.allreduce.symm import SymmMemAllReduce

        assert isinstance(impl, SymmMemAllReduce)
        self.impl = impl
        self._world = world
        self._config = config

    def unsupported(self, x: torch.Tensor) -> str | None:
        return self.impl.unsupported(x)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self.impl.all_reduce(x, out)

    def describe(self) -> str:
        limit = one_shot_limit(self._world, self._config, cpu=False)
        return (
            f"symm_mem[one-shot<={_size(limit)}, two-shot<={_size(self._config.max_bytes)}, "
            "bf16/fp16/fp32, size%16==0, multicast off]"
        )

    def close(self) -> None:
        self.impl.close()


class _Collective:
    """torch.distributed.all_reduce on a group (NCCL for CUDA, gloo for CPU): takes anything."""

    def __init__(self, name: str, group: dist.ProcessGroup | None, device_type: str) -> None:
        self.name = name
        self._group = group
        self._device_type = device_type

    def unsupported(self, x: torch.Tensor) -> str | None:
        if x.device.type != self._device_type:
            return f"tensor on {x.device}"
        return None

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = x.clone(memory_format=torch.contiguous_format)
        elif out is not x:
            out.copy_(x)
        dist.all_reduce(out, group=self._group)
        return out

    def describe(self) -> str:
        return f"{self.name}[any size/dtype]"

    def close(self) -> None:
        pass


class _Shm:
    name = "shm"

    def __init__(self, impl: object) -> None:
        from kvlink.allreduce.shm import ShmAllReduce

        assert isinstance(impl, ShmAllReduce)
        self.impl = impl

    def unsupported(self, x: torch.Tensor) -> str | None:
        from kvlink.allreduce.shm import SUPPORTED_DTYPES

        if x.device.type != "cpu":
            return f"tensor on {x.device}"
        if x.dtype not in SUPPORTED_DTYPES:
            return f"dtype {x.dtype}"
        if x.requires_grad:
            return "a tensor that requires grad"
        return None

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self.impl.all_reduce(x, out)

    def describe(self) -> str:
        world = self.impl.world_size
        limit = one_shot_limit(world, self.impl.config, cpu=True)
        return (
            f"shm[one-shot<={_size(limit)}, two-shot above, bf16/fp16/fp32, "
            f"{_size(self.impl.layout.capacity)} per step, timeout {self.impl.config.timeout_s:g}s]"
        )

    def close(self) -> None:
        self.impl.close()


class AllReduce:
    """Sum tensors over a process group through the fastest backend that takes each call.

    ``cpu_group``: a gloo group (default: the default group) for setup and the CPU fallback.
    ``device_group``: an NCCL group for the symmetric-memory and NCCL backends (default: the
    default group when its backend is NCCL). ``device``: where the tensors live (default: the
    current CUDA device if CUDA is available, else CPU).
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup | None = None,
        device_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        config: AllReduceConfig | None = None,
    ) -> None:
        self.config = config or AllReduceConfig()
        self.rank, self.world_size = rank_and_world(cpu_group)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if device_group is None and self.device.type == "cuda":
            default = dist.group.WORLD
            if default is not None and "nccl" in str(dist.get_backend(default)):
                device_group = default
        self.cpu_group = cpu_group
        self.device_group = device_group
        self._custom: object | None = None
        self.backends: list[Backend] = []
        self.disabled: dict[str, str] = {}
        self._fallback_seen: set[tuple[str, str]] = set()
        if self.device.type == "cuda":
            self._build_cuda()
        else:
            self._build_cpu()
        log.info(self.summary())

    # ------------------------------------------------------------------ construction
    def _try(self, name: str, enabled: bool, make: Callable[[], Backend]) -> None:
        if not enabled:
            self.disabled[name] = "disabled by config"
            return
        try:
            self.backends.append(make())
        except AllReduceError as exc:
            self.disabled[name] = str(exc)

    def _build_cuda(self) -> None:
        cfg = self.config

        def custom() -> Backend:
            from kvlink.allreduce.custom import CustomAllReduce

            impl = CustomAllReduce(self.cpu_group, self.device, cfg)
            self._custom = impl
            return _Custom(impl)

        def symm() -> Backend:
            from kvlink.allreduce.symm import SymmMemAllReduce

            if self.device_group is None:
                raise AllReduceError("no NCCL device group to rendezvous on")
            impl = SymmMemAllReduce(self.cpu_group, self.device_group, self.device, cfg)
            return _Symm(impl, self.world_size, cfg)

        self._try("custom", cfg.enable_custom, custom)
        self._try("symm_mem", cfg.enable_symm_mem, symm)
        if not cfg.enable_fallback:
            self.disabled["nccl"] = "disabled by config"
        elif self.device_group is None:
            self.disabled["nccl"] = "no NCCL device group (pass device_group=)"
        else:
            self.backends.append(_Collective("nccl", self.device_group, "cuda"))

    def _build_cpu(self) -> None:
        cfg = self.config

        def shm() -> Backend:
            from kvlink.allreduce.shm import ShmAllReduce

            if self.world_size < 2:
                raise AllReduceError(f"world size {self.world_size}")
            return _Shm(ShmAllReduce(self.cpu_group, config=cfg))

        self._try("shm", cfg.enable_custom, shm)
        if cfg.enable_fallback:
            self.backends.append(_Collective("gloo", self.cpu_group, "cpu"))
        else:
            self.disabled["gloo"] = "disabled by config"

    def summary(self) -> str:
        """The one log line: enabled backends in dispatch order, then disabled ones and why."""
        order = " -> ".join(b.describe() for b in self.backends) or "none"
        off = "; ".join(f"{name}: {why}" for name, why in self.disabled.items()) or "none"
        return (
            f"all-reduce rank {self.rank}/{self.world_size} on {self.device}: "
            f"dispatch {order}; disabled: {off}"
        )

    @property
    def backend_names(self) -> list[str]:
        return [b.name for b in self.backends]

    # ------------------------------------------------------------------ hot path
    def backend_for(self, x: torch.Tensor) -> Backend:
        """The backend that will run ``x`` (first in order that takes it)."""
        reasons: list[str] = []
        for backend in self.backends:
            why = backend.unsupported(x)
            if why is None:
                return backend
            reasons.append(f"{backend.name}: {why}")
            key = (backend.name, why.split(" ", 1)[0])
            if key not in self._fallback_seen:
                self._fallback_seen.add(key)
                log.debug("all-reduce: %s passes a call on (%s)", backend.name, why)
        raise AllReduceError(f"no all-reduce backend takes this call ({'; '.join(reasons)})")

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x`` over the group; returns a new tensor, or ``out`` (which may be ``x``).
        ``out`` must have ``x``'s shape and dtype, whichever backend takes the call (a copy
        into another shape or dtype broadcast or cast silently on the gloo and NCCL paths)."""
        if out is not None and out is not x and (out.shape != x.shape or out.dtype != x.dtype):
            raise AllReduceError(f"out must be {tuple(x.shape)} {x.dtype} like x, got "
                                 f"{tuple(out.shape)} {out.dtype}")
        if self.world_size == 1:
            if out is None:
                return x.clone(memory_format=torch.contiguous_format)
            if out is not x:
                out.copy_(x)
            return out
        return self.backend_for(x).all_reduce(x, out)

    # ------------------------------------------------------------------ graphs / teardown
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Use around ``torch.cuda.graph(...)`` capture: registers captured custom-kernel inputs."""
        try:
            yield
        finally:
            self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Collective, after capture: see :meth:`CustomAllReduce.register_graph_buffers`."""
        from kvlink.allreduce.custom import CustomAllReduce

        if isinstance(self._custom, CustomAllReduce):
            self._custom.register_graph_buffers()

    def close(self) -> None:
        """Collective: close every backend (unmaps shared buffers)."""
        for backend in self.backends:
            backend.close()
        self.backends = []
