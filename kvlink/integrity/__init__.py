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
are hashed in C or with numpy, one vectorised pass per plane; CUDA caches on the device
(only the digests are copied back).

The package, bottom to top: ``weights`` (the arithmetic), ``levels`` (which blocks),
``host`` / ``kernel`` / ``device`` (digests where the memory is), ``compute`` (a request's),
``board`` (their forms on the wire and the hold board), ``checker`` (the two sides). Code
outside it imports this face.
"""

from kvlink.integrity.board import (
    AreaOpener,
    BoardRows,
    Digests,
    WireDigests,
    board_rows,
    pack,
    unpack,
)
from kvlink.integrity.checker import Checker, HeadSlice, RangeDigests, match
from kvlink.integrity.compute import (
    Later,
    digest,
    digest_later,
    first_mismatch,
    fold,
    spec_planes,
    tensor_planes,
)
from kvlink.integrity.device import on_gpu
from kvlink.integrity.levels import Level, checked
from kvlink.integrity.weights import U64, Planes
from kvlink.sampling import SAMPLE_EVERY

__all__ = [
    "SAMPLE_EVERY", "U64", "AreaOpener", "BoardRows", "Checker", "Digests", "HeadSlice",
    "Later", "Level", "Planes", "RangeDigests", "WireDigests", "board_rows", "checked",
    "digest", "digest_later", "first_mismatch", "fold", "match", "on_gpu", "pack",
    "spec_planes", "tensor_planes", "unpack",
]
