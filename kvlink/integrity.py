"""End-to-end KV integrity: digests of what a request's blocks *mean*, not of their bytes.

A digest is one 64-bit value per (block, layer, K|V plane, KV head) of a request: a weighted sum,
modulo 2**64, of the head's words in logical order (token-major inside the head, whatever the
page's physical layout). So the producer's digest of a head equals the consumer's digest of the
same head whatever the two sides' TP sizes, layouts (NHD/HND, split/joined/packed planes) and
head slices — a consumer compares only the heads it read, one replica each.

Every weight is odd, hence invertible modulo 2**64: any change confined to one word of a head
always changes its digest, and a word moved to another token or offset does too (each position
has its own weight). Several changes cancel only for a particular linear combination — this is a
check against wrong blocks, wrong layouts, reuse and late writes, not against an adversary
(docs/integrity.md says what it catches and what it cannot).

Levels: ``off``; ``sample`` — the blocks whose (request, remote block id) hash falls in one of
:data:`~kvlink.sampling.SAMPLE_EVERY` buckets, at least one per request, chosen identically on
both sides from what both know (:mod:`kvlink.sampling`); ``full`` — every block. CPU caches
are hashed with numpy, one vectorised pass per plane; CUDA caches with torch on the device
(only the digests are copied back).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import hashlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvlink.errors import ConfigError
from kvlink.layout import KVCacheSpec, Layout
from kvlink.sampling import SAMPLE_EVERY as SAMPLE_EVERY  # (re-exported: docs name it here)
from kvlink.sampling import mix, picked
from kvlink.transport import DigestJob
from kvlink.wire import MAX_DIGEST_BYTES

U64 = npt.NDArray[np.uint64]


class Level(str, enum.Enum):
    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"

    @classmethod
    def parse(cls, value: object, key: str = "integrity") -> Level:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{key} must be one of {[m.value for m in cls]}, got {value!r}"
                              ) from None


def checked(level: Level, salt: str | int, remote_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which positions of a request's (remote) block ids are checked at ``level``.

    Deterministic in what both sides know — ``salt``: the hold's generation (a pull: what a
    reader's READ is told, so a cuda_ipc READ's launcher picks the same blocks from what it
    launches with, kvlink.gpu.lane.sample_order) or the request id (a push without a hold) — and
    the block ids, so the producer digests exactly what the consumer will check. ``sample``
    always keeps the last block (every reader reads the request's tail, whatever its own
    prefix hits)."""
    ids = np.asarray(remote_ids, dtype=np.int64)
    if level is Level.OFF or ids.size == 0:
        return np.zeros(ids.shape, dtype=bool)
    if level is Level.FULL:
        return np.ones(ids.shape, dtype=bool)
    return picked(salt if isinstance(salt, int) else _salt(salt), ids)  # (both below 2**64)


Planes = Sequence[Sequence[Any]]  # [layer][plane] -> (blocks, heads, tokens, head bytes) uint8


def digest(planes: Planes, block_ids: npt.ArrayLike,
           heads: tuple[int, int] | None = None) -> U64:
    """``[blocks, layers, planes, heads]`` digests of heads ``[h0, h1)`` (rank-local; default
    all) of ``block_ids``. ``planes`` are logical byte views (:func:`spec_planes`,
    :func:`tensor_planes`): numpy arrays are hashed with numpy, torch tensors with torch on
    their device (only the digests are copied back)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    first = planes[0][0]
    h0, h1 = heads if heads is not None else (0, int(first.shape[1]))
    out = np.empty((ids.shape[0], len(planes), len(planes[0]), h1 - h0), dtype=np.uint64)
    if ids.shape[0] == 0 or h1 <= h0:
        return out
    if on_gpu(planes):
        fused = _cuda_digest(planes, ids, h0, h1)
        if fused is not None:
            out[...] = fused
            return out
    elif isinstance(first, np.ndarray) and _native_digest(planes, ids, h0, h1, out):
        return out  # (torch's host tensors, a vLLM CPU cache's, take torch's path below)
    hashing = _numpy_plane if isinstance(first, np.ndarray) else _torch_plane
    for layer, per_layer in enumerate(planes):
        for kv, view in enumerate(per_layer):
            out[:, layer, kv] = hashing(view, ids, h0, h1)
    return out


def spec_planes(spec: KVCacheSpec) -> Planes:
    """Logical views of this process's memory as ``spec`` describes it. A digest over them
    checks the bytes kvlink moved against that description; :func:`tensor_planes` (the
    framework's own tensors) also catches a description that is wrong."""
    sh, st = _strides(spec)
    shape = (spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_bytes)
    cuda = spec.device.startswith("cuda")
    out: list[list[Any]] = []
    for layer in range(spec.num_layers):
        row: list[Any] = []
        for kv in range(spec.num_kv):
            base, stride, span = _plane_geometry(spec, layer, kv)
            if cuda:
                import torch

                dev = torch.as_tensor(_Cuda(base, span), device=torch.device(spec.device))
                row.append(torch.as_strided(dev, shape, (stride, sh, st, 1)))
            else:
                host = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base))
                row.append(np.lib.stride_tricks.as_strided(host, shape, (stride, sh, st, 1),
                                                           writeable=False))
        out.append(row)
    return out


