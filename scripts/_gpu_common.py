"""Shared by the GPU scripts: the cuda_ipc acceptance shapes set up in one process, and one way
to write a result JSON (the figures plus the machine, the command and the UTC date that every
result under bench/results/ carries)."""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import sys
import time
from typing import Any

import numpy as np

GIB = 1 << 30
#: (a) 1 GiB in 4 MiB extents, (b) a Llama-3-70B-shaped 4096-token request (20480 blocks of
#: 8 KiB), (c) 1 GiB in 64 MiB extents; ``cache``: the buffer the blocks are picked from
CASES = {
    "a_1GiB_4MiB": dict(cache=2 * GIB, ext=4 << 20, count=256),
    "b_llama70b_4096tok_8KiB": dict(cache=640 << 20, ext=8 << 10, count=20480),
    "c_1GiB_64MiB": dict(cache=2 * GIB, ext=64 << 20, count=16),
}


@dataclasses.dataclass
class Case:
    """``count`` blocks of ``ext`` bytes at random distinct ids of a random source buffer, to
    be copied to random distinct ids of a zeroed destination buffer on the same GPU."""

    ext: int
    count: int
    src: Any  # torch int64 tensors of ``cache`` bytes
    dst: Any
    sblk: np.ndarray  # block ids, uint64
    dblk: np.ndarray
    smap: Any  # _gpucopy.RegionMap of each buffer
    dmap: Any

    @property
    def nbytes(self) -> int:
        return self.ext * self.count

    def addresses(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination block addresses (uint64)."""
        e = np.uint64(self.ext)
        return (np.uint64(self.src.data_ptr()) + self.sblk * e,
                np.uint64(self.dst.data_ptr()) + self.dblk * e)

    def verified(self) -> bool:
        """Every destination block holds its source block."""
        import torch

        dev = self.src.device
        sidx = torch.from_numpy(self.sblk.astype(np.int64)).to(dev)
        didx = torch.from_numpy(self.dblk.astype(np.int64)).to(dev)
        w = self.ext // 8
        return bool(torch.equal(self.dst.view(-1, w)[didx], self.src.view(-1, w)[sidx]))


def host_seconds(fn: Any, reps: int) -> float:
    """Median wall time of ``fn`` between two device synchronizes (the first call not counted):
    what a caller that waits for the result sees."""
    import torch

    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def event_us(fn: Any, reps: int, inner: int = 5) -> float:
    """Median device time of one ``fn`` in microseconds, by CUDA events around ``inner``
    back-to-back calls (after one untimed call)."""
    import torch

    fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / inner)
    return statistics.median(ts)


def timed_post(cp: Any, src: Any, smap: Any, dst: Any, dmap: Any, stream: Any
               ) -> tuple[Any, int, int, int]:
    """One BatchCopier.copy, spun on until done: (pending, start, post returned, done seen),
    perf_counter_ns stamps."""
    t0 = time.perf_counter_ns()
    p = cp.copy(src, smap, dst, dmap, stream)
    t1 = time.perf_counter_ns()
    while not p.done():
        pass
    return p, t0, t1, time.perf_counter_ns()


def make_case(c: dict[str, int], rng: np.random.Generator, dev: Any) -> Case:
    import torch

    from kvlink_transports._gpucopy import RegionMap

    ext, count, cache = c["ext"], c["count"], c["cache"]
    src = torch.empty(cache // 8, dtype=torch.int64, device=dev).random_()
    dst = torch.zeros_like(src)
    nblk = cache // ext
    sblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
    dblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
    smap = RegionMap([src.data_ptr()], [src.data_ptr() + cache], [0], dev)
    dmap = RegionMap([dst.data_ptr()], [dst.data_ptr() + cache], [0], dev)
    return Case(ext, count, src, dst, sblk, dblk, smap, dmap)


def kernel_variant(edit: Any, name: str) -> Any:
    """A copy of kvlink_transports._gpukernels with its source passed through ``edit``, loaded
    as module ``name`` (Triton compiles from source files, so the copy is written to disk)."""
    import importlib.util
    import inspect
    import tempfile

    from kvlink_transports import _gpukernels

    src = edit(inspect.getsource(_gpukernels))
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def no_cache_hints(src: str) -> str:
    """Kernel source without its streaming cache hints."""
    out = re.sub(r',\s*cache_modifier="\.c[gs]"', "", src)
    assert "cache_modifier" not in out, "kernel changed: update the probe"
    return out


def write(out_dir: str, name: str, res: dict[str, Any]) -> str:
    """Write ``res`` to ``out_dir/name`` the way every benchmark result is written (command,
    machine, date: bench/_common.write_result), the machine with its GPU stack."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from _common import machine, write_result

    gpu: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        gpu["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        gpu["triton"] = triton.__version__
    except ImportError:
        pass
    path = os.path.join(out_dir, name)
    write_result(name.removesuffix(".json"), {**res, "machine": {**machine(), **gpu}}, path)
    return path
