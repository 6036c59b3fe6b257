# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the custom all-reduce: flag barriers in inline PTX, one-shot and two-shot.

Imported only when a GPU all-reduce is built (it needs Triton, which needs a GPU toolchain), so
``import kvlink.allreduce`` works on CPU-only hosts. Triton reads the parameter annotations
(``tl.constexpr``), so the kernels carry no Python type hints; the host wrapper in ``custom.py``
is the typed interface.

Memory layout the kernels assume (one IPC buffer per rank, see ``ipc_buffers.py``)::

    +0        start flags   int32[FLAG_BLOCKS][MAX_WORLD]   row = block id, column = source rank
    +END_OFF  end flags     int32[FLAG_BLOCKS][MAX_WORLD]
    counters                int32[FLAG_BLOCKS]   per-block epoch, only this rank touches it

Barrier of block ``b`` at epoch ``e`` on rank ``r``: thread ``p`` (one per peer) stores ``e`` into
``flags[b][r]`` of peer ``p``'s buffer, then spins until ``flags[b][p]`` of our own buffer equals
``e``; a ``bar.sync`` on both sides extends this to the whole block. Epochs live in device memory
and are bumped by the kernel itself, so a CUDA graph replays with no host work; they skip 0 (the
initial flag value) when the int32 wraps. Equality (not ``>=``) is enough because a peer cannot be
more than one epoch ahead: it cannot pass the next barrier without us.

Memory semantics, chosen per barrier:

* start barrier: ``st.volatile`` / ``ld.volatile``. It only says "my input is there": the input was
  written before this kernel started (memcpy or earlier kernels in stream order), and a kernel
  boundary already makes that visible, so no fence is paid on the hot path.
* one-shot end barrier: volatile. It only says "I finished *reading* your buffer": the loads were
  consumed (their values stored) before ``bar.sync``, so nothing can still be in flight.
* two-shot middle barrier: ``st.release.sys`` / ``ld.acquire.sys``. The reduce-scatter results
  were written *in this kernel* and peers on other GPUs read them next, so the writes must be made
  visible at system scope before the flag, and the readers must not run ahead of the flag.

Peer data is loaded with ``.cg`` (L2 only, skip L1): L1 is not coherent and may hold a stale line
of a peer buffer from an earlier tile. Accumulation is fp32 in rank order 0..world-1 on every rank,
so all ranks produce bit-identical output; two-shot stage 2 moves each element of the same local
offset that the same block reduced in stage 1, so per-block barriers suffice (no grid barrier).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Bytes per flag row: one int32 per possible rank (MAX_WORLD = 8 in config.py).
ROW_BYTES = tl.constexpr(32)

# --------------------------------------------------------------------------- flag primitives
# Each primitive runs in every thread (Triton has no "if threadIdx.x == p"), and predicates the
# memory operation on %tid.x == lane inside the asm, so exactly one thread per peer touches a flag.

_ST_VOLATILE = tl.constexpr("""{
  .reg .pred %kvl_p;
  .reg .u32 %kvl_t;
  mov.u32 %kvl_t, %tid.x;
  setp.eq.u32 %kvl_p, %kvl_t, $3;
  @%kvl_p st.volatile.global.u32 [$1], $2;
  mov.u32 $0, 0;
}""")

_ST_RELEASE = tl.constexpr("""{
  .reg .pred %kvl_p;
  .reg .u32 %kvl_t;
  mov.u32 %kvl_t, %tid.x;
  setp.eq.u32 %kvl_p, %kvl_t, $3;
  @%kvl_p st.release.sys.global.u32 [$1], $2;
  mov.u32 $0, 0;
}""")

# Poll: the owning lane loads the flag; other lanes return the expected value at once, so their
# spin loop exits immediately and they wait at the following bar.sync instead.
_LD_VOLATILE = tl.constexpr("""{
  .reg .pred %kvl_p;
  .reg .u32 %kvl_t;
  mov.u32 %kvl_t, %tid.x;
  setp.eq.u32 %kvl_p, %kvl_t, $3;
  @%kvl_p ld.volatile.global.u32 $0, [$1];
  @!%kvl_p mov.u32 $0, $2;
}""")

_LD_ACQUIRE = tl.constexpr("""{
  .reg .pred %kvl_p;
  .reg .u32 %kvl_t;
  mov.u32 %kvl_t, %tid.x;
  setp.eq.u32 %kvl_p, %kvl_t, $3;
  @%kvl_p ld.acquire.sys.global.u32 $0, [$1];
  @!%kvl_p mov.u32 $0, $2;
}""")


