"""GPU tests of the custom all-reduce (skipped, with the reason, where there is no CUDA device).

* the Triton kernels and flag protocol, with several "ranks" inside one process on separate
  streams (no IPC involved: pointers are plain device pointers);
* CUDA IPC export/open across two processes on one device (kvlink.gpu.ipc);
* the dispatcher's one log line and world-size-1 behaviour;
* the full multi-process check script (2 ranks on cuda:0, eager and CUDA-graph replay).

Run on a GPU machine: ``python3 -m pytest tests/test_allreduce_gpu.py -q -ra``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: torch.cuda.is_available() is False (GPU all-reduce tests need one)",
        allow_module_level=True,
    )
try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - GPU host without Triton
    pytest.skip(f"no Triton on this CUDA host: {exc}", allow_module_level=True)

from kvlink.allreduce import kernels
from kvlink.allreduce.config import FLAG_BLOCKS
from kvlink.allreduce.ipc_buffers import (
    COUNTERS_OFFSET,
    DATA_OFFSET,
    END_FLAGS_OFFSET,
)
from kvlink.gpu import ipc

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda", 0)


class _InProcessRanks:
    """``world`` rank buffers in one process; each rank's kernel runs on its own stream."""

    def __init__(self, world: int, capacity: int) -> None:
        self.world = world
        self.bufs = [
            torch.zeros(DATA_OFFSET + 2 * capacity, dtype=torch.uint8, device=DEVICE)
            for _ in range(world)
        ]
        bases = [b.data_ptr() for b in self.bufs]
        self.flag_table = torch.tensor(bases, dtype=torch.int64, device=DEVICE)
        self.staging_table = torch.tensor(
            [b + DATA_OFFSET for b in bases], dtype=torch.int64, device=DEVICE
        )
        self.tmp_table = torch.tensor(
            [b + DATA_OFFSET + capacity for b in bases], dtype=torch.int64, device=DEVICE
        )
        self.counters = [
            b[COUNTERS_OFFSET : COUNTERS_OFFSET + FLAG_BLOCKS * 4].view(torch.int32)
            for b in self.bufs
        ]
        self.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(world)]

    def run(self, xs: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
        n = xs[0].numel()
        nbytes = n * xs[0].element_size()
        for r, x in enumerate(xs):
            self.bufs[r][DATA_OFFSET : DATA_OFFSET + nbytes].copy_(x.view(torch.uint8))
        outs = [torch.empty_like(x) for x in xs]
        torch.cuda.synchronize()
        warps = 8
        block = warps * 32 * (16 // xs[0].element_size())
        for r in range(self.world):
            with torch.cuda.stream(self.streams[r]):
                if mode == "one_shot":
                    grid = min(36, -(-n // block))
                    kernels.one_shot_kernel[(grid,)](
                        self.staging_table, self.flag_table, outs[r], self.counters[r], r, n,
                        WORLD=self.world, BLOCK=block, END_OFF=END_FLAGS_OFFSET, num_warps=warps,
                    )
                else:
                    per_rank = -(-n // self.world)
                    chunk = -(-per_rank // 16) * 16
                    grid = min(36, -(-chunk // block))
                    kernels.two_shot_kernel[(grid,)](
                        self.staging_table, self.tmp_table, self.flag_table, outs[r],
                        self.counters[r], r, n, chunk,
                        WORLD=self.world, BLOCK=block, END_OFF=END_FLAGS_OFFSET, num_warps=warps,
                    )
        torch.cuda.synchronize()
        return outs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_in_one_process(world: int, dtype: torch.dtype) -> None:
    ranks = _InProcessRanks(world, capacity=1 << 20)
    gen = torch.Generator(device=DEVICE).manual_seed(world)
    for n in (1, 3, 129, 4099, 65536, 262144 // 2):
        xs = [(torch.randn(n, device=DEVICE, generator=gen) * 3).to(dtype) for _ in range(world)]
        acc = xs[0].float().clone()  # .float() of an fp32 tensor is the tensor itself
        for x in xs[1:]:
            acc += x.float()
        ref = acc.to(dtype)
        for mode in ("one_shot", "two_shot", "one_shot"):  # epochs advance across modes
            outs = ranks.run(xs, mode)
            for r, out in enumerate(outs):
                assert torch.equal(out.view(torch.int8), ref.view(torch.int8)), (n, mode, r)


def _export_child(queue: Any, done: Any) -> None:
    torch.cuda.set_device(0)
    t = torch.arange(1024, dtype=torch.float32, device="cuda")
    queue.put(ipc.export_tensor(t[256:]).to_bytes())
    done.wait(60)
    queue.put(float(t[256:].sum()))  # the parent wrote into our memory


def test_cuda_ipc_roundtrip_across_processes() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    done = ctx.Event()
    child = ctx.Process(target=_export_child, args=(queue, done))
    child.start()
    try:
        handle = ipc.IpcHandle.from_bytes(queue.get(timeout=120))
        assert handle.nbytes == 768 * 4 and handle.offset % 4 == 0
        mapper = ipc.IpcMapper(0)
        peer = ipc.open_tensor(mapper, handle).view(torch.float32)
        expect = torch.arange(256, 1024, dtype=torch.float32, device="cuda")
        assert torch.equal(peer, expect)
        peer.fill_(2.0)
        torch.cuda.synchronize()
        assert mapper.open(handle) == peer.data_ptr()  # cached: one mapping per allocation
        done.set()
        assert queue.get(timeout=60) == 2.0 * 768
        mapper.close_all()
        with pytest.raises(ipc.CudaIpcError):
            mapper.open(ipc.export_tensor(expect))  # own handle: refused clearly
    finally:
        done.set()
        child.join(30)
        if child.exitcode is None:
            child.kill()


def test_dispatcher_world_one_logs_reason(caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed as dist

    from kvlink.allreduce import AllReduce

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with caplog.at_level("INFO", logger="kvlink.allreduce"):
            ar = AllReduce(device=DEVICE)
        lines = [r.getMessage() for r in caplog.records if r.name == "kvlink.allreduce"]
        assert len(lines) == 1 and "world size 1" in lines[0], lines
        x = torch.ones(8, device=DEVICE)
        assert torch.equal(ar.all_reduce(x), x)
        ar.close()
    finally:
        dist.destroy_process_group()


def test_check_script_two_ranks_on_one_gpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_allreduce_check.py"), "--worlds", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
