"""The batched device copy's kernel in CUDA C, compiled at first use by NVRTC (through torch).

It does what the Triton kernel (kvlink.gpu.kernels.move) does — read extent records, check each
extent against the registered regions of its side and the pairing of lengths, translate
addresses through the region maps, copy — and is that kernel's replacement wherever NVRTC
works; Triton stays as the fallback and as the reference that CI runs under Triton's
interpreter. Why a second language: on an H200 the same copy written in CUDA C ran faster on
every cuda_ipc acceptance shape (1 GiB in 4 MiB extents 525 us against 554 us for the best
Triton launch settings and 564 as Triton shipped, 20480 x 8 KiB 95 against 99 / 102 us; the
device copy of the same bytes 504-508 and 83-94 us): ``scripts/gpu_cuda_copy_probe.py --quick``
(at 168f41c, since removed),
bench/results/gpu_cuda_copy_probe_random.json. Plain loads and stores beat streaming cache hints
there for 4 MiB extents at random places, and reading extent records from device memory beat
reading them from pinned host memory (each program's first load waits a PCIe round trip) wherever a
program moves tens of kilobytes.

One thread group of ``TP`` threads moves one part of one extent; a block holds ``T / TP``
groups. A group that finds its extent bad stores the post's sequence number into the status word
and copies nothing of it; every group of that extent finds the same, so a refused extent is
never touched.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvlink.cuda_ipc")

SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

// The address kernels' table `t`: a pointer (KV_PW 0: device memory the host uploaded it to),
// or KV_PW words passed by value with the launch itself (read in place from the launch's
// parameter space: no upload, no buffer of ours on the device)
#if KV_PW
struct kv_table { i64 w[KV_PW]; };
#define KV_TABLE const __grid_constant__ kv_table tab
#define KV_TABLE_AT const i64* t = tab.w
#else
#define KV_TABLE const i64* __restrict__ t
#define KV_TABLE_AT (void)0
#endif

// The region of [addr, addr + len) in `map` (starts [n], ends [n], deltas [n]) and its address
// through that region's delta. count > 0: n = count regions in any order, scanned; count < 0:
// n = -count regions sorted by start and disjoint (copy.RegionMap checked it), searched —
// a vLLM cache registers a region per layer, and a scan of 80 per extent part was the copy's
// own cost on 4 KiB pages. A null map: the address is ours already (a lane translated its
// bases through the regions once, and its id bounds keep every unit inside them)
__device__ __forceinline__ bool kv_translate(i64 addr, i64 len, const i64* map, i64 count,
                                             i64* out) {
  if (map == nullptr) {
    *out = addr;
    return true;
  }
  const i64 end = addr + len;
  if (count < 0) {
    const i64 n = -count;
    i64 lo = 0, hi = n;  // the first region starting past addr
    while (lo < hi) {
      const i64 mid = (lo + hi) >> 1;
      if (map[mid] <= addr) lo = mid + 1; else hi = mid;
    }
    const i64 r = lo - 1;  // the last one starting at or before it: the only candidate
    if (r >= 0 && end <= map[n + r] && end >= addr) {
      *out = addr + map[2 * n + r];
      return true;
    }
    return false;
  }
  for (i64 r = 0; r < count; ++r) {
    if (addr >= map[r] && end <= map[count + r] && end >= addr) {
      *out = addr + map[2 * count + r];
      return true;
    }
  }
  return false;
}

// part g of G of one extent (sa, sl) -> (da, dl), by the KV_TP threads of one group
__device__ __forceinline__ void kv_part(i64 sa, i64 sl, i64 da, i64 dl,
                                        const i64* smap, i64 ns, const i64* dmap, i64 nd,
                                        i64* status, i64 seq, i64 G, i64 g, int lane) {
  i64 s = 0, d = 0;
  if (sl != dl || sl < 0 || !kv_translate(sa, sl, smap, ns, &s) ||
      !kv_translate(da, dl, dmap, nd, &d)) {
    if (lane == 0) *(volatile i64*)status = seq;
    return;
  }
  // (one part per extent is the common case: no 64-bit division, which the GPU emulates)
  const i64 span = G == 1 ? ((sl + 15) & ~(i64)15) : ((sl + G - 1) / G + 15) & ~(i64)15;
  const i64 lo = g * span;
  const i64 hi = lo + span < sl ? lo + span : sl;
  if (lo >= hi) return;
  if (((s | d | sl) & 15) == 0) {  // 16-byte vectors, KV_U of them in flight per thread
    const int4* src = reinterpret_cast<const int4*>(s + lo);
    int4* dst = reinterpret_cast<int4*>(d + lo);
    const i64 nv = (hi - lo) >> 4;
    for (i64 i = lane; i < nv; i += (i64)KV_TP * KV_U) {
      int4 r[KV_U];
#pragma unroll
      for (int u = 0; u < KV_U; ++u) {
        const i64 j = i + (i64)u * KV_TP;
        if (j < nv) r[u] = src[j];
      }
#pragma unroll
      for (int u = 0; u < KV_U; ++u) {
        const i64 j = i + (i64)u * KV_TP;
        if (j < nv) dst[j] = r[u];
      }
    }
  } else {
    const char* src = reinterpret_cast<const char*>(s + lo);
    char* dst = reinterpret_cast<char*>(d + lo);
    for (i64 i = lane; i < hi - lo; i += KV_TP) dst[i] = src[i];
  }
}

extern "C" __global__ void __launch_bounds__(KV_T) kv_move(
    const i64* __restrict__ sx, const i64* __restrict__ dx, i64 n,
    const i64* __restrict__ smap, i64 ns, const i64* __restrict__ dmap, i64 nd,
    i64* status, i64 seq, i64 G) {
  const int lane = threadIdx.x % KV_TP;
  const i64 p = (i64)blockIdx.x * (KV_T / KV_TP) + threadIdx.x / KV_TP;
  if (p >= n * G) return;
  i64 e, g;
  if (n * G <= 0x7fffffffLL) {
    const unsigned up = (unsigned)p, ug = (unsigned)G, ue = up / ug;
    e = ue; g = up - ue * ug;
  } else {
    e = p / G; g = p - e * G;
  }
  kv_part(sx[2 * e], sx[2 * e + 1], dx[2 * e], dx[2 * e + 1], smap, ns, dmap, nd, status, seq,
          G, g, lane);
}

// The same copy with the addresses computed here: extent (seg, r) of S segments x R runs is
// src base[seg] + at[r] -> dst base[seg] + at[r], len[r] bytes. t holds, as i64, the source
// bases [S], destination bases [S], source offsets [R], destination offsets [R], lengths [R].
// KV_IDS (a lane's launch, kvlink.gpu.lane): the table's per-run words are block ids, not
// byte offsets — every run is one block of `unit` bytes at id x unit, and an id at or past its
// side's block count (snb, dnb) is refused like an extent outside the regions, so the host
// neither multiplies nor bounds-checks them
#if KV_IDS
#define KV_RUNS_IDS , i64 unit, i64 snb, i64 dnb
#define KV_DIGEST_IDS , i64 snb, i64 dnb
#else
#define KV_RUNS_IDS
#define KV_DIGEST_IDS
#endif
// KV_BOARD (a digest lane's launch, with KV_IDS): the producer's rows are found on its hold
// board by the kernel itself, so the host reads none of them before the launch: `expect`
// is the board mapping's first word; bat and blen are where the hold lies on it as its slot
// showed at the launch (the launcher reads the slot: blen 0, it showed another generation),
// and [blo, bhi) the bytes holds may lie in (kvlink.holdboard.DeviceLayout). `nrows` is not
// read (0): the rows are bounded by the hold's bytes, and the launcher, which read the slot by
// the hold's generation, picked `sample`'s blocks with it too
#if KV_BOARD
#define KV_BOARD_ARGS , i64 bat, i64 blen, i64 blo, i64 bhi, i64 bpick
#else
#define KV_BOARD_ARGS
#endif

extern "C" __global__ void __launch_bounds__(KV_T) kv_move_runs(
    KV_TABLE, i64 S, i64 R,
    const i64* __restrict__ smap, i64 ns, const i64* __restrict__ dmap, i64 nd,
    i64* status, i64 seq, i64 G KV_RUNS_IDS) {
  KV_TABLE_AT;
  const int lane = threadIdx.x % KV_TP;
  const i64 p = (i64)blockIdx.x * (KV_T / KV_TP) + threadIdx.x / KV_TP;
  if (p >= S * R * G) return;
  i64 e, g, seg, r;
  if (S * R * G <= 0x7fffffffLL) {  // always, in practice: 32-bit divisions, not emulated ones
    const unsigned up = (unsigned)p, ug = (unsigned)G, ur = (unsigned)R;
    const unsigned ue = up / ug, us = ue / ur;
    e = ue; g = up - ue * ug; seg = us; r = ue - us * ur;
  } else {
    e = p / G; g = p - e * G; seg = e / R; r = e - seg * R;
  }
#if KV_IDS
  const i64 sid = t[2 * S + r], did = t[2 * S + R + r];
  if ((u64)sid >= (u64)snb || (u64)did >= (u64)dnb) {
    if (lane == 0) *(volatile i64*)status = seq;
    return;
  }
  kv_part(t[seg] + sid * unit, unit, t[S + seg] + did * unit, unit, smap, ns, dmap, nd,
          status, seq, G, g, lane);
#else
  const i64 len = t[2 * S + 2 * R + r];
  kv_part(t[seg] + t[2 * S + r], len, t[S + seg] + t[2 * S + R + r], len, smap, ns, dmap, nd,
          status, seq, G, g, lane);
#endif
}

// The copy of whole units (one per segment and block: a unit is Q pages of one block, Q = 1
// or K and V side by side, Q = 2) with the integrity digest of what it writes, fused: the
// bytes are in registers anyway (kvlink.integrity's digest: per (block, plane, head) the sum
// mod 2**64 of each 8-byte word times the odd weight of its (token, word) place, in the
// consumer's logical order).
// t holds, as i64, the source bases [S], destination bases [S], source offsets [n],
// destination offsets [n] (block id x unit), and per block its digest row (-1 or nrows and
// above: not checked) — with the launch, so a unit that is not checked reads nothing more
// than the plain copy does. geo: (heads, tokens, head bytes, words per head row, 4 spare)
// then per plane (pointer, block stride, head stride, token stride) of the consumer's own
// views, head stride 0 where there is one head; wt: the weights, [tokens x words]. Rows
// are [S x Q][heads] digests. out (if not 0): where the rows are written, host memory
// mapped into the device; expect (if not 0): the producer's rows (host memory: read as the
// unit starts, so the round trip overlaps its copy), compared here — the lowest (row,
// plane, head) index that differs goes to *bad (atomicMin; the host set it to all ones). A
// byte the views do not place in a head is not digested (the digest then differs: a layout
// disagreement fails closed).
__device__ __forceinline__ u64 kv_word(int lo, int hi) {
  return (u64)(unsigned)lo | ((u64)(unsigned)hi << 32);
}

#define KV_GROUPS (KV_T / 32)

// One warp adds each lane's sum into acc[key] (key -1: nothing): lanes with one key in
// aligned power-of-two groups (a head's run of vectors) reduce by shuffles and their first
// lane adds; any other pattern adds lane by lane. Called by the whole warp.
__device__ __forceinline__ void kv_flush(u64* acc, int key, u64 part) {
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  const int lane = threadIdx.x & 31, cnt = __popc(peers), lead = __ffs(peers) - 1;
  const unsigned want = (cnt == 32 ? 0xffffffffu : ((1u << cnt) - 1u)) << lead;
  const bool aligned = (cnt & (cnt - 1)) == 0 && lead % cnt == 0 && peers == want;
  if (__all_sync(0xffffffffu, aligned)) {
    for (int o = 16; o > 0; o >>= 1) {
      const u64 other = __shfl_xor_sync(0xffffffffu, part, o);
      if (o < cnt) part += other;
    }
    if (lane == lead && key >= 0) atomicAdd(&acc[key], part);
  } else if (key >= 0) {
    atomicAdd(&acc[key], part);
  }
}

// A warp's copy of one unit that is not digested, with twice a digested unit's vectors in
// flight a lane: the kernel's launch bound (KV_MINB blocks of KV_T threads an SM) leaves it
// half the threads the plain copy (kv_move_runs) keeps resident, so the same bytes in flight
// an SM take twice the vectors a thread. A `sample` READ's units are nearly all of this kind.
__device__ __forceinline__ void kv_copy_unit(const int4* __restrict__ src, int4* dst, i64 nv,
                                             int lane) {
  for (i64 base = 0; base < nv; base += 64 * KV_U) {
    int4 w[2 * KV_U];
#pragma unroll
    for (int u = 0; u < 2 * KV_U; ++u) {
      const i64 j = base + lane + (i64)u * 32;
      if (j < nv) w[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < 2 * KV_U; ++u) {
      const i64 j = base + lane + (i64)u * 32;
      if (j < nv) dst[j] = w[u];
    }
  }
}

// (KV_MINB blocks an SM: without the bound the compiler keeps everything in registers and
// fits two blocks, fewer units in flight than the plain copy keeps: move.DIGEST_SHAPE)
extern "C" __global__ void __launch_bounds__(KV_T, KV_MINB) kv_move_digest(
    KV_TABLE, i64 S, i64 n, i64 unit,
    const i64* __restrict__ smap, i64 ns, const i64* __restrict__ dmap, i64 nd,
    i64* status, i64 seq, const i64* __restrict__ geo, const u64* __restrict__ wt,
    i64 nrows, u64* out, i64 Q, i64 page, const u64* expect, u64* bad KV_DIGEST_IDS
    KV_BOARD_ARGS) {
  KV_TABLE_AT;
  // one warp per unit: its lanes reduce by shuffles and a few shared atomics of their own,
  // no barrier of the block (a unit is kilobytes: a block-wide barrier per unit cost 25 %)
  __shared__ u64 acc[KV_GROUPS][KV_DMAX];
  const int group = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 item = (i64)blockIdx.x * KV_GROUPS + group;
#if KV_BOARD
  // `full` (bpick 0) on a digest lane: the units are taken block by block (a block's
  // segments one after another), so the producer's rows of a block of warps' units are
  // consecutive words on its board (kvlink.integrity.pack: a row a block, a segment's
  // digests after another's), read once for them all, with the hold's header, into shared
  // memory. Read unit by unit they were two PCIe reads a unit (81,920 for the 70B request),
  // and how fast those go differs between hosts: `full` cost +8 % on one H100 start and
  // +100-110 % on another (bench/results/gpu_digest_copy_unit/). `sample` checks a few
  // blocks, each segment's in the launcher's order, and reads its rows unit by unit.
  __shared__ u64 stage[4 + KV_GROUPS * KV_DMAX];
  const bool whole = bpick == 0;
  const i64 i0 = (i64)blockIdx.x * KV_GROUPS;
  bool fits = false;  // (the hold's bytes hold a `full` request of this shape: as below)
  if (whole) {  // the whole block of threads, before any leaves
    const int ks = (int)Q * (int)geo[0];
    const u64 per = (u64)(S * ks), soff = (u64)bat, slen = (u64)blen;
    fits = ks <= KV_DMAX && slen >= 32 && (soff & 7) == 0 && soff >= (u64)blo &&
           soff <= (u64)bhi && slen <= (u64)bhi - soff &&
           32 + 16 * (u64)n + 8 * (u64)n * per <= slen;
    if (fits) {
      const u64* h = expect + soff / 8;
      const u64* rows = h + 4 + 2 * n + i0 * ks;
      const i64 cnt = S * n - i0 < KV_GROUPS ? S * n - i0 : KV_GROUPS;
      for (i64 w = threadIdx.x; w < 4 + cnt * ks; w += KV_T)
        stage[w] = w < 4 ? h[w] : rows[w - 4];
    }
    __syncthreads();
  }
#else
  const bool whole = false;
#endif
  if (item >= S * n) return;  // the whole warp
  i64 seg, q;  // q: the block's place in the order the units are taken in
  if (whole && S * n <= 0x7fffffffLL) {
    const unsigned ui = (unsigned)item, us = (unsigned)S, uq = ui / us;
    q = uq; seg = ui - uq * us;
  } else if (whole) {
    q = item / S; seg = item - q * S;
  } else if (S * n <= 0x7fffffffLL) {  // 32-bit divisions, not emulated 64-bit ones
    const unsigned ui = (unsigned)item, un = (unsigned)n, us = ui / un;
    seg = us; q = ui - us * un;
  } else {
    seg = item / n; q = item - seg * n;
  }
  i64 r = q;  // the block's index among the request's
#if KV_BOARD
  if (bpick) {  // `sample`: each segment's blocks in the launcher's order (checked ones first)
    r = t[2 * S + 2 * n + q];
    if ((u64)r >= (u64)n) {  // (not an order of this request's blocks: refused)
      if (lane == 0) *(volatile i64*)status = seq;
      return;
    }
  }
#endif
#if KV_IDS
  const i64 sid = t[2 * S + r], did = t[2 * S + n + r];
  const i64 sat = sid * unit, dat = did * unit;
  const bool ids_ok = (u64)sid < (u64)snb && (u64)did < (u64)dnb;
#else
  const i64 sat = t[2 * S + r], dat = t[2 * S + n + r];
  const bool ids_ok = true;
#endif
  i64 s = 0, d = 0;
  if (!ids_ok || !kv_translate(t[seg] + sat, unit, smap, ns, &s) ||
      !kv_translate(t[S + seg] + dat, unit, dmap, nd, &d)) {
    if (lane == 0) *(volatile i64*)status = seq;
    return;
  }
  const int4* src = reinterpret_cast<const int4*>(s);
  int4* dst = reinterpret_cast<int4*>(d);
  const i64 nv = unit >> 4;
#if KV_BOARD
  // Which blocks are checked the launcher worked out as the producer did (bpick 0: every
  // one; else `sample`, bpick of them: kvlink.integrity.checked, salted with the generation),
  // and put them first in the order each segment's units are taken in
  // (kvlink.gpu.lane.sample_order), so a checked unit's row is its block's place there, and
  // no checked unit is a segment's last (the last block is checked at every level: its
  // units ended every segment, the grid's last unit too). A block not checked reads nothing
  // more than the plain copy — nothing of the board, whose words are each a PCIe round trip
  // away. Where the hold lies (its slot's offset and bytes, kvlink.holdboard) the launcher
  // read at the launch; at that offset the unit reads kvlink.integrity.pack's header (rows k,
  // folded, positions, words a row), the row the producer gave its block and its own digests
  // in one round trip: where the rows lie is worked out from what this request must show (as
  // many rows as were picked, of its shape) and bounded by the hold's bytes, and the header
  // read with them must say the same, or nothing is compared. (A checked unit's waits
  // lengthen it, and the whole copy where it runs last: on the 70B request, the header read
  // before the rows cost `sample` and `full` 2-3 us; the slot read here, `full` 5; the pick
  // worked out here (a ballot over the ids, per checked unit) with the checked blocks where
  // they fell, `sample` 2; taking blocks whole, every segment's unit of one after another,
  // `sample` 4 more; loads kept in flight through the copy spilled registers and cost 15-20:
  // bench/results/gpu_digest_pipelined/, gpu_digest_slot/, gpu_digest_order/.) A unit that
  // finds otherwise says so (bad[2], a plain store: no atomics to host memory), and the host
  // digests itself (kvlink.gpu.copy.Pending.mismatch); the last block's first unit (checked
  // at every level) says how many rows (bad[1]). What is read here counts only if the
  // reader's after-check finds the hold still shown once the copy is done (its pages are
  // reused only after it is withdrawn).
  const bool mine = q < (bpick ? bpick : n);  // (`sample`: the launcher put them first)
#endif
  const int H = (int)geo[0], N = (int)geo[1], hb = (int)geo[2], W = (int)geo[3];
  const int keys = (int)Q * H;
  u64 want0 = 0, want1 = 0;  // the producer's digests of this unit (keys <= 64: two a lane)
#if KV_BOARD
  // every block: rows in order; `sample`: a checked block's row is its place in the order
  const i64 rank = q, picked = bpick ? bpick : n;
  i64 slot = -1;
  const u64 per = (u64)(S * keys);  // digest words a row
  const u64 soff = (u64)bat, slen = (u64)blen;
  bool found = false;
  if (whole) {  // read above, for the block of threads: this unit's row is its place
    const u64* st = stage + 4 + (item - i0) * keys;
    if (fits && lane < keys) want0 = st[lane];
    if (fits && lane + 32 < keys) want1 = st[lane + 32];
    found = fits && stage[0] == (u64)picked && stage[1] == 0 && stage[2] == (u64)n &&
            stage[3] == per;
  } else if (mine && slen >= 32 && (soff & 7) == 0 && soff >= (u64)blo && soff <= (u64)bhi &&
      slen <= (u64)bhi - soff &&
      32 + 8 * ((u64)n + (u64)picked) + 8 * (u64)picked * per <= slen) {
    // one round trip: the header, the block's row and the unit's digests at once
    const u64* h = expect + soff / 8;
    const u64* rows = h + 4 + n + picked;
    const i64 at = (rank * S * Q + seg * Q) * H;
    if (lane < keys) want0 = rows[at + lane];
    if (lane + 32 < keys) want1 = rows[at + lane + 32];
    const u64 row = bpick ? h[4 + r] : (u64)rank;
    found = h[0] == (u64)picked && h[1] == 0 && h[2] == (u64)n && h[3] == per &&
            row == (u64)rank;
  }
  if (found) {
    slot = rank;
    if (seg == 0 && r == n - 1 && lane == 0) bad[1] = picked;
  } else if (mine && lane == 0) {
    bad[2] = 1;
  }
#else
  i64 slot = t[2 * S + 2 * n + r];
  // Bounded: rows a withdrawn hold's pages show may be anything by now (the reader's
  // after-check then rejects the READ), and a row past the expected ones must not send the
  // reads below out of the board
  if (slot >= nrows) slot = -1;
#endif
  if (slot < 0) {  // the whole warp: a unit not checked is only copied
    kv_copy_unit(src, dst, nv, lane);
    return;
  }
  // The unit's first trip. A checked unit has looked its rows up above, first: with its
  // loads issued before the lookup (as when the kernel read the slot itself, three round
  // trips) `sample` took 2 us more (bench/results/gpu_digest_slot/variants/, A against B)
  int4 v[KV_U];
#pragma unroll
  for (int u = 0; u < KV_U; ++u) {
    const i64 j = lane + (i64)u * 32;
    if (j < nv) v[u] = src[j];
  }
#if !KV_BOARD
  if (expect) {
    const i64 at = (slot * S * Q + seg * Q) * H;
    if (lane < keys) want0 = expect[at + lane];
    if (lane + 32 < keys) want1 = expect[at + lane + 32];
  }
#endif
  const i64 first = (slot * S * Q + seg * Q) * H;
  // our block id (offsets are id x unit)
#if KV_IDS
  const i64 lid = did;
#else
  const i64 lid = slot < 0 ? 0 : (((dat | unit) >> 32) == 0 ?
                                  (i64)((unsigned)dat / (unsigned)unit) : dat / unit);
#endif
  for (int i = lane; i < keys; i += 32) acc[group][i] = 0;
  // One key, and the page dense in the digest's order (one head, the token stride the head
  // row, one page a unit, the unit the view's block): each 8-byte word's weight is the one at
  // its own index, and every vector counts — no place worked out a vector, no flush when the
  // head changes. The 70B TP8-rank request's pages (one KV head a rank) and MLA's latent
  // pages are all like this; the general path below cost their `full` digest 13 us more (of
  // the kernel's 121, bench/results/gpu_digest_decode/exp/).
  const i64* row0 = geo + 8 + 4 * (seg * Q);
  const bool dense = slot >= 0 && Q == 1 && H == 1 && row0[2] == 0 && row0[3] == hb &&
                     (hb & 15) == 0 && W == hb >> 3 && unit == (i64)N * hb &&
                     d == row0[0] + lid * row0[1];  // (an unchecked unit reads none of it)
  int key = dense ? 0 : -1;
  u64 part = 0;
  for (i64 base = 0; base < nv; base += 32 * KV_U) {  // the same trips for every lane
    const i64 j0 = base + lane;
    if (base > 0) {  // (the first trip was loaded above)
#pragma unroll
      for (int u = 0; u < KV_U; ++u) {
        const i64 j = j0 + (i64)u * 32;
        if (j < nv) v[u] = src[j];
      }
    }
#pragma unroll
    for (int u = 0; u < KV_U; ++u) {
      const i64 j = j0 + (i64)u * 32;
      if (j < nv) dst[j] = v[u];
    }
    if (dense) {
#pragma unroll
      for (int u = 0; u < KV_U; ++u) {
        const i64 j = j0 + (i64)u * 32;
        if (j < nv)
          part += kv_word(v[u].x, v[u].y) * wt[2 * j] + kv_word(v[u].z, v[u].w) * wt[2 * j + 1];
      }
      continue;
    }
#pragma unroll
    for (int u = 0; u < KV_U; ++u) {
      const i64 j = j0 + (i64)u * 32;
      int k = -1;
      u64 x = 0;
      if (j < nv) {
        const i64 off = j << 4;
        const int q = off >= page ? 1 : 0;  // Q is 1 or 2
        const i64* row = geo + 8 + 4 * (seg * Q + q);
        const i64 rel = d + off - (row[0] + lid * row[1]);
        if (rel >= 0 && rel < ((i64)1 << 31)) {
          const unsigned ur = (unsigned)rel, sh = (unsigned)row[2], st = (unsigned)row[3];
          unsigned head, token, wb;
          if (sh == 0) {  // one head
            head = 0; token = ur / st; wb = ur - token * st;
          } else if (sh >= st) {  // head-major (HND)
            head = ur / sh; const unsigned r2 = ur - head * sh; token = r2 / st;
            wb = r2 - token * st;
          } else {  // token-major (NHD)
            token = ur / st; const unsigned r2 = ur - token * st; head = r2 / sh;
            wb = r2 - head * sh;
          }
          if (head < (unsigned)H && token < (unsigned)N && wb + 16 <= (unsigned)hb) {
            k = q * H + (int)head;
            const unsigned wi = token * (unsigned)W + (wb >> 3);
            x = kv_word(v[u].x, v[u].y) * wt[wi] + kv_word(v[u].z, v[u].w) * wt[wi + 1];
          }
        }
      }
      // a lane's sum is flushed when its head changes; NHD pages change it at every step for
      // every lane at once, so the whole warp flushes together (a reduction, not 32 atomics)
      if (__any_sync(0xffffffffu, k >= 0 && k != key)) {
        kv_flush(acc[group], key, part);
        key = k;
        part = 0;
      }
      if (k >= 0) part += x;
    }
  }
  kv_flush(acc[group], key, part);
  __syncwarp();
  for (int i = lane; i < keys; i += 32) {
    const u64 got = acc[group][i];
    if (out) out[first + i] = got;
    if (expect && (i < 32 ? want0 : want1) != got) atomicMin(bad, (u64)(first + i));
  }
}

// After a copy, on its stream: move a landing flag (kvlink.landing) from `expect` to `value`
// unless that copy refused an extent (its status word then holds its sequence number). One
// thread; the flag is host memory mapped into the device (its writer is this stream alone).
extern "C" __global__ void kv_signal(const i64* status, i64 seq, unsigned long long* flag,
                                     unsigned long long expect, unsigned long long value) {
  volatile unsigned long long* f = flag;
  if (*(volatile const i64*)status == seq || *f != expect) return;
  __threadfence_system();  // the copy's bytes before the flag, for whoever reads it
  *f = value;
  __threadfence_system();
}
"""