def tensor_planes(layers: Sequence[Sequence[Any]]) -> Planes:
    """Logical byte views of a framework's own ``[layer][plane] (blocks, heads, tokens, dim)``
    tensors (any strides; torch or numpy): the content the model reads, independent of how
    kvlink described the memory."""
    out: list[list[Any]] = []
    for per_layer in layers:
        row: list[Any] = []
        for t in per_layer:
            if isinstance(t, np.ndarray):
                row.append(_bytes_np(t))
            else:
                row.append(_bytes_torch(t))
        out.append(row)
    return out


def first_mismatch(want: U64, got: U64) -> tuple[int, int, int, int] | None:
    """(block position, layer, plane, head) of the first differing digest, or None."""
    if want.shape != got.shape:
        raise ValueError(f"digest shapes differ: {want.shape} vs {got.shape}")
    if np.array_equal(want, got):
        return None
    bad = np.argwhere(want != got)
    if not bad.size:
        return None
    b, layer, kv, head = (int(x) for x in bad[0])
    return b, layer, kv, head


# ---------------------------------------------------------------------------- internals
def _salt(req_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")


def _word(head_bytes: int) -> int:
    return next(w for w in (8, 4, 2, 1) if head_bytes % w == 0)


@functools.lru_cache(maxsize=64)
def _weights(tokens: int, words: int) -> U64:
    """Odd weights, one per (token, word) of a head: fixed, so both sides agree."""
    with np.errstate(over="ignore"):
        seq = np.arange(1, tokens * words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        w = mix(seq) | np.uint64(1)
    w.setflags(write=False)
    return w.reshape(tokens, words)


def _strides(spec: KVCacheSpec) -> tuple[int, int]:
    """(head stride, token stride) in bytes inside one page."""
    hb, n, h = spec.head_bytes, spec.block_size, spec.num_kv_heads
    if spec.layout is Layout.HND or h == 1:
        return n * hb, hb
    return hb, h * hb


def _plane_geometry(spec: KVCacheSpec, layer: int, kv: int) -> tuple[int, int, int]:
    base = int(spec.plane_base[layer, kv])
    stride = int(spec.block_stride[layer, kv])
    span = (spec.num_blocks - 1) * stride + spec.page_bytes
    return base, stride, span


def _bytes_np(t: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """(B, H, N, D) of any dtype -> (B, H, N, D·itemsize) uint8: a view when D is dense."""
    if t.strides[-1] != t.itemsize and t.shape[-1] > 1:
        t = np.ascontiguousarray(t)
    return t.view(np.uint8)


def _bytes_torch(t: Any) -> Any:
    import torch

    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t.view(torch.uint8)


def _as_words(pages: npt.NDArray[np.uint8], word: int) -> npt.NDArray[Any] | None:
    """The same memory as ``(B, H, N, hb / word)`` unsigned words, where it is aligned."""
    ptr = int(pages.__array_interface__["data"][0])
    strides = pages.strides
    if (ptr | strides[0] | strides[1] | strides[2]) % word or strides[3] != 1:
        return None
    span = sum((n - 1) * st for n, st in zip(pages.shape[:3], strides[:3])) + pages.shape[3]
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(ptr)).view(f"<u{word}")
    return np.lib.stride_tricks.as_strided(
        raw, (*pages.shape[:3], pages.shape[3] // word), (*strides[:3], word), writeable=False)


class _Rows(NamedTuple):
    """How a host plane's blocks are read (:func:`_plane_rows`): worked out once per plane."""

    word: int  # bytes per word
    words: npt.NDArray[Any] | None  # (B, H, N, W) unsigned words; None: unaligned
    rows: npt.NDArray[Any] | None  # (B, H·N·W) whole rows of a dense page (HND or NHD)
    hnd: bool  # the rows' order: heads outermost (else tokens)


#: id(plane) -> (a weak reference to it, how it is read): the views in it are made from the
#: plane's address and keep nothing alive; a plane gone is a miss (its id may be reused)
_ROWS: dict[int, tuple[weakref.ref[npt.NDArray[Any]], _Rows]] = {}


def _plane_rows(pages: npt.NDArray[np.uint8]) -> _Rows:
    """How ``pages`` is read, kept per plane (a worker's planes are fixed at register): its
    views cost more to make than a small request's gather of the plane, and a 70B rank has
    160 planes to make them for at every check."""
    got = _ROWS.get(id(pages))
    if got is not None and got[0]() is pages:
        return got[1]
    word = _word(int(pages.shape[3]))
    words = _as_words(pages, word)
    rows, hnd = None, False
    if words is not None:
        b, h, n, w = words.shape
        sb, sh, sn, _ = words.strides
        hnd = sh == n * w * word and sn == w * word
        nhd = sn == h * w * word and sh == w * word
        if hnd or nhd:
            rows = np.lib.stride_tricks.as_strided(words, (b, h * n * w), (sb, word),
                                                   writeable=False)
    how = _Rows(word, words, rows, hnd)
    if len(_ROWS) > 4096:
        _ROWS.clear()
    _ROWS[id(pages)] = (weakref.ref(pages), how)
    return how


def _gather(how: _Rows, ids: npt.NDArray[np.int64], h0: int, h1: int) -> npt.NDArray[Any]:
    """``words[ids, h0:h1]`` as (n, heads, N, W), fast: a dense page (HND or NHD) is gathered
    as whole rows (one contiguous copy per block) and re-viewed in logical order, instead of
    an element-wise copy through four strides (10x slower on a 16 MiB plane)."""
    assert how.words is not None
    if how.rows is None:
        return np.ascontiguousarray(how.words[ids, h0:h1])
    _, h, n, w = how.words.shape
    taken = how.rows[ids]
    if how.hnd:
        return taken.reshape(-1, h, n, w)[:, h0:h1]
    return taken.reshape(-1, n, h, w).transpose(0, 2, 1, 3)[:, h0:h1]


def _numpy_plane(pages: npt.NDArray[np.uint8], ids: npt.NDArray[np.int64], h0: int,
                 h1: int) -> U64:
    hb = int(pages.shape[3])
    how = _plane_rows(pages)
    word = how.word
    if how.words is not None:
        x = _gather(how, ids, h0, h1)
    else:
        x = np.ascontiguousarray(pages[ids, h0:h1]).view(f"<u{word}")
    if word != 8:
        x = x.astype(np.uint64)
    w = _weights(int(pages.shape[2]), hb // word)
    # one pass, no temporary (5x the multiply-then-sum); uint64 arithmetic wraps mod 2**64
    return np.asarray(np.einsum("bhtw,tw->bh", x, w), dtype=np.uint64)


_UNSET: Any = object()
_c_helpers: Any = _UNSET  # kvlink.native's module, once looked up (None: not built)
#: id(planes) -> (planes, their C table or None: kvlink.native's digest cannot read them)
_HOST_TABLES: dict[int, tuple[Planes, Any]] = {}


def _native_digest(planes: Planes, ids: npt.NDArray[np.int64], h0: int, h1: int,
                   out: U64) -> bool:
    """:func:`digest` of host planes into ``out`` in one C call (kvlink.native's
    ``digest``: every plane, each word read once in place, without the GIL), where kvlink's
    C helpers build and every plane is whole aligned 8-byte words (a head of 2^k x 8 bytes,
    as every KV head is); False: numpy's path. Ids outside a plane raise IndexError, as
    numpy's indexing does."""
    global _c_helpers
    if _c_helpers is _UNSET:
        from kvlink import native

        _c_helpers = native.load()
    if _c_helpers is None:
        return False
    got = _per_planes(_HOST_TABLES, planes, _host_table)
    if got is None:
        return False
    table, blocks = got
    first = planes[0][0]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= blocks):
        raise IndexError(f"block ids outside [0, {blocks}): {ids.min()}..{ids.max()}")
    if not 0 <= h0 < h1 <= int(first.shape[1]):
        raise IndexError(f"heads [{h0}, {h1}) outside [0, {first.shape[1]})")
    tokens, words = int(first.shape[2]), int(first.shape[3]) // 8
    _c_helpers.digest(table, np.ascontiguousarray(ids, dtype=np.int64),
                      _weights(tokens, words), out, h0, tokens, words)
    return True


def _host_table(planes: Planes) -> tuple[npt.NDArray[np.int64], int] | None:
    """(address, block stride, head stride, token stride) per plane, and the fewest blocks
    a plane holds — for kvlink.native's ``digest`` —, or None where a plane is not whole
    aligned 8-byte words of one shape (numpy's path takes those)."""
    rows, shape = [], tuple(planes[0][0].shape[1:])
    for view in (v for row in planes for v in row):
        how = _plane_rows(view)
        if how.word != 8 or how.words is None or tuple(view.shape[1:]) != shape:
            return None
        rows.append((int(view.__array_interface__["data"][0]), *view.strides[:3]))
    blocks = min(int(v.shape[0]) for row in planes for v in row)
    return np.array(rows, dtype=np.int64), blocks


class _Cuda:
    """A device pointer as ``__cuda_array_interface__`` (torch wraps it without a copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


_TABLES: dict[int, tuple[Planes, Any]] = {}  # id(planes) -> (planes, integrity_cuda.Table)


def _cuda_digest(planes: Planes, ids: npt.NDArray[np.int64], h0: int, h1: int) -> U64 | None:
    """Every plane in one kernel launch (kvlink.integrity_cuda); None: use the torch path.
    The planes' table is built once per planes object (a worker's, fixed at register)."""
    import torch

    table = _table(planes)
    out = table.digest(torch.from_numpy(ids).to(table.device), h0, h1)
    if out is None:
        return None
    host = np.asarray(out.cpu().numpy()).view(np.uint64)
    return host.reshape(ids.shape[0], len(planes), len(planes[0]), h1 - h0)


class Later:
    """Digests taken now and read later (:func:`digest_later`): on a GPU, their copy to the
    host's page-locked memory, enqueued on the caller's stream behind the kernel, and an event
    after it; on the host, the values themselves. ``plane_major``: the values are kept
    ``[layers x planes, blocks, heads]`` (a landing board's digest area)."""

    __slots__ = ("_event", "_plane_major", "_shape", "_values")

    def __init__(self, values: Any, shape: tuple[int, ...], event: Any = None,
                 plane_major: bool = False) -> None:
        self._values, self._shape, self._event = values, shape, event
        self._plane_major = plane_major

    def result(self) -> U64:
        """The ``[blocks, layers, planes, heads]`` digests, once landed (a GPU's: waiting for
        its copy, where the stream has not reached it yet)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._values = np.asarray(self._values.numpy()).view(np.uint64)
        got = np.asarray(self._values)
        if self._plane_major:
            k, layers, planes, heads = self._shape
            got = got.reshape(layers, planes, k, heads).transpose(2, 0, 1, 3)
        return got.reshape(self._shape)


def on_gpu(planes: Planes) -> bool:
    """Whether ``planes`` are views of GPU memory (digested there)."""
    first = planes[0][0]
    return not isinstance(first, np.ndarray) and first.device.type == "cuda"


def digest_later(planes: Planes, block_ids: npt.NDArray[np.int64], layers: tuple[int, int],
                 on_device: Any = None, into: U64 | None = None) -> Later:
    """:func:`digest` of layers ``[start, stop)`` of ``block_ids`` (every head), taken now and
    read by :meth:`Later.result`. GPU planes: one kernel on the caller's current stream —
    after the work that wrote those layers — and its digests' copy to page-locked host
    memory, with no wait on the host (a layer-wise push takes a range's digests as the
    forward goes on); ``on_device``: the ids already there (a push's, uploaded once for all
    its ranges). Host planes: computed now. ``into``: where they go, ``[(stop - start) x
    planes, blocks, heads]`` words (plane by plane: a landing board's digest area,
    kvlink.landing) — page-locked memory for GPU planes — instead of memory of their own."""
    ids = np.asarray(block_ids, dtype=np.int64)
    start, stop = layers
    first = planes[0][0]
    per = len(planes[0])
    shape = (ids.shape[0], stop - start, per, int(first.shape[1]))
    if on_gpu(planes) and ids.size:
        import torch

        table = _table(planes)
        dev = on_device if on_device is not None else _upload(ids, table.device)
        out = table.digest(dev, 0, shape[3], (start * per, stop * per), into is not None)
        if out is not None:
            host = (torch.empty(out.shape, dtype=out.dtype, pin_memory=True) if into is None
                    else torch.from_numpy(into.view(np.int64)))
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return Later(host, shape, event, into is not None)
    d = digest(planes[start:stop], ids)
    if into is not None:
        _into_plane_major(into, d)
    return Later(d, shape)


def _into_plane_major(place: U64, d: U64) -> None:
    """``[k, layers, planes, heads]`` digests into ``place``, a landing board's digest area
    (``[layers x planes, k, heads]``: kvlink.landing)."""
    place[...] = d.transpose(1, 2, 0, 3).reshape(place.shape)


def _upload(ids: npt.NDArray[np.int64], device: Any) -> Any:
    """``ids`` on ``device``, enqueued on the current stream from pinned memory: from pageable
    memory the driver may wait for the stream first, and a layer-wise prefill's forward loop
    with it. There for that stream's later work only."""
    import torch

    return torch.from_numpy(ids).pin_memory().to(device, non_blocking=True)


_SIDE: dict[Any, Any] = {}  # device -> the stream a check of landed bytes digests on


def _landed(planes: Planes, ids: npt.NDArray[np.int64], heads: tuple[int, int]) -> U64:
    """:func:`digest` of bytes that have landed here. On a GPU, on a stream of our own: the
    transport's completion was seen on the host, so the bytes are in memory, and whatever the
    caller queued on its own stream (a forward in flight) is not waited for — the producer's
    digests stay on the caller's stream, behind the forward that wrote the KV."""
    if not on_gpu(planes):
        return digest(planes, ids, heads)
    import torch

    device = planes[0][0].device
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        return digest(planes, ids, heads)


def _checked_on_gpu(planes: Planes, ids: npt.NDArray[np.int64], h0: int, theirs: U64,
                    plane_major: bool = False
                    ) -> tuple[bool, tuple[int, int, int, int] | None]:
    """What landed in blocks ``ids`` (heads from ``h0``) compared with ``theirs`` (``[blocks,
    layers, planes, heads]``; with ``plane_major`` ``[layers x planes, blocks, heads]``, a
    landing board's order) on the GPU, in one kernel (integrity_cuda.Table.check): (True,
    the first (block, layer, plane, head) that differs or None); (False, None) where the
    planes are not on a GPU or the kernel cannot run (the caller digests and compares)."""
    if not ids.size or not on_gpu(planes):
        return False, None
    per = len(planes[0])
    if plane_major:
        layers, heads = theirs.shape[0] // per, theirs.shape[2]
        got = _table(planes).check(ids, h0, theirs, plane_major=True)
    else:
        k, layers, per, heads = theirs.shape
        got = _table(planes).check(ids, h0, np.ascontiguousarray(theirs).reshape(k, -1, heads))
    if got is None:
        return False, None
    if got < 0:
        return True, None
    b, rest = divmod(got, layers * per * heads)
    plane, head = divmod(rest, heads)
    return True, (b, plane // per, plane % per, head)


def _table(planes: Planes) -> Any:
    """The planes' integrity_cuda.Table, built once per planes object (a worker's, fixed at
    register)."""
    from kvlink import integrity_cuda

    return _per_planes(_TABLES, planes,
                       lambda p: integrity_cuda.Table([v for row in p for v in row]))


def _per_planes(cache: dict[int, tuple[Planes, Any]], planes: Planes,
                build: Callable[[Planes], Any]) -> Any:
    """``build(planes)``, made once per planes object (a worker's, fixed at register) and
    kept in ``cache`` by its id, with the planes themselves (an id reused by other planes is
    built anew); the last 64 kept."""
    got = cache.get(id(planes))
    if got is None or got[0] is not planes:
        if len(cache) > 64:
            cache.clear()
        got = cache[id(planes)] = (planes, build(planes))
    return got[1]


def _torch_plane(pages: Any, ids: npt.NDArray[np.int64], h0: int, h1: int) -> U64:
    import torch

    hb = int(pages.shape[3])
    word = _word(hb)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    dev = pages.device
    x = pages.index_select(0, torch.as_tensor(ids, device=dev))[:, h0:h1].contiguous()
    x = x.view(dtype).to(torch.int64)
    if word < 8:  # unsigned words: undo the sign extension of the narrower view
        x &= (1 << (8 * word)) - 1
    w = torch.from_numpy(_weights(int(pages.shape[2]), hb // word).view(np.int64).copy()).to(dev)
    # int64 products and sums wrap modulo 2**64 like the numpy path's uint64
    out: Any = (x * w).sum(dim=(2, 3))
    return np.asarray(out.cpu().numpy()).view(np.uint64)


# ---------------------------------------------------------------------------- the two sides
HeadSlice = tuple[int, int, int]  # (local first head, remote first head, count)


def fold(d: U64) -> U64:
    """``[k, L, P, H]`` -> ``[k, 1, 1, H]``: a weighted sum over (layer, plane) with odd
    weights, so a change in one layer still changes the fold (a verdict too large otherwise)."""
    k, layers, planes, heads = d.shape
    w = _weights(layers, planes).reshape(1, layers, planes, 1)
    with np.errstate(over="ignore"):
        return np.asarray((d * w).sum(axis=(1, 2), dtype=np.uint64)).reshape(k, 1, 1, heads)


#: (block ids, little-endian u64 digests, folded): lists and bytes off the wire, views of
#: the hold board's copy (:func:`unpack`)
Digests = tuple[Sequence[int] | npt.NDArray[np.int64], bytes | memoryview, bool]
WireDigests = tuple[list[int], bytes, bool]  # what a verdict or a push's note carries
#: a landing board's digest area, opened for a push's digests (kvlink.landing.DigestArea.open
#: with the push's tag): (the decode's block ids, (layers, planes, heads)) -> where they go,
#: ``[layers x planes, k, heads]`` words, or None where they do not fit
AreaOpener = Callable[[npt.NDArray[np.int64], tuple[int, ...]], "U64 | None"]


_BOARD_HEAD = 4  # words: digests, folded, positions, words per digest row


def pack(got: WireDigests, rows: npt.NDArray[np.int64]) -> bytes:
    """``got`` as one blob for the hold board's arena (kvlink.holdboard), little-endian
    64-bit words: (digests k, folded, positions n, words per row), then per held position the
    row of its digest (-1: not digested), the k block ids, the k rows of digests. The rows
    let a reader's copy kernel compare in place (:func:`board_rows`)."""
    ids, blob, folded = got
    per = len(blob) // 8 // max(len(ids), 1)
    head = np.array([len(ids), int(folded), rows.shape[0], per], dtype="<u8").tobytes()
    return (head + np.asarray(rows, dtype="<i8").tobytes()
            + np.asarray(ids, dtype="<i8").tobytes() + blob)


def unpack(raw: bytes) -> Digests | None:
    """:func:`pack`'s (block ids, digests, folded), as views of ``raw`` (no copy); None for a
    blob that is not one (the caller then asks)."""
    if len(raw) < 8 * _BOARD_HEAD or len(raw) % 8:
        return None
    k, folded, n, _ = (int(x) for x in np.frombuffer(raw, dtype="<u8", count=_BOARD_HEAD))
    at = 8 * (_BOARD_HEAD + n)
    if folded > 1 or at + 8 * k > len(raw):
        return None
    ids = np.frombuffer(raw, dtype="<i8", count=k, offset=at)
    return ids, memoryview(raw)[at + 8 * k:], bool(folded)


@dataclasses.dataclass(slots=True)
class BoardRows:
    """Where a hold's digests lie on its producer's hold board, for a reader's copy kernel
    to compare with what it lands in place (kvlink.transport.DigestJob): host addresses, in
    the reader's mapping ``region``, of the row per held position and of the digest rows."""

    blocks: int  # held positions
    count: int  # digest rows
    folded: bool
    row_words: int
    rows: npt.NDArray[np.int64]  # [blocks] each held position's digest row (-1: none), copied
    address: int  # host address of digest row 0
    region: tuple[int, int]  # the board mapping: (host address, bytes)


def board_rows(view: Any, generation: int, fp: int | None = None) -> BoardRows | None:
    """The digest rows ``generation``'s hold published on ``view`` (a holdboard.BoardView),
    located without copying them (the row per held position is copied: it travels with the
    copy kernel's launch); None where it shows none (``fp``: only over those block ids). What
    was read there counts only if the hold is still shown over the reader's blocks after it:
    the reader's after-check once its READ is done (the pages are given back only after the
    withdrawal, and a generation never comes back)."""
    area = view.digest_area(generation, fp)
    if area is None:
        return None
    at, nbytes = area
    k, folded, n, per = view.words(at, _BOARD_HEAD)
    rows = 8 * _BOARD_HEAD
    start = rows + 8 * (n + k)
    if folded > 1 or start + 8 * k * per > nbytes:
        return None
    # every position digested (``full``): :func:`pack`'s rows are 0..n-1, not read (one step
    # less on each READ's path; rows that said otherwise would only make the compare fail)
    got = _in_order(n) if k == n else view.int64s(at + rows, n)
    return BoardRows(n, k, bool(folded), per, got, view.region[0] + at + start, view.region)


@functools.lru_cache(maxsize=64)
def _in_order(n: int) -> npt.NDArray[np.int64]:
    """0..n-1, read-only: the rows of a hold whose every position is digested."""
    got = np.arange(n, dtype=np.int64)
    got.flags.writeable = False
    return got


def match(remote_ids: npt.ArrayLike, digest_ids: npt.ArrayLike
          ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(positions in ``remote_ids``, positions in ``digest_ids``) of the digested blocks a
    reader read, in digest order: a sort and a search, no Python loop per block."""
    rid = np.asarray(remote_ids, dtype=np.int64)
    did = np.asarray(digest_ids, dtype=np.int64)
    if not rid.size or not did.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if rid.shape == did.shape and np.array_equal(rid, did):  # every block digested (`full`)
        every = np.arange(rid.size, dtype=np.int64)
        return every, every
    order = np.argsort(rid, kind="stable")
    srt = rid[order]
    loc = np.minimum(np.searchsorted(srt, did), srt.size - 1)
    ok = srt[loc] == did
    return order[loc[ok]], np.flatnonzero(ok)


def _wire_form(ids: npt.NDArray[np.int64], d: U64) -> WireDigests:
    folded = d.nbytes > MAX_DIGEST_BYTES
    if folded:
        d = fold(d)
    return ids.tolist(), d.astype("<u8").tobytes(), folded


class RangeDigests:
    """A layer-wise push's digests (:meth:`Checker.for_layers`), taken range by range as the
    prefill writes its layers — each when its range is pushed, on the caller's stream, over
    the KV its WRITE then reads — and sent whole with "written", by the decode's block ids.
    Taken at the end instead, over the prefill's blocks as they are then, they would only
    disagree with what landed where a block changed *after* its range was read (the decode's
    copy still right), and agree where it changed before.

    ``into``: a landing board's digest area (kvlink.landing.DigestArea.open's
    ``[layers x planes, k, heads]``), where each range's go, ahead of its WRITE, so that a
    same-host decode checks what landed once its flag shows every layer, without the note."""

    def __init__(self, planes: Planes, pick: npt.NDArray[np.bool_], src: npt.NDArray[np.int64],
                 dst: npt.NDArray[np.int64]) -> None:
        self._planes, self._src, self.ids = planes, src[pick], dst[pick]
        self._ranges: list[Later] = []  # layers [0, upto), in order
        self.upto = 0
        #: (stream, the ids on the GPU), uploaded at the first range on that stream
        self._on_device: tuple[int, Any] | None = None
        self._into: U64 | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, planes, heads) of every range together: what an area must hold per
        digested block (with the decode's block ids, :attr:`ids`)."""
        first = self._planes[0][0]
        return len(self._planes), len(self._planes[0]), int(first.shape[1])

    def into(self, place: U64) -> None:
        """Put every range's digests in ``place`` (``[layers x planes, k, heads]`` words; for
        GPU planes, page-locked), from the first range on."""
        if self._ranges:
            raise ValueError("a digest area is given before the first range, not after")
        self._into = place

    def take(self, start: int, stop: int) -> None:
        """Layers ``[start, stop)`` are written (enqueued on the caller's stream): digest them.
        Ranges come in order (a layer-wise push's do); raises ValueError for one that does not
        start where the last ended."""
        if start != self.upto:
            raise ValueError(f"layers [{start}, {stop}) do not follow [0, {self.upto})")
        dev = None
        if self._src.size and on_gpu(self._planes):
            import torch

            device = _table(self._planes).device
            stream = torch.cuda.current_stream(device).cuda_stream
            if self._on_device is None or self._on_device[0] != stream:
                self._on_device = (stream, _upload(self._src, device))
            dev = self._on_device[1]
        per = len(self._planes[0])
        into = None if self._into is None else self._into[start * per:stop * per]
        self._ranges.append(digest_later(self._planes, self._src, (start, stop), dev, into))
        self.upto = stop

    def wire(self, layers: int) -> WireDigests:
        """The digests of layers ``[0, layers)`` for the note, once every range is DONE (on
        a GPU each range's copy was enqueued before its WRITE, which waited for it: nothing
        is waited for here). Raises ValueError where the ranges taken stop short of them."""
        if self.upto != layers:
            raise ValueError(f"layers [0, {self.upto}) digested, not [0, {layers})")
        parts = [later.result() for later in self._ranges]
        return _wire_form(self.ids, np.concatenate(parts, axis=1))


class Checker:
    """One worker's integrity state: digests fixed at hold (producer) and the check of what
    landed (consumer). Digests are computed on the caller's thread, like the transfer work."""

    def __init__(self, level: Level) -> None:
        #: whether any level checks (not off), and whether it is ``sample``: plain attributes,
        #: kept by :attr:`level`'s setter, where a property's call is a frame on a READ's
        #: path (its post and the poll that sees it done), cold
        self.on = self.sampling = False
        self.level = level
        self.planes: Planes | None = None  # set at register (spec_planes or tensor_planes)
        self._fixed: dict[str, tuple[int, npt.NDArray[np.int64], U64]] = {}
        self._rows: dict[str, npt.NDArray[np.int64]] = {}  # per held position: digest row
        self.checked_blocks = 0  # consumer: blocks whose digests matched
        self.failures = 0  # consumer: receives failed on a digest mismatch
        self.check_seconds = 0.0  # consumer: time spent checking, since start (benchmarks)
        self.fused_blocks = 0  # consumer: checked blocks the copy kernel digested and compared
        self._geo: tuple[Planes, tuple[int, int, int, int] | None] | None = None

    @property
    def level(self) -> Level:
        """The deployment's setting (it may change at run time: lanes are kept per level)."""
        return self._level

    @level.setter
    def level(self, level: Level) -> None:
        self._level = level
        self.on, self.sampling = level is not Level.OFF, level is Level.SAMPLE

    # ------------------------------------------------------------------ producer
    def fix(self, req_id: str, generation: int, block_ids: npt.ArrayLike) -> None:
        """The request's KV is final (it is being held): digest the blocks a reader will
        check (:func:`checked`)."""
        if not self.on or self.planes is None:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        mask = checked(self.level, generation, ids)
        sel = ids[mask]
        self._fixed[req_id] = (generation, sel, digest(self.planes, sel))
        self._rows[req_id] = np.where(mask, np.cumsum(mask) - 1, -1)

    def drop(self, req_id: str, generation: int) -> None:
        got = self._fixed.get(req_id)
        if got is not None and got[0] == generation:
            del self._fixed[req_id]
            self._rows.pop(req_id, None)

    def for_verdict(self, req_id: str, generation: int) -> WireDigests:
        """(block ids, digests, folded) to send with an "intact" verdict; empty if none."""
        got = self._fixed.get(req_id)
        if got is None or got[0] != generation:
            return [], b"", False
        _, ids, d = got
        return _wire_form(ids, d)

    def for_board(self, req_id: str, generation: int) -> bytes:
        """The digests to publish with the hold on the hold board (:func:`pack`; empty if
        none), so a same-host reader checks what landed without asking for a verdict."""
        got = self.for_verdict(req_id, generation)
        rows = self._rows.get(req_id)
        return pack(got, rows) if got[0] and rows is not None else b""

    def for_push(self, src_ids: npt.ArrayLike, dst_ids: npt.ArrayLike,
                 lease: tuple[str, int] | None, into: AreaOpener | None = None
                 ) -> WireDigests | None:
        """(decode block ids, digests, folded) for a push's "written" note: the digests the
        hold fixed (``lease``: (held request, generation)) of the blocks pushed, named by
        the ids they land in; None where it fixed none (take them as the push's layers are
        pushed: :meth:`for_layers`, the whole push being one range). ``into``: a landing
        board's digest area (its opener: kvlink.landing.DigestArea.open with the push's tag),
        where they go too, unfolded, before the WRITE is posted."""
        got = self._fixed.get(lease[0]) if lease is not None else None
        if not self.on or self.planes is None or got is None or lease is None \
                or got[0] != lease[1]:
            return None
        _, ids, d = got
        pushed, digested = match(src_ids, ids)  # (the held blocks this push writes)
        sel, d = np.asarray(dst_ids, dtype=np.int64)[pushed], d[digested]
        place = into(sel, d.shape[1:]) if into is not None and sel.size else None
        if place is not None:
            _into_plane_major(place, d)
        return _wire_form(sel, d)

    def for_layers(self, req_id: str, src_ids: npt.ArrayLike, dst_ids: npt.ArrayLike
                   ) -> RangeDigests | None:
        """A push's digests, to be taken range by range as its layers are pushed
        (:class:`RangeDigests`; a whole push is one range), of the blocks ``checked`` picks by
        the request id; None with integrity off."""
        if not self.on or self.planes is None:
            return None
        dst = np.asarray(dst_ids, dtype=np.int64)
        return RangeDigests(self.planes, checked(self.level, req_id, dst),
                            np.asarray(src_ids, dtype=np.int64), dst)

    # ------------------------------------------------------------------ consumer
    def fused_job(self, on_board: BoardRows, page_bytes: int) -> DigestJob | None:
        """What a transport that copies on the device needs to digest what it lands while it
        copies and compare it with the producer's rows on its hold board
        (:class:`~kvlink.transport.DigestJob`). None where the planes are not on a GPU, the
        kernel cannot take their geometry, or the rows are not ours to compare (folded, or
        another row width): the check then digests after the copy. On every same-host READ's
        critical path: the planes' part is worked out once."""
        if not on_board.count or on_board.folded:
            return None
        got = self.fused_views()
        if got is None or on_board.row_words != got[2] * got[3]:
            return None
        return DigestJob(got[0], got[1], got[2], got[3], page_bytes, on_board.blocks,
                         on_board.count, on_board.rows, on_board.address, on_board.region)

    def fused_views(self) -> tuple[int, int, int, int] | None:
        """What a copy kernel that digests while it copies needs of our views: (geometry,
        weights — device pointers —, planes, heads); None with integrity off, or where the
        planes are not on a GPU or the kernel cannot take their geometry. Worked out once per
        set of planes."""
        planes = self.planes
        if not self.on or planes is None:
            return None
        geo = self._geo
        if geo is None or geo[0] is not planes:
            geo = self._geo = (planes, self._fused_geometry(planes))
        return geo[1]

    @staticmethod
    def _fused_geometry(planes: Planes) -> tuple[int, int, int, int] | None:
        """(geometry, weights, planes, heads) for the copy kernel, or None (host planes, a
        geometry the kernel cannot take)."""
        first = planes[0][0] if planes and planes[0] else None
        if first is None or isinstance(first, np.ndarray) or first.device.type != "cuda":
            return None
        hb = int(first.shape[3])
        got = _table(planes).fused(_weights(int(first.shape[2]), hb // 8)) if hb % 8 == 0 else None
        if got is None:
            return None
        return got[0], got[1], len(planes) * len(planes[0]), int(first.shape[1])

    def check(self, req_id: str, local_ids: npt.NDArray[np.int64],
              remote_ids: npt.NDArray[np.int64], heads: HeadSlice,
              digest_ids: Sequence[int] | npt.NDArray[np.int64],
              blob: bytes | memoryview | U64, folded: bool, layers: int, planes: int,
              plane_major: bool = False) -> str | None:
        """None when what landed matches the producer's digests of the heads we read; else
        the reason (naming request, block, layer, plane and head), which fails the receive.
        ``blob``: the digests as the wire carries them (``[blocks, layers, planes, heads]``
        little-endian words), or with ``plane_major`` as a landing board's digest area keeps
        them (``[layers x planes, blocks, heads]`` words: kvlink.landing), which the device
        check takes as they are."""
        if not self.on:
            return None
        t0 = time.perf_counter()
        try:
            return self._check(req_id, local_ids, remote_ids, heads, digest_ids, blob, folded,
                               layers, planes, plane_major)
        finally:
            self.check_seconds += time.perf_counter() - t0

    def _check(self, req_id: str, local_ids: npt.NDArray[np.int64],
               remote_ids: npt.NDArray[np.int64], heads: HeadSlice,
               digest_ids: Sequence[int] | npt.NDArray[np.int64],
               blob: bytes | memoryview | U64, folded: bool, layers: int, planes: int,
               plane_major: bool) -> str | None:
        if not len(digest_ids):
            self.failures += 1
            return (f"integrity {self.level.value}: the producer sent no digest for {req_id} "
                    "(is integrity off there, or was it held before its KV was final?): "
                    "not trusted")
        assert self.planes is not None
        i_idx, j_idx = match(remote_ids, digest_ids)
        if not i_idx.size:
            self.failures += 1
            return f"integrity: none of the producer's digested blocks of {req_id} was read"
        lp, rp, count = heads
        k, n = len(digest_ids), int(i_idx.size)
        ran, bad = False, None
        try:
            if plane_major and not folded:  # (a landing board's area: [layers x planes][k])
                by_plane = np.asarray(blob, dtype=np.uint64).reshape(layers * planes, k, -1)
                if n == k and rp == 0 and count == by_plane.shape[2] and on_gpu(self.planes):
                    # every digested block read, every head: the kernel takes them as they are
                    ran, bad = _checked_on_gpu(self.planes, local_ids[i_idx], lp, by_plane,
                                               plane_major=True)
                theirs_all = by_plane.reshape(layers, planes, k, -1).transpose(2, 0, 1, 3)
            else:
                theirs_all = np.frombuffer(blob, dtype="<u8").reshape(
                    (k, 1 if folded else layers, 1 if folded else planes, -1))
        except ValueError:
            self.failures += 1
            return f"integrity: the producer's digests of {req_id} have the wrong size"
        if not ran:
            theirs = theirs_all[j_idx][..., rp:rp + count].view(np.uint64)
            ran, bad = (False, None) if folded else _checked_on_gpu(
                self.planes, local_ids[i_idx], lp, theirs)
        if not ran:  # folded, or not on a GPU: digest what landed, compare here
            ours = _landed(self.planes, local_ids[i_idx], (lp, lp + count))
            if folded:
                ours = fold(ours)
            bad = first_mismatch(theirs, ours)
        if bad is None:
            self.checked_blocks += n
            return None
        self.failures += 1
        b, layer, kv, head = bad
        where = "layers folded" if folded else f"layer {layer}, plane {kv}"
        return (f"integrity: KV of {req_id} differs from the producer's: local block "
                f"{int(local_ids[i_idx[b]])} (remote {int(digest_ids[j_idx[b]])}), {where}, "
                f"head {lp + head} (local)")
