"""Triton kernel of the batched device copy (imported only where Triton is; see kvlink.gpu.copy).

One launch per piece of a request. Program (r, g) owns extent rows [r*E, r*E + E) and part g
of G of each of them. It reads the caller's extent records straight from pinned host memory
(no upload op, no separate table kernel), checks them against the registered regions of each
side and the pairing of lengths, translates addresses through the region map (the peer's
pointers become our IPC mappings), and copies. A program that finds a bad row copies none of
its rows and stores the post's sequence number into the post's pinned status word.
"""

from __future__ import annotations

import triton
import triton.language as tl

_P64 = tl.pointer_type(tl.int64)
_P8 = tl.pointer_type(tl.int8)


@triton.jit  # type: ignore[untyped-decorator,misc]
def _translate(addr, length, table, count):  # type: ignore[no-untyped-def]
    """Region lookup by a linear scan: registered regions are few (one per cache allocation)."""
    end = addr + length
    out = addr
    ok = addr != addr
    for r in range(count):
        lo = tl.load(table + r)
        hi = tl.load(table + count + r)
        delta = tl.load(table + 2 * count + r)
        hit = (addr >= lo) & (end <= hi) & (end >= addr)
        out = tl.where(hit, addr + delta, out)
        ok = ok | hit
    return out, ok


@triton.jit  # type: ignore[untyped-decorator,misc]
def _copy_part(src, dst, nbytes, g, G, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Part g of G of one extent; 16-byte aligned extents move as 16-byte vectors."""
    if ((src | dst | nbytes) & 15) == 0:
        words = nbytes // 8  # int64 words, an even count
        span = tl.cdiv(tl.cdiv(words, G), BLOCK) * BLOCK
        start = tl.multiple_of(g * span, BLOCK)
        stop = tl.multiple_of(tl.minimum(start + span, words), 2)
        s = tl.multiple_of(src.to(_P64), 16)
        d = tl.multiple_of(dst.to(_P64), 16)
        todo = tl.maximum(stop - start, 0)
        full = todo // BLOCK * BLOCK
        for i in range(0, full, BLOCK):  # unmasked: plain 16-byte vector loads and stores
            o = start + i + tl.arange(0, BLOCK)
            tl.store(d + o, tl.load(s + o, cache_modifier=".cg"), cache_modifier=".cs")
        if full < todo:
            o = start + full + tl.arange(0, BLOCK)
            m = o < stop
            tl.store(d + o, tl.load(s + o, mask=m, cache_modifier=".cg"), mask=m,
                     cache_modifier=".cs")
    else:
        span = tl.cdiv(tl.cdiv(nbytes, G), BLOCK) * BLOCK
        start = g * span
        stop = tl.minimum(start + span, nbytes)
        s8 = src.to(_P8)
        d8 = dst.to(_P8)
        for i in range(0, tl.maximum(stop - start, 0), BLOCK):
            o = start + i + tl.arange(0, BLOCK)
            m = o < stop
            tl.store(d8 + o, tl.load(s8 + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["src_ext", "dst_ext", "n", "smap", "ns", "dmap", "nd",  # type: ignore[untyped-decorator,misc]
                               "status", "seq", "G"])
def move(src_ext, dst_ext, n, smap, ns, dmap, nd, status, seq, G,  # type: ignore[no-untyped-def]
         E: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(1)
    idx = tl.arange(0, E)
    rows = tl.program_id(0) * E + idx
    live = rows < n
    sp = src_ext.to(_P64)
    dp = dst_ext.to(_P64)
    sa = tl.load(sp + 2 * rows, mask=live, other=0)
    sl = tl.load(sp + 2 * rows + 1, mask=live, other=0)
    da = tl.load(dp + 2 * rows, mask=live, other=0)
    dl = tl.load(dp + 2 * rows + 1, mask=live, other=0)
    s_to, s_ok = _translate(sa, sl, smap.to(_P64), ns)
    d_to, d_ok = _translate(da, dl, dmap.to(_P64), nd)
    bad = live & ~(s_ok & d_ok & (sl == dl) & (sl >= 0))
    if tl.sum(bad.to(tl.int32)) > 0:
        tl.store(status.to(_P64), seq)
    else:
        for j in tl.static_range(E):
            pick = idx == j
            _copy_part(tl.sum(tl.where(pick, s_to, 0)), tl.sum(tl.where(pick, d_to, 0)),
                       tl.sum(tl.where(pick, sl, 0)), g, G, BLOCK)