#: (threads a block, threads per extent part, 16-byte vectors in flight per thread), from the
#: probe's sweep: small extents (<= copy.SMALL) four parts to a 256-thread block, long ones
#: one 64 KiB part to a 1024-thread block
SMALL_SHAPE = (256, 64, 4)
LARGE_SHAPE = (1024, 1024, 2)
CHUNK = 64 << 10  # bytes one group moves of a long extent
#: kv_move_digest: a unit per warp, eight to a block, four 16-byte vectors in flight a lane,
#: and four blocks an SM (its launch bound: 64 registers a thread). On one H200, the 70B
#: TP8-rank request (80 layers, 1 head, 256 blocks) against the plain copy's 100.7 us: every
#: block digested 117.0 us, one in 64 102.4 us; eight vectors a lane and three blocks an SM
#: 138.4 / 105.5, unbounded (two blocks an SM) 171.2 / 117.3
#: (bench/results/gpu_checks_digest_shapes/probe_digest_shapes.json)
DIGEST_SHAPE = (256, 32, 4)
DIGEST_MIN_BLOCKS = 4
DIGEST_MAX = 64  # kv_move_digest: pages per unit x heads it can digest (shared memory)

NARGS = 10  # kv_move, kv_move_runs (the table first)
DIGEST_NARGS = 18  # kv_move_digest
IDS_NARGS = (3, 2)  # more of kv_move_runs and kv_move_digest with KV_IDS (block counts...)
BOARD_NARGS = 5  # more of kv_move_digest with KV_BOARD (the hold board's layout, the pick)
#: size classes (int64 words) of an address table passed with its launch (KV_PW): a class is
#: a kernel of its own, compiled at its first use; the largest keeps a launch's parameters
#: within the driver's 32764 bytes (CUDA 12.1+, Volta and later). The 70B TP8-rank request's
#: table is 1088 words (one run per block), its fused-digest table 832
PARAM_WORDS = (512, 1536, 4000)
_compiled: dict[tuple[int, tuple[int, int, int], str, int, bool, bool], Any] = {}
_compile_lock = threading.Lock()


