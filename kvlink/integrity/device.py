"""Digests of GPU memory: every plane in one launch of :mod:`kvlink.integrity.kernel`, or
torch ops per plane where it cannot run; the consumer's compare of what landed, in one kernel.
Only digests (or the first index that differs) come back to the host."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.integrity.weights import U64, Planes, per_planes, weights, word_bytes


class CudaBytes:
    """A device pointer as ``__cuda_array_interface__`` (torch wraps it without a copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


_TABLES: dict[int, tuple[Planes, Any]] = {}  # id(planes) -> (planes, kernel.Table)


def cuda_digest(planes: Planes, ids: npt.NDArray[np.int64], h0: int, h1: int) -> U64 | None:
    """Every plane in one kernel launch (kvlink.integrity.kernel); None: use the torch path.
    The planes' table is built once per planes object (a worker's, fixed at register)."""
    import torch

    table = device_table(planes)
    out = table.digest(torch.from_numpy(ids).to(table.device), h0, h1)
    if out is None:
        return None
    host = np.asarray(out.cpu().numpy()).view(np.uint64)
    return host.reshape(ids.shape[0], len(planes), len(planes[0]), h1 - h0)


def on_gpu(planes: Planes) -> bool:
    """Whether ``planes`` are views of GPU memory (digested there)."""
    first = planes[0][0]
    return not isinstance(first, np.ndarray) and first.device.type == "cuda"


def upload(ids: npt.NDArray[np.int64], device: Any) -> Any:
    """``ids`` on ``device``, enqueued on the current stream from pinned memory: from pageable
    memory the driver may wait for the stream first, and a layer-wise prefill's forward loop
    with it. There for that stream's later work only."""
    import torch

    return torch.from_numpy(ids).pin_memory().to(device, non_blocking=True)


def checked_on_gpu(planes: Planes, ids: npt.NDArray[np.int64], h0: int, theirs: U64,
                   plane_major: bool = False
                   ) -> tuple[bool, tuple[int, int, int, int] | None]:
    """What landed in blocks ``ids`` (heads from ``h0``) compared with ``theirs`` (``[blocks,
    layers, planes, heads]``; with ``plane_major`` ``[layers x planes, blocks, heads]``, a
    landing board's order) on the GPU, in one kernel (kernel.Table.check): (True,
    the first (block, layer, plane, head) that differs or None); (False, None) where the
    planes are not on a GPU or the kernel cannot run (the caller digests and compares)."""
    if not ids.size or not on_gpu(planes):
        return False, None
    per = len(planes[0])
    if plane_major:
        layers, heads = theirs.shape[0] // per, theirs.shape[2]
        got = device_table(planes).check(ids, h0, theirs, plane_major=True)
    else:
        k, layers, per, heads = theirs.shape
        flat = np.ascontiguousarray(theirs).reshape(k, -1, heads)
        got = device_table(planes).check(ids, h0, flat)
    if got is None:
        return False, None
    if got < 0:
        return True, None
    b, rest = divmod(got, layers * per * heads)
    plane, head = divmod(rest, heads)
    return True, (b, plane // per, plane % per, head)


def device_table(planes: Planes) -> Any:
    """The planes' kernel.Table, built once per planes object (a worker's, fixed at
    register)."""
    from kvlink.integrity import kernel

    return per_planes(_TABLES, planes, lambda p: kernel.Table([v for row in p for v in row]))


def torch_plane(pages: Any, ids: npt.NDArray[np.int64], h0: int, h1: int) -> U64:
    """``[blocks, heads]`` digests of one torch plane's blocks ``ids`` (on its device, the
    digests copied back): the path where the kernel cannot run, and for torch's host tensors."""
    import torch

    hb = int(pages.shape[3])
    word = word_bytes(hb)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    dev = pages.device
    x = pages.index_select(0, torch.as_tensor(ids, device=dev))[:, h0:h1].contiguous()
    x = x.view(dtype).to(torch.int64)
    if word < 8:  # unsigned words: undo the sign extension of the narrower view
        x &= (1 << (8 * word)) - 1
    w = torch.from_numpy(weights(int(pages.shape[2]), hb // word).view(np.int64).copy()).to(dev)
    # int64 products and sums wrap modulo 2**64 like the numpy path's uint64
    out: Any = (x * w).sum(dim=(2, 3))
    return np.asarray(out.cpu().numpy()).view(np.uint64)
