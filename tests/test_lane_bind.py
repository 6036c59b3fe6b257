"""A lane's binding (kvlink.gpu.lane.Lane): the segments' bases translated through the region
maps once, so the kernel looks no region up per unit — and where that cannot be done, the
maps passed as before. The host side only: the launches go to a stand-in of the driver's
launch buffers (kvlink.gpu.move.TableLaunch needs NVRTC and a GPU). The kernel's side runs
on a GPU: scripts/gpu_runs_check.py (a translated lane and an untranslatable one refused,
byte for byte) and bench/gpu_lane_probe.py (80 regions a side)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvlink.gpu import move  # noqa: E402
from kvlink.gpu.copy import RegionMap  # noqa: E402
from kvlink.gpu.lane import Lane  # noqa: E402

UNIT, BLOCKS = 4096, 10


class _Launch:
    """Stand-in of move.TableLaunch: its buffers, and the launches it was asked for."""

    groups = 4

    def __init__(self, words: int, nargs: int) -> None:
        self.table = np.zeros(words, dtype=np.uint64)
        self.ids = self.table.view(np.int64)
        self.vals = [0] * (nargs - 1)
        self.launched: list[tuple[list[int], list[int]]] = []

    def launch(self, lib: Any, grid: int, stream: int) -> int:
        self.launched.append((self.table.tolist(), list(self.vals)))
        return 0


class _Move:
    """Stand-in of move.CudaMove's lane side: size classes as the real one, no driver."""

    lib = None
    shape = staticmethod(move.CudaMove.shape)

    def __init__(self) -> None:
        self.made: list[_Launch] = []

    def table_class(self, words: int) -> int:
        return next((c for c in move.PARAM_WORDS if words <= c), 0)

    def table_launch(self, name: str, shape: Any, words: int, nargs: int,
                     ids: bool = False, board: bool = False) -> _Launch:
        self.made.append(_Launch(words, nargs))
        return self.made[-1]


def _layers(first: int, count: int) -> tuple[np.ndarray, RegionMap, int]:
    """``count`` layer regions of two planes of BLOCKS units each, a gap between layers, the
    map translating them by ``delta`` (a peer's pointer -> our mapping): (segment bases, map,
    delta)."""
    size, delta = 2 * BLOCKS * UNIT, 1 << 40
    starts = [first + k * (size + (1 << 20)) for k in range(count)]
    rmap = RegionMap(starts, [s + size for s in starts], [delta] * count, "cpu")
    bases = np.array([s + p * BLOCKS * UNIT for s in starts for p in (0, 1)], dtype=np.uint64)
    return bases, rmap, delta


def _lane(cuda: _Move, src: np.ndarray, dst: np.ndarray, smap: Any, dmap: Any) -> Lane:
    return Lane(cuda, src, dst, UNIT, (BLOCKS, BLOCKS), (smap, dmap),  # type: ignore[arg-type]
                chunk=64 << 10, min_programs=1, small=1 << 20)


def test_a_lane_translates_its_bases_once_and_passes_no_maps() -> None:
    cuda = _Move()
    src, smap, delta = _layers(1 << 30, 3)
    dst, dmap, _ = _layers(1 << 34, 3)
    lane = _lane(cuda, src, dst, smap, dmap)
    assert lane.translated
    lane.launch(np.array([1, 9], dtype=np.int64), np.array([0, 4], dtype=np.int64), 77, 5, 0)
    table, vals = cuda.made[0].launched[-1]
    assert table[:12] == (src + np.uint64(delta)).tolist() + (dst + np.uint64(delta)).tolist()
    assert table[12:16] == [1, 9, 0, 4]  # the ids after the bases
    assert vals[2:6] == [0, 0, 0, 0]  # null maps: the kernel looks nothing up


@pytest.mark.parametrize("why", ["past_a_region_end", "before_every_region", "overlapping"])
def test_a_lane_whose_blocks_leave_a_region_keeps_the_kernels_lookup(why: str) -> None:
    """A segment whose blocks below the count do not all lie in one region (or regions that
    overlap, where the kernel takes the first that holds each unit): the bases as given and
    both maps, so the kernel refuses what lies outside, unit by unit, as it always did."""
    cuda = _Move()
    src, smap, _ = _layers(1 << 30, 3)
    dst, dmap, _ = _layers(1 << 34, 3)
    if why == "past_a_region_end":
        src = src.copy()
        src[-1] += np.uint64(UNIT)  # its last block would end past the layer's region
    elif why == "before_every_region":
        src = src - np.uint64(1 << 29)
    else:
        s = int(src[0])
        smap = RegionMap([s, s + UNIT], [s + (1 << 30), s + 2 * UNIT], [1, 2], "cpu")
    lane = _lane(cuda, src, dst, smap, dmap)
    assert not lane.translated
    lane.launch(np.array([1], dtype=np.int64), np.array([0], dtype=np.int64), 77, 5, 0)
    table, vals = cuda.made[0].launched[-1]
    assert table[:12] == src.tolist() + dst.tolist()
    assert vals[2:6] == [smap.ptr, smap.kernel_count, dmap.ptr, dmap.kernel_count]


def test_a_rebound_lane_translates_through_the_new_maps() -> None:
    """A peer connected anew maps its memory elsewhere: every launch class already built
    takes the new translation (and a rebind to the same maps changes nothing)."""
    cuda = _Move()
    src, smap, _ = _layers(1 << 30, 3)
    dst, dmap, _ = _layers(1 << 34, 3)
    lane = _lane(cuda, src, dst, smap, dmap)
    assert lane.fits(2) and lane.fits(900)  # two size classes built
    starts = src[::2].astype(np.int64)
    moved = RegionMap(starts, starts + 2 * BLOCKS * UNIT, [7 << 40] * 3, "cpu")
    lane.rebind((moved, dmap))
    for n, launch in ((2, cuda.made[0]), (900, cuda.made[1])):
        ids = np.zeros(n, dtype=np.int64)
        lane.launch(ids, ids, 1, 1, 0)
        assert launch.launched[-1][0][:6] == (src + np.uint64(7 << 40)).tolist()
    lane.rebind((moved, dmap))
    assert lane.translated


def test_region_map_through() -> None:
    m = RegionMap([300, 100, 200], [350, 150, 260], [3, 1, 2], "cpu")
    got = m.through(np.array([100, 210, 300], dtype=np.uint64), 40)
    assert got is not None and got.tolist() == [101, 212, 303]
    assert m.through(np.array([120], dtype=np.uint64), 40) is None  # 160 > 150
    assert m.through(np.array([90], dtype=np.uint64), 5) is None  # before every region
    assert m.through(np.array([100], dtype=np.uint64), 0) is None  # nothing to span