def parts_per_extent(n: int, first_len: int, chunk: int, min_parts: int) -> int:
    """Parts each extent is cut into for the CUDA kernel: ``chunk``-byte parts, and more (down
    to 16 KiB) where n extents would leave the GPU half idle."""
    g = max(1, -(-first_len // chunk))
    if n * g < min_parts:
        g = max(g, min(-(-min_parts // max(n, 1)), max(1, first_len // 16384)))
    return g


def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p]
    return lib


def kernel_defines(shape: tuple[int, int, int], words: int = 0, ids: bool = False,
                   board: bool = False, dmax: int = DIGEST_MAX,
                   min_blocks: int = DIGEST_MIN_BLOCKS) -> str:
    """The preprocessor lines that make :data:`SOURCE` one form of the kernels (see
    :func:`_compile`); ``dmax`` and ``min_blocks`` default to this module's, and are given by
    scripts/kernel_resources.py, which compiles another tree's source offline."""
    t, tp, u = shape
    return (f"#define KV_T {t}\n#define KV_TP {tp}\n#define KV_U {u}\n"
            f"#define KV_DMAX {dmax}\n#define KV_PW {words}\n"
            f"#define KV_MINB {min_blocks}\n#define KV_IDS {int(ids)}\n"
            f"#define KV_BOARD {int(board)}\n")


def _compile(device: Any, shape: tuple[int, int, int], name: str = "kv_move",
             words: int = 0, ids: bool = False, board: bool = False) -> Any:
    """Kernel ``name`` for ``shape`` on ``device`` (compiled once per process and device);
    ``words``: the address kernels' table passed by value, that many int64 (0: a pointer);
    ``ids``: its per-block words are block ids (KV_IDS: a lane's launch); ``board``: a digest
    lane's, which finds the producer's rows on its hold board (KV_BOARD)."""
    import torch

    key = (int(device.index or 0), shape, name, words, ids, board)
    with _compile_lock:
        fn = _compiled.get(key)
        if fn is None:
            with torch.cuda.device(device):
                fn = torch.cuda._compile_kernel(
                    kernel_defines(shape, words, ids, board) + SOURCE, name)
            _compiled[key] = fn
        return fn


def arg_block(count: int, first: int | None = None) -> tuple[Any, Any]:
    """cuLaunchKernel's arguments as ctypes: ``count`` int64 slots, and the array of pointers
    to each (written once: a launch only rewrites the slots). ``first``: the address of a
    by-value first argument of ours instead of a slot (then ``count - 1`` slots)."""
    n = count if first is None else count - 1
    vals = (ctypes.c_longlong * n)()
    base = ctypes.addressof(vals)
    slots = [base + 8 * i for i in range(n)]
    return vals, (ctypes.c_void_p * count)(*([] if first is None else [first]), *slots)


class TableLaunch:
    """One address kernel whose table travels with its launch: the table's words and the other
    arguments are written into buffers of ours, and the driver copies them at the call — so a
    post is one driver call, with no upload before it and no device buffer to hand back. One
    per (kernel, shape, size class) of :class:`CudaMove`, and one per lane
    (:mod:`kvlink.gpu.lane`, which writes what does not change once: ``table``'s first words
    and ``vals``' constant slots); not thread-safe (its owner's lock)."""

    def __init__(self, device: Any, shape: tuple[int, int, int], name: str, words: int,
                 nargs: int, ids: bool = False, board: bool = False) -> None:
        self.fn = _compile(device, shape, name, words, ids, board).func
        self.threads, self.groups = shape[0], shape[0] // shape[1]  # threads, units a block
        self._table = (ctypes.c_longlong * words)()
        self.table: npt.NDArray[np.uint64] = np.frombuffer(memoryview(self._table).cast("B"),
                                                          dtype=np.uint64)
        #: the same words as int64, where a lane writes block ids (no view made per post)
        self.ids: npt.NDArray[np.int64] = self.table.view(np.int64)
        #: the kernel's arguments after the table, one int64 slot each
        self.vals, self._ptrs = arg_block(nargs, ctypes.addressof(self._table))
        #: cuLaunchKernel's array of pointers to them (for the C launcher: kvlink.native)
        self.params = ctypes.addressof(self._ptrs)

    def __call__(self, lib: Any, grid: int, threads: int, table: npt.NDArray[np.uint64],
                 args: tuple[int, ...], stream: int) -> int:
        self.table[:table.shape[0]] = table  # the words past it: not read by the kernel
        self.vals[:] = list(args)
        return self.launch(lib, grid, stream)

    def launch(self, lib: Any, grid: int, stream: int) -> int:
        """cuLaunchKernel with the table and arguments as they are now; the CUDA error code."""
        return int(lib.cuLaunchKernel(self.fn, grid, 1, 1, self.threads, 1, 1, 0, stream,
                                      self._ptrs, None))


class CudaMove:
    """Launches kv_move through the driver with 64-bit arguments, and copies records to the
    device. Not thread-safe: the owning BatchCopier serialises its posts."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._lib = _driver()
        self._fn = {s: _compile(device, s).func for s in (SMALL_SHAPE, LARGE_SHAPE)}
        self._runs_fn = {s: _compile(device, s, "kv_move_runs").func
                         for s in (SMALL_SHAPE, LARGE_SHAPE)}
        self._vals, self._ptrs = arg_block(NARGS)
        self._signal_fn: Any = None  # compiled at the first signal
        self._digest_fn: Any = None  # compiled at the first fused digest
        self._dvals, self._dptrs = arg_block(DIGEST_NARGS)
        self._tables: dict[tuple[str, tuple[int, int, int], int], TableLaunch] = {}
        self._no_tables = ""  # why tables cannot travel with launches here (then uploaded)
        #: the C launcher lanes post through (kvlink.native), bound to this driver; None:
        #: they launch through ctypes
        self.launcher = _bind_launcher(self._lib)

    def table_class(self, words: int) -> int:
        """The size class (words) a table of ``words`` travels in with its launch; 0 where it
        is longer than the largest, or where such kernels do not build (it is uploaded)."""
        if self._no_tables:
            return 0
        for c in PARAM_WORDS:
            if words <= c:
                return c
        return 0

    def launch_with_table(self, name: str, shape: tuple[int, int, int], units: int,
                          table: npt.NDArray[np.uint64], args: tuple[int, ...],
                          stream: int) -> bool:
        """``name`` (kv_move_runs or kv_move_digest) over ``units`` with ``table`` passed by
        value (args: the kernel's, less the table). False where that kernel cannot be had (it
        is remembered, and logged once): the caller uploads the table instead."""
        words = self.table_class(table.shape[0])
        if not words:
            return False
        key = (name, shape, words)
        launch = self._tables.get(key)
        if launch is None:
            launch = self.table_launch(name, shape, words, len(args) + 1)
            if launch is None:
                return False
            self._tables[key] = launch
        t, tp, _ = shape
        rc = launch(self._lib, -(-units // (t // tp)), t, table, args, stream)
        if rc:
            raise RuntimeError(f"cuLaunchKernel({name}, table of {words} words) failed with "
                               f"CUDA error {rc}")
        return True

    def table_launch(self, name: str, shape: tuple[int, int, int], words: int,
                     nargs: int, ids: bool = False, board: bool = False) -> TableLaunch | None:
        """A new :class:`TableLaunch` of ``name`` (``nargs`` arguments, the table first) in
        size class ``words`` (``ids``: the kernel's block-id form, KV_IDS; ``board``: a digest
        lane's, KV_BOARD); None where such kernels cannot be had here (remembered, and logged
        once: tables are then uploaded)."""
        if self._no_tables:
            return None
        try:
            return TableLaunch(self.device, shape, name, words, nargs, ids, board)
        except Exception as exc:  # an NVRTC or driver too old for __grid_constant__
            self._no_tables = f"{type(exc).__name__}: {exc}"
            log.warning("copy kernels cannot take their tables with the launch (%s); "
                        "uploading them instead", self._no_tables)
            return None

    @property
    def lib(self) -> Any:
        """The driver library its launches go through (ctypes)."""
        return self._lib

    @staticmethod
    def shape(first_len: int, small: int) -> tuple[int, int, int]:
        return SMALL_SHAPE if first_len <= small else LARGE_SHAPE

    def launch(self, shape: tuple[int, int, int], parts: int, args: tuple[int, ...],
               stream: int, runs: bool = False) -> None:
        """kv_move over ``parts`` extent parts; args as kernels.move takes them (``runs``:
        kv_move_runs, args (table, segments, runs, maps..., status, seq, parts per extent))."""
        t, tp, _ = shape
        self._vals[:] = list(args)
        grid = -(-parts // (t // tp))
        fn = (self._runs_fn if runs else self._fn)[shape]
        rc = self._lib.cuLaunchKernel(fn, grid, 1, 1, t, 1, 1, 0, stream, self._ptrs, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel({'kv_move_runs' if runs else 'kv_move'}) "
                               f"failed with CUDA error {rc}")

    def launch_digest(self, units: int, args: tuple[int, ...], stream: int) -> None:
        """kv_move_digest over ``units`` (segments x blocks) units; args as the kernel takes
        them (table, S, n, unit, maps..., status, seq, geo, weights, row count, out, Q, page,
        expect, bad)."""
        if self._digest_fn is None:
            self._digest_fn = _compile(self.device, DIGEST_SHAPE, "kv_move_digest").func
        self._dvals[:] = list(args)
        t, tp, _ = DIGEST_SHAPE
        grid = -(-units // (t // tp))
        rc = self._lib.cuLaunchKernel(self._digest_fn, grid, 1, 1, t, 1, 1, 0, stream,
                                      self._dptrs, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel(kv_move_digest) failed with CUDA error {rc}")

    def signal_fn(self) -> int:
        """kv_signal's CUfunction (compiled at first use), for the C launcher to launch after
        a lane's copy (kvlink.gpu.lane.Lane.post)."""
        if self._signal_fn is None:
            self._signal_fn = _compile(self.device, SMALL_SHAPE, "kv_signal").func
        fn = self._signal_fn
        return int(getattr(fn, "value", fn) or 0)

    def signal(self, status: int, seq: int, flag: int, expect: int, value: int,
               stream: int) -> None:
        """kv_signal after the work on ``stream`` so far (see the kernel)."""
        if self._signal_fn is None:
            self._signal_fn = _compile(self.device, SMALL_SHAPE, "kv_signal").func
        self._vals[:5] = [status, seq, _signed(flag), _signed(expect), _signed(value)]
        rc = self._lib.cuLaunchKernel(self._signal_fn, 1, 1, 1, 1, 1, 1, 0, stream,
                                      self._ptrs, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel(kv_signal) failed with CUDA error {rc}")

    def upload(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` of pinned host memory to the device, in stream order."""
        rc = self._lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream)
        if rc:
            raise RuntimeError(f"cuMemcpyHtoDAsync failed with CUDA error {rc}")


def _bind_launcher(lib: Any) -> Any:
    """The C launcher, given the addresses of the driver functions it calls (those of
    ``lib``), or None where it cannot be built here (kvlink.native says why)."""
    from kvlink import native

    launcher = native.load()
    if launcher is not None:
        launcher.bind(*(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                        for name in ("cuLaunchKernel", "cuStreamQuery", "cuEventRecord",
                                     "cuStreamWaitEvent", "cuStreamWriteValue32_v2")))
    return launcher


def _bind_event_query(lib: Any) -> Callable[[int], int] | None:
    """kvlink's C ``event_query`` bound to ``lib``'s cuEventQuery, or None where the C
    helpers are not built here (then the query goes through ctypes)."""
    from kvlink import native

    helpers = native.load()
    if helpers is None:
        return None
    helpers.bind_event_query(ctypes.cast(lib.cuEventQuery, ctypes.c_void_p).value)
    return helpers.event_query  # type: ignore[no-any-return]


def _signed(v: int) -> int:
    """A 64-bit word as the c_longlong slots take it."""
    return v - (1 << 64) if v >= 1 << 63 else v


NOT_READY = 600  # CUDA_ERROR_NOT_READY
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context
EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING: completion only, the cheapest event


def typed_driver(**argtypes: list[Any]) -> Any:
    """The CUDA driver library (ctypes) with these functions' argument types set and an int
    (CUresult) returned: a call then converts its arguments in C, not through ctypes'
    guesses."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in argtypes.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


class StreamOrder:
    """Makes a stream wait, on the device, for the work enqueued on another one so far: a
    stream query, and where work is pending an event record and a stream wait — no host sync.
    Driver calls through ctypes (about a microsecond each; torch's Stream and Event objects cost
    several). One event serves every call: a wait takes the event's state when it is enqueued.
    Calls must come from a thread whose current context is the device's; not thread-safe (the
    owning BatchCopier serialises its posts)."""

    def __init__(self) -> None:
        vp = ctypes.c_void_p
        self._lib = typed_driver(cuStreamQuery=[vp],
                                  cuEventCreate=[ctypes.POINTER(vp), ctypes.c_uint],
                                  cuEventRecord=[vp, vp],
                                  cuStreamWaitEvent=[vp, vp, ctypes.c_uint])
        self._event: ctypes.c_void_p | None = None

    def wait(self, stream: int, after: int) -> bool:
        """``stream`` (raw handle) runs its next work after what ``after`` holds now; False
        where ``after`` had nothing pending (then nothing was enqueued)."""
        lib = self._lib
        rc = lib.cuStreamQuery(after)
        if rc == 0:
            return False
        if rc != NOT_READY:
            raise RuntimeError(f"cuStreamQuery failed with CUDA error {rc}")
        if self._event is None:
            ev = ctypes.c_void_p()
            rc = lib.cuEventCreate(ctypes.byref(ev), EVENT_DISABLE_TIMING)
            if rc:
                raise RuntimeError(f"cuEventCreate failed with CUDA error {rc}")
            self._event = ev
        rc = lib.cuEventRecord(self._event, after)
        if rc == 0:
            rc = lib.cuStreamWaitEvent(stream, self._event, 0)
        if rc:
            raise RuntimeError(f"ordering a copy after stream 0x{after:x}: CUDA error {rc}")
        return True


def _elapsed_time(lib: Any) -> Any:
    """cuEventElapsedTime (float milliseconds between two events), under whichever name this
    driver exports it (CUDA 12.8 added a ``_v2`` of the same signature)."""
    for name in ("cuEventElapsedTime", "cuEventElapsedTime_v2"):
        fn = getattr(lib, name, None)
        if fn is not None:
            vp = ctypes.c_void_p
            fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_float), vp, vp], ctypes.c_int
            return fn
    raise RuntimeError("the CUDA driver exports no cuEventElapsedTime")


class DriverEvents:
    """A copy's completion: driver events (no timing) recorded, queried and recycled through
    ctypes (and, bracketing the copies timed on the device now and then, timing events:
    :meth:`take_timed`, :meth:`record_timed`, :meth:`elapsed`) — queried through kvlink's C
    helper where it builds (``event_query``: a poll of a READ in flight makes one, and a
    ctypes foreign call costs about twice a C function's cold, 11.9 against 6.5 us for
    getppid on the CPU VM: bench/results/cold_calls_alive).
    torch's Event objects cost several microseconds a call cold, and a request pays one
    record as it is posted and a query at every poll that looks at it. ``device``: the index
    whose primary context a thread without a current one takes (a poll may come from a
    thread that never touched CUDA: the driver then refuses with no context). Not
    thread-safe: the owning BatchCopier serialises its calls."""

    def __init__(self, device: int) -> None:
        vp = ctypes.c_void_p
        self._lib = typed_driver(cuEventCreate=[ctypes.POINTER(vp), ctypes.c_uint],
                                  cuEventRecord=[vp, vp], cuEventQuery=[vp],
                                  cuEventSynchronize=[vp], cuStreamQuery=[vp],
                                  cuStreamWriteValue32_v2=[vp, ctypes.c_uint64,
                                                           ctypes.c_uint32, ctypes.c_uint])
        self._device = device
        #: events to record again (complete, or never recorded): a post that takes one
        #: here makes no call (BatchCopier.copy_lane, before its launch)
        self.free: list[int] = []
        self._query: Callable[[int], int] | None = _bind_event_query(self._lib)
        self._timing_free: list[int] = []  # timing events to record again
        self._elapsed: Any = None  # cuEventElapsedTime, bound at the first use

    def take(self) -> int:
        """An event to record (recycled, or new); :meth:`recycle` it if it was not recorded."""
        return self.free.pop() if self.free else self._create()

    def record(self, stream: int) -> int:
        """An event recorded on ``stream`` (raw handle) now: complete once what it holds ran."""
        ev = self.free.pop() if self.free else self._create()
        rc = self._call(self._lib.cuEventRecord, ev, stream)
        if rc:
            self.free.append(ev)
            raise RuntimeError(f"cuEventRecord failed with CUDA error {rc}")
        return ev

    def query(self, ev: int) -> bool:
        fast = self._query
        rc = fast(ev) if fast is not None else _NO_CONTEXT
        if rc == _NO_CONTEXT:  # (or no C helper) through ctypes, which takes a context
            rc = self._call(self._lib.cuEventQuery, ev)
        if rc == 0:
            return True
        if rc == NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed with CUDA error {rc}")

    def stream_query(self, stream: int) -> int:
        """cuStreamQuery of ``stream`` (raw handle): 0 where it has nothing left to run,
        :data:`NOT_READY` where it has, else the driver's error."""
        return self._call(self._lib.cuStreamQuery, stream)

    def mark_end(self, stream: int, word: int, value: int) -> int:
        """``value`` (32 bits) written to the host word at ``word`` once everything enqueued
        on ``stream`` so far has ended, its writes before it (cuStreamWriteValue32: a stream
        memory operation, no kernel): a lane's completion (kvlink.gpu.copy.Pending). The
        driver's answer."""
        return self._call(self._lib.cuStreamWriteValue32_v2, stream, word, value, 0)

    def synchronize(self, ev: int) -> None:
        rc = self._call(self._lib.cuEventSynchronize, ev)
        if rc:
            raise RuntimeError(f"cuEventSynchronize failed with CUDA error {rc}")

    def recycle(self, ev: int) -> None:
        """``ev`` (complete, or never waited on again) serves a later record."""
        self.free.append(ev)

    def take_timed(self) -> int:
        """A timing event not recorded yet, for a launch to record right before its kernel
        (kvlink.native's ``post``: the copy's time then leaves out the host's steps before
        the launch); 0 where the driver refused one (logged): a copy is not failed for its
        timing. :meth:`recycle_timed` it where nothing recorded it."""
        try:
            return self._timing_free.pop() if self._timing_free else self._create(0)
        except RuntimeError as exc:
            log.debug("cuda_ipc: no timing event: %s", exc)
            return 0

    def record_timed(self, stream: int) -> int:
        """A timing event (:meth:`elapsed` reads two) recorded on ``stream`` now: the end of
        a copy timed on the device (kvlink.gpu.copy.BatchCopier.copy_lane; its start is
        recorded by the launch: :meth:`take_timed`). 0 where the driver refused (logged): a
        copy is not failed for its timing."""
        ev = self.take_timed()
        if not ev:
            return 0
        rc = self._call(self._lib.cuEventRecord, ev, stream)
        if rc:
            self._timing_free.append(ev)
            log.debug("cuda_ipc: recording a timing event failed with CUDA error %d", rc)
            return 0
        return ev

    def elapsed(self, start: int, end: int) -> float | None:
        """Seconds between two timing events recorded on one stream, once both are complete
        (None before; both go back to serve later records). Raises RuntimeError naming the
        driver's error, both events recycled."""
        if self._elapsed is None:
            self._elapsed = _elapsed_time(self._lib)
        ms = ctypes.c_float()
        rc = self._call(self._elapsed, ctypes.byref(ms), start, end)
        if rc == NOT_READY:
            return None
        self._timing_free += (start, end)
        if rc:
            raise RuntimeError(f"cuEventElapsedTime failed with CUDA error {rc}")
        return ms.value * 1e-3

    def recycle_timed(self, *events: int) -> None:
        """Timing events never waited on again (the copy they bracket failed at its post)."""
        self._timing_free += events

    def _create(self, flags: int = EVENT_DISABLE_TIMING) -> int:
        ev = ctypes.c_void_p()
        rc = self._call(self._lib.cuEventCreate, ctypes.byref(ev), flags)
        if rc:
            raise RuntimeError(f"cuEventCreate failed with CUDA error {rc}")
        return int(ev.value or 0)

    def _call(self, fn: Any, *args: Any) -> int:
        rc = int(fn(*args))
        if rc == _NO_CONTEXT:  # this thread has none yet: the device's primary one, and again
            import torch

            torch.cuda.set_device(self._device)
            torch.cuda.current_stream(self._device)  # (the runtime makes it current lazily)
            rc = int(fn(*args))
        return rc


def load(device: Any) -> CudaMove | None:
    """The CUDA C mover for ``device``, or None (logged once) where NVRTC can't build it."""
    try:
        return CudaMove(device)
    except Exception as exc:  # no NVRTC, an old torch, a driver too old for the PTX
        if not getattr(load, "_warned", False):
            log.warning("CUDA C copy kernel unavailable (%s: %s); using the Triton kernel",
                        type(exc).__name__, exc)
            load._warned = True  # type: ignore[attr-defined]
        return None
