"""Triton kernels of the batched device copy (imported only where Triton is; see _gpucopy).

Two kernels per piece of a request, in stream order:

``prepare`` reads the caller's extent records straight from pinned host memory (no upload op),
checks every extent against the registered regions of its side and the pairing of lengths, and
writes the translated (src, dst, len) table to device memory. Any bad extent marks the post as
failed — in a device word the copy kernel reads and in a pinned host word the poller reads —
by storing the post's sequence number, so no flag ever needs resetting.

``copy`` moves one extent per row of the grid, split over ``G`` programs along the second axis
so that a few huge extents still fill the GPU; 16-byte aligned extents take a vectorised path.
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


@triton.jit(do_not_specialize=["src_ext", "dst_ext", "n", "smap", "ns", "dmap", "nd", "tab",  # type: ignore[untyped-decorator,misc]
                               "cap", "flag_dev", "flag_host", "seq"])
def prepare(src_ext, dst_ext, n, smap, ns, dmap, nd, tab, cap, flag_dev, flag_host, seq,  # type: ignore[no-untyped-def]
            BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    sp = src_ext.to(_P64)
    dp = dst_ext.to(_P64)
    sa = tl.load(sp + 2 * rows, mask=live, other=0)
    sl = tl.load(sp + 2 * rows + 1, mask=live, other=0)
    da = tl.load(dp + 2 * rows, mask=live, other=0)
    dl = tl.load(dp + 2 * rows + 1, mask=live, other=0)
    s_to, s_ok = _translate(sa, sl, smap.to(_P64), ns)
    d_to, d_ok = _translate(da, dl, dmap.to(_P64), nd)
    ok = s_ok & d_ok & (sl == dl) & (sl >= 0)
    t = tab.to(_P64)
    tl.store(t + rows, s_to, mask=live)
    tl.store(t + cap + rows, d_to, mask=live)
    tl.store(t + 2 * cap + rows, sl, mask=live)
    if tl.sum((live & ~ok).to(tl.int32)) > 0:
        tl.store(flag_dev.to(_P64), seq)
        tl.store(flag_host.to(_P64), seq)


@triton.jit(do_not_specialize=["tab", "cap", "flag_dev", "seq", "G"])  # type: ignore[untyped-decorator,misc]
def copy(tab, cap, flag_dev, seq, G, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    e = tl.program_id(0)
    g = tl.program_id(1)
    if tl.load(flag_dev.to(_P64)) != seq:
        t = tab.to(_P64)
        src = tl.load(t + e)
        dst = tl.load(t + cap + e)
        nbytes = tl.load(t + 2 * cap + e)
        if ((src | dst | nbytes) & 15) == 0:
            words = nbytes // 8  # int64 words, an even count: 16-byte vectors
            span = tl.cdiv(tl.cdiv(words, G), BLOCK) * BLOCK
            start = tl.multiple_of(g * span, BLOCK)
            stop = tl.multiple_of(tl.minimum(start + span, words), 2)
            s = tl.multiple_of(src.to(_P64), 16)
            d = tl.multiple_of(dst.to(_P64), 16)
            for i in range(0, tl.maximum(stop - start, 0), BLOCK):
                o = start + i + tl.arange(0, BLOCK)
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
