"""The copy kernels' region maps (kvlink.gpu.copy.RegionMap): sorted and marked for a search
only where that gives the scan's answer. The CUDA C search itself runs on a GPU
(scripts/gpu_fused_digest_check.py: copies through 80 searched regions verified, a run
crossing a region's end refused); here, what the host hands it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvlink.gpu.copy import RegionMap  # noqa: E402


def _table(m: RegionMap) -> np.ndarray:
    return m.tensor.numpy().reshape(3, m.count)


def test_disjoint_regions_are_sorted_and_searched() -> None:
    m = RegionMap([300, 100, 200], [350, 150, 260], [3, 1, 2], "cpu")
    assert m.count == 3 and m.kernel_count == -3  # the kernels binary-search it
    assert _table(m).tolist() == [[100, 200, 300], [150, 260, 350], [1, 2, 3]]  # rows kept


def test_overlapping_regions_keep_their_order_and_are_scanned() -> None:
    # overlapping regions: the first that holds an extent wins, as it always did
    m = RegionMap([300, 100, 120], [350, 150, 160], [3, 1, 2], "cpu")
    assert m.kernel_count == 3
    assert _table(m).tolist() == [[300, 100, 120], [350, 150, 160], [3, 1, 2]]


def test_search_can_be_turned_off_and_one_region_is_scanned() -> None:
    assert RegionMap([300, 100], [350, 150], [0, 0], "cpu", search=False).kernel_count == 2
    assert RegionMap([0], [1 << 62], [0], "cpu").kernel_count == 1
