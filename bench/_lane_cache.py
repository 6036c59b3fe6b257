"""A vLLM-shaped cache's pieces for the lane probes (bench/gpu_lane_probe.py,
bench/gpu_lane_shapes.py): a tensor per layer, K and V planes of whole blocks, one registered
region per layer, and a request's block ids as a router hands them over."""

from __future__ import annotations

from typing import Any

import numpy as np


def shuffled_ids(rng: np.random.Generator, n: int, offset: int = 40) -> tuple[Any, Any]:
    """(source ids: contiguous from 3, destination ids: shuffled runs of 1-8 from ``offset``),
    int64: bench/e2e_request.py's prefill and decode ids."""
    cuts = np.cumsum(rng.integers(1, 9, size=n))
    pieces = np.split(np.arange(n), cuts[cuts < n])
    dst = np.concatenate([pieces[k] for k in rng.permutation(len(pieces))]) + offset
    return (np.arange(n) + 3).astype(np.int64), dst.astype(np.int64)


def region_map(layers: list[Any], dev: Any) -> Any:
    """A region per layer's tensor (bf16), as a worker registers vLLM's cache."""
    from kvlink.gpu.copy import RegionMap

    starts = [x.data_ptr() for x in layers]
    return RegionMap(starts, [s + x.numel() * 2 for s, x in zip(starts, layers)],
                     [0] * len(layers), dev)


def plane_bases(layers: list[Any], blocks: int, unit: int) -> Any:
    """Each (layer, K|V) plane's first block: a lane's segment bases."""
    return np.array([x.data_ptr() + p * blocks * unit for x in layers for p in (0, 1)],
                    dtype=np.uint64)
