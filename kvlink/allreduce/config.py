"""All-reduce tuning knobs and the one-shot/two-shot switch.

The switch point decides, per call, whether every rank reads every peer's whole buffer (one-shot:
one barrier round less, ``world`` times the reads) or the buffer is reduce-scattered and then
all-gathered (two-shot: ``2 * (world - 1) / world`` of the traffic, one extra barrier). Where the
curves cross depends on the interconnect and the world size, so the defaults below are *placeholders
to be measured*; ``bench/allreduce.py`` (GPU) and ``bench/allreduce_cpu.py`` (CPU) print the sizes
where two-shot starts to win, and the tables here are the one place to update.

Every rank must take the same decision for the same call (they run matching halves of one
protocol), so the decision is a pure function of ``(nbytes, world, config)``: never of timing, of a
rank's own pointer, or of anything else that may differ between ranks.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Literal

from kvlink.errors import AllReduceError

Mode = Literal["one_shot", "two_shot"]
ModeArg = Literal["auto", "one_shot", "two_shot"]

KiB = 1024
MiB = 1024 * KiB

# ------------------------------------------------------------------------------------------------
# DEFAULT SWITCH POINTS: TO BE MEASURED ON MULTI-GPU (issue 9).
# Largest message (bytes, inclusive) that still runs one-shot, by world size. Larger messages run
# two-shot. World 2 is MEASURED (2x H200, NV18, bf16, CUDA graphs: one-shot was faster than
# two-shot at every size up to the 8 MiB buffer, see docs/allreduce.md). Worlds 3..8 are
# PLACEHOLDERS shaped like the usual NVLink curve (one-shot's read amplification grows with the
# world size); measure them with
#   torchrun --nproc-per-node N bench/allreduce.py        (or: python3 bench/allreduce.py --nproc N)
# which writes bench/results/allreduce_<N>gpu.json with "suggested_one_shot_max_bytes", and update
# this table. Override per process with KVLINK_AR_ONE_SHOT_MAX_BYTES=<bytes>.
DEFAULT_GPU_ONE_SHOT_MAX_BYTES: Mapping[int, int] = {
    2: 8 * MiB,  # measured
    3: 512 * KiB,  # placeholder
    4: 512 * KiB,  # placeholder
    5: 256 * KiB,  # placeholder
    6: 256 * KiB,  # placeholder
    7: 256 * KiB,  # placeholder
    8: 256 * KiB,  # placeholder
}
# CPU shared-memory variant: chosen from bench/allreduce_cpu.py runs on a shared (noisy) 2-core x86
# VM (bf16; bench/results/allreduce_cpu.json). Two-shot halves each rank's bf16<->fp32 conversion
# work and won from a few tens of KiB on in most runs; one-shot saves the gather copy at small
# sizes. Re-measure on the target host ("suggested_cpu_one_shot_max_bytes" in the JSON).
DEFAULT_CPU_ONE_SHOT_MAX_BYTES: Mapping[int, int] = {
    2: 64 * KiB,
    3: 16 * KiB,
    4: 16 * KiB,
}
# Above the largest world size listed, the value for the largest listed world size applies.
# ------------------------------------------------------------------------------------------------

ENV_ONE_SHOT_MAX_BYTES = "KVLINK_AR_ONE_SHOT_MAX_BYTES"


def _lookup(table: Mapping[int, int], world: int) -> int:
    """Value for ``world`` in a switch table, falling back to the nearest smaller listed world."""
    if world in table:
        return table[world]
    smaller = [w for w in table if w <= world]
    return table[max(smaller)] if smaller else table[min(table)]


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    """Knobs shared by the GPU and CPU all-reduce.

    ``max_bytes`` sizes the registered buffers (per rank: one input slot and one two-shot slot),
    so it caps the message a single custom call handles; bigger messages go to the next backend
    (GPU) or are split into ``max_bytes`` pieces (CPU). ``one_shot_max_bytes`` overrides the
    measured tables above for every world size.
    """

    max_bytes: int = 8 * MiB
    one_shot_max_bytes: int | None = None
    #: GPU: cap on thread blocks per kernel (each block runs its own flag barrier); also capped
    #: at the SM count so all blocks are co-resident. 128 measured best on H200 (36/64/128).
    max_blocks: int = 128
    #: GPU: warps per block; each thread moves 16 bytes per tile.
    num_warps: int = 8
    #: GPU: rows of the CUDA-graph pointer table (captured all-reduce calls with registered input).
    max_graph_slots: int = 4096
    #: CPU: seconds a rank waits at a barrier before naming the missing peer in an error.
    timeout_s: float = 30.0
    enable_custom: bool = True
    enable_symm_mem: bool = True
    enable_fallback: bool = True

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_bytes % 16:
            raise AllReduceError(
                f"max_bytes must be a positive multiple of 16, got {self.max_bytes}"
            )
        if not 1 <= self.max_blocks <= FLAG_BLOCKS:
            raise AllReduceError(f"max_blocks must be in [1, {FLAG_BLOCKS}], got {self.max_blocks}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise AllReduceError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if not 0 < self.timeout_s < math.inf:  # (NaN too: a wait past NaN never ends)
            raise AllReduceError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.one_shot_max_bytes is not None and self.one_shot_max_bytes < 0:
            raise AllReduceError(f"one_shot_max_bytes must be >= 0 (or None: the measured "
                                 f"tables), got {self.one_shot_max_bytes}")


#: GPU flag arrays have one row per thread block; the kernels never launch more blocks than this.
FLAG_BLOCKS = 128
#: Largest world size the GPU kernels are written for (flag rows are MAX_WORLD wide).
MAX_WORLD = 8


def one_shot_limit(world: int, config: AllReduceConfig, *, cpu: bool) -> int:
    """Largest one-shot message in bytes for ``world`` ranks (config, then env, then the table)."""
    if config.one_shot_max_bytes is not None:
        return config.one_shot_max_bytes
    env = os.environ.get(ENV_ONE_SHOT_MAX_BYTES)
    if env:
        try:
            return int(env)
        except ValueError as exc:
            raise AllReduceError(f"{ENV_ONE_SHOT_MAX_BYTES}={env!r} is not an integer") from exc
    return _lookup(DEFAULT_CPU_ONE_SHOT_MAX_BYTES if cpu else DEFAULT_GPU_ONE_SHOT_MAX_BYTES, world)


def choose_mode(
    nbytes: int, world: int, config: AllReduceConfig, mode: ModeArg, *, cpu: bool
) -> Mode:
    """Resolve ``mode`` ("auto" -> by size); identical on every rank for the same call."""
    if mode == "one_shot" or mode == "two_shot":
        return mode
    if mode != "auto":
        raise AllReduceError(f"mode must be 'auto', 'one_shot' or 'two_shot', got {mode!r}")
    return "one_shot" if nbytes <= one_shot_limit(world, config, cpu=cpu) else "two_shot"