@triton.jit
def _store_flag(addr, value, lane, RELEASE: tl.constexpr):
    if RELEASE:
        tl.inline_asm_elementwise(
            _ST_RELEASE, "=r,l,r,r", [addr, value, lane], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(
            _ST_VOLATILE, "=r,l,r,r", [addr, value, lane], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _poll_flag(addr, expected, lane, ACQUIRE: tl.constexpr):
    if ACQUIRE:
        v = tl.inline_asm_elementwise(
            _LD_ACQUIRE, "=r,l,r,r", [addr, expected, lane], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        v = tl.inline_asm_elementwise(
            _LD_VOLATILE, "=r,l,r,r", [addr, expected, lane], dtype=tl.int32, is_pure=False, pack=1
        )
    return v


@triton.jit
def _block_barrier(
    flag_table, my_base, region_off, rank, epoch, WORLD: tl.constexpr, ACQ_REL: tl.constexpr
):
    """Per-block barrier over all ranks (see module docstring); ends with every thread synced."""
    tl.debug_barrier()  # this block's prior global writes/reads are done before we signal
    pid = tl.program_id(0)
    row = region_off + pid.to(tl.int64) * ROW_BYTES
    for p in tl.static_range(WORLD):
        peer_base = tl.load(flag_table + p)
        _store_flag(peer_base + row + rank.to(tl.int64) * 4, epoch, p, ACQ_REL)
    for p in tl.static_range(WORLD):
        addr = my_base + row + p * 4
        seen = _poll_flag(addr, epoch, p, ACQ_REL)
        while seen != epoch:
            seen = _poll_flag(addr, epoch, p, ACQ_REL)
    tl.debug_barrier()


@triton.jit
def _next_epoch(counter_ptr):
    pid = tl.program_id(0)
    epoch = tl.load(counter_ptr + pid) + 1
    return epoch + (epoch == 0).to(tl.int32)  # skip 0, the flags' initial value, on wrap


@triton.jit
def _peer_ptr(table, p, ELEM: tl.constexpr):
    ptr = tl.load(table + p).to(tl.pointer_type(ELEM))
    return tl.multiple_of(ptr, 16)


@triton.jit
def _sum_peers(in_table, idx, mask, ELEM: tl.constexpr, WORLD: tl.constexpr):
    """Sum of every rank's input at ``idx``, in rank order (so all ranks get identical bits)."""
    acc = tl.load(
        _peer_ptr(in_table, 0, ELEM) + idx, mask=mask, other=0.0, cache_modifier=".cg"
    ).to(tl.float32)
    for p in tl.static_range(1, WORLD):
        x = tl.load(_peer_ptr(in_table, p, ELEM) + idx, mask=mask, other=0.0, cache_modifier=".cg")
        acc += x.to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["rank"])
def one_shot_kernel(
    in_table,
    flag_table,
    out_ptr,
    counter_ptr,
    rank,
    n,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    END_OFF: tl.constexpr,
):
    """out[i] = sum over ranks p (in order) of in_p[i]; every rank reads every peer's input."""
    elem = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = _next_epoch(counter_ptr)
    my_base = tl.load(flag_table + rank)
    _block_barrier(flag_table, my_base, 0, rank, epoch, WORLD, False)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = _sum_peers(in_table, offs, mask, elem, WORLD)
        tl.store(out_ptr + offs, acc.to(elem), mask=mask)
    _block_barrier(flag_table, my_base, END_OFF, rank, epoch, WORLD, False)
    tl.store(counter_ptr + pid, epoch)


@triton.jit(do_not_specialize=["rank"])
def two_shot_kernel(
    in_table,
    tmp_table,
    flag_table,
    out_ptr,
    counter_ptr,
    rank,
    n,
    chunk,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    END_OFF: tl.constexpr,
):
    """Reduce-scatter our ``chunk`` of the input into our tmp buffer, barrier, all-gather."""
    elem = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = _next_epoch(counter_ptr)
    my_base = tl.load(flag_table + rank)
    my_tmp = _peer_ptr(tmp_table, rank, elem)
    first = rank.to(tl.int64) * chunk
    _block_barrier(flag_table, my_base, 0, rank, epoch, WORLD, False)
    for start in range(pid * BLOCK, chunk, nprog * BLOCK):
        local = start + tl.arange(0, BLOCK)
        idx = first + local
        mask = (local < chunk) & (idx < n)
        acc = _sum_peers(in_table, idx, mask, elem, WORLD)
        tl.store(my_tmp + idx, acc.to(elem), mask=mask)
    _block_barrier(flag_table, my_base, END_OFF, rank, epoch, WORLD, True)
    for start in range(pid * BLOCK, chunk, nprog * BLOCK):
        local = start + tl.arange(0, BLOCK)
        for p in tl.static_range(WORLD):
            idx = p * chunk + local
            mask = (local < chunk) & (idx < n)
            x = tl.load(_peer_ptr(tmp_table, p, elem) + idx, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + idx, x, mask=mask)
    tl.store(counter_ptr + pid, epoch)
