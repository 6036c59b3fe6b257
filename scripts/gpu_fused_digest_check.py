"""GPU check of the fused copy + integrity digest (``kv_move_digest``, kvlink.gpu.move), one GPU.

    python scripts/gpu_fused_digest_check.py [--out DIR]

Through ``BatchCopier.copy_digest`` (what the cuda_ipc transport posts for a READ with
integrity on), on vLLM-shaped bf16 caches of random bytes, source and destination blocks
shuffled:

1. Equal: the kernel's digests of what it landed equal :func:`kvlink.integrity.digest` of the
   destination afterwards (the reference path, its own kernel), and the destination equals the
   source, for FlashAttention NHD ``(2, B, N, H, D)`` with 8 heads and with 1 head (the 70B
   TP8-rank shape), HND ``(2, B, H, N, D)``, and K and V side by side ``(B, 2, N, H, D)``
   (two pages per unit); ``sample`` rows (unchecked blocks copied, not digested).
2. A layout disagreement (views read NHD memory as HND): digests differ, bytes still copied.
3. Cost: the Llama-3-70B TP8-rank 4096-token request (80 layers, 1 KV head, 256 blocks; 160
   MiB) copied by ``copy_runs`` (one run per block, no digest) and by ``copy_digest`` with
   every block and with the sampled blocks digested (written back, and compared on the device
   with the expected digests — in device memory, and in pinned host memory as a READ finds
   them on the producer's board), CUDA-event timed, median of 30, and a device copy of the
   same bytes. The device compare must say "none differ", and name the one word changed.
4. Digest lanes (``BatchCopier.lane`` with a ``BoardDigest``: what a same-host READ with
   integrity on posts after its peer's first), over a real hold board registered with CUDA:
   the kernel picks the blocks it checks as the producer did and finds their rows on the
   board itself. Equal rows say none differ, with the rows counted; a changed expected word
   is named; a generation the board does not show, rows of another shape, another level or
   another request's pick compare nothing (the host then digests); a source byte changed
   after the hold is caught — and the 70B request's device time through a plain lane and a
   digest lane (``board_lane_cost``).
Writes gpu_fused_digest_check.json; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_common import write

from kvlink import integrity
from kvlink.gpu.copy import NO_MISMATCH, BatchCopier, DigestLaunch, RegionMap
from kvlink.gpu.ipc import host_register, host_unregister
from kvlink.gpu.lane import BoardDigest
from kvlink.holdboard import LAYOUT, BoardView, HoldBoard
from kvlink.integrity import Level, checked, device, tensor_planes, weights


def _cache(kind: str, layers: int, blocks: int, heads: int, dev: Any, seed: int
           ) -> list[Any]:
    g = torch.Generator(device=dev).manual_seed(seed)
    shape = {"NHD": (2, blocks, 16, heads, 128), "HND": (2, blocks, heads, 16, 128),
             "joined": (blocks, 2, 16, heads, 128)}[kind]
    return [torch.randint(-2**15, 2**15, shape, dtype=torch.int16, device=dev,
                          generator=g).view(torch.bfloat16) for _ in range(layers)]


def _planes(kind: str, layers: list[Any], read_as: str | None = None) -> Any:
    """The consumer's own (B, H, N, D) views; ``read_as``: how a wrong framework reads it."""
    kind = read_as or kind
    rows = []
    for t in layers:
        if kind == "NHD":
            rows.append([t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3)])
        elif kind == "HND":
            rows.append([t[0], t[1]])
        else:
            rows.append([t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)])
    return tensor_planes(rows)


def _geometry(kind: str, layers: list[Any]) -> tuple[int, list[int], int, int]:
    """(unit bytes, segment bases, pages per unit, page bytes) of one side's cache."""
    page = layers[0][0, 0].numel() * 2  # one block's page of one plane
    if kind == "joined":
        return 2 * page, [int(x.data_ptr()) for x in layers], 2, page
    return page, [int(x[kv].data_ptr()) for x in layers for kv in (0, 1)], 1, page


def _region(layers: list[Any], dev: Any, search: bool = True) -> RegionMap:
    starts = [int(x.data_ptr()) for x in layers]
    return RegionMap(starts, [s + x.numel() * 2 for s, x in zip(starts, layers)],
                     [0] * len(layers), dev, search)


def device_us(fn: Any, stream: Any) -> float:
    """Device time alone of what ``fn`` enqueues on ``stream``, median of 30: the stream is
    held busy (a sleep kernel) while the host launches, so the events bracket the kernels,
    not the host's launch work too (which they did before 2026-12-03: every figure then
    carried 100+ us of host time)."""
    times = []
    for i in range(35):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000)  # ~0.5 ms: longer than any launch measured here
            e0.record(stream)
            fn()
            e1.record(stream)
        e1.synchronize()
        if i >= 5:
            times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


class Case:
    def __init__(self, kind: str, layers: int, blocks: int, heads: int, n: int, dev: Any,
                 read_as: str | None = None) -> None:
        self.kind, self.dev = kind, dev
        self.src = _cache(kind, layers, blocks, heads, dev, 1)
        self.dst = _cache(kind, layers, blocks, heads, dev, 2)
        rng = np.random.default_rng(3)
        self.rids = rng.permutation(blocks)[:n].astype(np.int64)
        self.lids = rng.permutation(blocks)[:n].astype(np.int64)
        self.unit, self.sbase, self.pages, self.page = _geometry(kind, self.src)
        _, self.dbase, _, _ = _geometry(kind, self.dst)
        self.smap, self.dmap = _region(self.src, dev), _region(self.dst, dev)
        self.planes = _planes(kind, self.dst, read_as)
        self.src_planes = _planes(kind, self.src)  # the producer's, read right
        self.heads = int(self.planes[0][0].shape[1])  # as the consumer's views have them
        self._anywhere: RegionMap | None = None
        self._scanned: tuple[RegionMap, RegionMap] | None = None
        self.nplanes = 2 * layers

    def post(self, copier: BatchCopier, stream: Any, rows: np.ndarray | None,
             expect: Any = None, anywhere: bool = False, scan: bool = False) -> Any:
        u = np.uint64(self.unit)
        base = np.array(self.sbase + self.dbase, dtype=np.uint64)
        at = np.concatenate([self.rids.view(np.uint64) * u, self.lids.view(np.uint64) * u])
        segs, n = len(self.sbase), self.rids.shape[0]
        if rows is None:
            table = np.concatenate([base, at, np.full(n, self.unit, dtype=np.uint64)])
            if anywhere:
                if self._anywhere is None:
                    self._anywhere = RegionMap.anywhere(self.dev)
                return copier.copy_runs(table, segs, n, self._anywhere, self._anywhere,
                                        stream, None, self.unit)
            if scan:
                if self._scanned is None:
                    self._scanned = (_region(self.src, self.dev, False),
                                     _region(self.dst, self.dev, False))
                return copier.copy_runs(table, segs, n, *self._scanned, stream, None,
                                        self.unit)
            return copier.copy_runs(table, segs, n, self.smap, self.dmap, stream, None,
                                    self.unit)
        first = self.planes[0][0]
        fused = device.device_table(self.planes).fused(
            weights.weights(int(first.shape[2]), int(first.shape[3]) // 8))
        assert fused is not None, "the views' geometry was not taken"
        count = int((rows >= 0).sum())
        launch = DigestLaunch(fused[0], fused[1], self.pages, self.page, count,
                              count * self.nplanes * self.heads,
                              0 if expect is None else int(expect.data_ptr()))
        table = np.concatenate([base, at, rows.view(np.uint64)])
        return copier.copy_digest(table, segs, n, self.unit, self.smap, self.dmap, stream,
                                  None, launch)

    def post_straddling(self, copier: BatchCopier, stream: Any, search: bool) -> Any:
        """copy_runs whose first run starts half a unit before a layer's end: it crosses
        into the next registered region (or past the last), so the device must refuse it."""
        u = np.uint64(self.unit)
        base = np.array(self.sbase + self.dbase, dtype=np.uint64)
        src_at = self.rids.view(np.uint64) * u
        src_at[0] = np.uint64(self.src[0].numel() * 2 - self.unit // 2)
        table = np.concatenate([base, src_at, self.lids.view(np.uint64) * u,
                                np.full(self.rids.shape[0], self.unit, dtype=np.uint64)])
        maps = ((self.smap, self.dmap) if search else
                (_region(self.src, self.dev, False), _region(self.dst, self.dev, False)))
        return copier.copy_runs(table, len(self.sbase), self.rids.shape[0], *maps, stream,
                                None, self.unit)

    def rows(self, level: Level) -> np.ndarray:
        mask = checked(level, "check", self.rids)
        return np.where(mask, np.cumsum(mask) - 1, -1).astype(np.int64)

    def reference(self, rows: np.ndarray) -> np.ndarray:
        """The producer's digests of the checked blocks (its own views of its source)."""
        want = integrity.digest(self.src_planes, self.rids[rows >= 0])
        return want.reshape(want.shape[0], self.nplanes, -1)

    def _blocks(self, layers: list[Any], ids: np.ndarray) -> Any:
        idx = torch.as_tensor(ids, device=self.dev)
        axis = 0 if self.kind == "joined" else 1
        # compared as int16: random bits make bf16 NaNs, which never equal themselves
        return torch.stack([x.view(torch.int16).index_select(axis, idx) for x in layers])


def check_equal(copier: BatchCopier, stream: Any, dev: Any) -> list[dict[str, Any]]:
    out = []
    for kind, heads, level, read_as in (("NHD", 8, Level.FULL, None),
                                        ("NHD", 1, Level.FULL, None),
                                        ("HND", 8, Level.FULL, None),
                                        ("joined", 8, Level.FULL, None),
                                        ("NHD", 8, Level.SAMPLE, None),
                                        ("NHD", 8, Level.FULL, "HND")):
        c = Case(kind, 4, 96, heads, 64, dev, read_as)
        rows = c.rows(level)
        p = c.post(copier, stream, rows)
        p.wait()
        got = p.digests
        want = c.reference(rows)
        got = got if got is None or got.size == want.size else None
        copied = bool(torch.equal(c._blocks(c.src, c.rids), c._blocks(c.dst, c.lids)))
        equal = got is not None and np.array_equal(got.reshape(want.shape), want)
        row = {"layout": kind, "heads": heads, "level": level.value,
               "views_read_as": read_as or kind, "checked_blocks": int((rows >= 0).sum()),
               "copy_failed": p.failed(), "bytes_copied": copied, "digests_equal": equal}
        # a layout disagreement must differ; everything else must be equal
        row["ok"] = copied and not p.failed() and (equal != bool(read_as))
        if not read_as:  # compared on the device: equal, then one expected word changed
            dev_want = torch.from_numpy(want.reshape(-1).view(np.int64).copy()).to(dev)
            p = c.post(copier, stream, rows, dev_want)
            p.wait()
            row["compare_equal_says_none"] = p.mismatch == NO_MISMATCH
            flip = int(dev_want.numel() // 3)
            dev_want[flip] ^= 1
            p = c.post(copier, stream, rows, dev_want)
            p.wait()
            row["compare_names_changed_word"] = p.mismatch == flip
            wild = rows.copy()  # rows a reused page could show: past the count, huge
            wild[wild >= 0] = np.int64(1) << 40
            p = c.post(copier, stream, wild, dev_want)
            p.wait()
            row["rows_past_count_unchecked"] = p.mismatch == NO_MISMATCH and not p.failed()
            row["ok"] = (row["ok"] and row["compare_equal_says_none"]
                         and row["compare_names_changed_word"]
                         and row["rows_past_count_unchecked"])
        out.append(row)
        print(row, flush=True)
    return out


def timing(copier: BatchCopier, stream: Any, dev: Any) -> dict[str, Any]:
    c = Case("NHD", 80, 300, 1, 256, dev)
    full, sample = c.rows(Level.FULL), c.rows(Level.SAMPLE)
    nbytes = 80 * 2 * 256 * c.unit
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)

    def timed(fn: Any) -> float:
        return device_us(fn, stream)

    res = {
        "bytes": nbytes,
        "device_copy_us": timed(lambda: b.copy_(a)),
        "copy_runs_us": timed(lambda: c.post(copier, stream, None)),
        # the same with one region each side: what checking each extent against the 80
        # registered layers (kv_translate's scan) costs
        "copy_runs_one_region_us": timed(lambda: c.post(copier, stream, None, anywhere=True)),
        # and with the 80 regions scanned one by one, as before they were searched
        "copy_runs_scanned_us": timed(lambda: c.post(copier, stream, None, scan=True)),
        "copy_digest_full_us": timed(lambda: c.post(copier, stream, full)),
        "copy_digest_sample_us": timed(lambda: c.post(copier, stream, sample)),
    }
    for name, rows in (("full", full), ("sample", sample)):
        want = torch.from_numpy(c.reference(rows).reshape(-1).view(np.int64).copy()).to(dev)
        res[f"copy_compare_{name}_us"] = timed(
            lambda r=rows, w=want: c.post(copier, stream, r, w))  # type: ignore[misc]
        p = c.post(copier, stream, rows, want)
        p.wait()
        res[f"compare_{name}_matched"] = p.mismatch == NO_MISMATCH
        # where a READ finds them: host memory (the producer's board), read by the device
        host = want.cpu().pin_memory()
        res[f"copy_compare_{name}_host_us"] = timed(
            lambda r=rows, w=host: c.post(copier, stream, r, w))  # type: ignore[misc]
        p = c.post(copier, stream, rows, host)
        p.wait()
        res[f"compare_{name}_host_matched"] = p.mismatch == NO_MISMATCH
    p = c.post(copier, stream, full)
    p.wait()
    res["full_digests_equal_reference"] = bool(np.array_equal(
        p.digests.reshape(-1) if p.digests is not None else None,
        c.reference(full).reshape(-1)))
    for search in (True, False):  # a run crossing a region's end: refused either way
        p = c.post_straddling(copier, stream, search)
        p.wait()
        res[f"straddling_run_refused_{'searched' if search else 'scanned'}"] = p.failed()
    res["regions_searched"] = c.smap.kernel_count < 0 and c.dmap.kernel_count < 0
    res["ratio_copy_digest_full_over_copy_runs"] = (res["copy_digest_full_us"]
                                                    / res["copy_runs_us"])
    res["ratio_copy_digest_sample_over_copy_runs"] = (res["copy_digest_sample_us"]
                                                      / res["copy_runs_us"])
    print(res, flush=True)
    return res


class BoardLane:
    """A digest lane of ``case`` (kvlink.gpu.lane with a BoardDigest) over a real hold board
    whose slots and arena the kernel reads in place: what a same-host READ with integrity on
    posts (the producer's rows are found by the kernel from the hold's generation)."""

    def __init__(self, copier: BatchCopier, case: Case) -> None:
        self.case, self.board = case, HoldBoard()
        view = BoardView.open(self.board.name, self.board.token)
        assert view is not None
        self.view = view
        base, size = view.region
        dev_board = host_register(base, size, read_only=True)
        first = case.planes[0][0]
        fused = device.device_table(case.planes).fused(
            weights.weights(int(first.shape[2]), int(first.shape[3]) // 8))
        assert fused is not None, "the views' geometry was not taken"
        digest = BoardDigest(case.pages, case.page, fused[0], fused[1], dev_board, LAYOUT,
                             base)
        nb = case.src[0].shape[0 if case.kind == "joined" else 1]
        lane = copier.lane(np.array(case.sbase, dtype=np.uint64),
                           np.array(case.dbase, dtype=np.uint64), case.unit, (nb, nb),
                           case.smap, case.dmap, digest)
        assert lane is not None
        self.lane = lane
        self.next_gen = 1001

    def hold(self, level: Level, change: bool = False) -> tuple[int, int, int]:
        """Publish the producer's digests of the case's blocks at ``level`` (picked by the
        hold's generation, as a producer picks them) under a new generation; ``change``: with
        the digest word a third of the way in flipped. (generation, rows, that index)."""
        gen, self.next_gen = self.next_gen, self.next_gen + 1
        mask = checked(level, gen, self.case.rids)
        rows = np.where(mask, np.cumsum(mask) - 1, -1).astype(np.int64)
        want = self.case.reference(rows).reshape(-1).astype("<u8")
        flip = want.shape[0] // 3
        if change:
            want[flip] ^= np.uint64(1)
        k = int((rows >= 0).sum())
        blob = integrity.pack((self.case.rids[rows >= 0].tolist(), want.tobytes(), False), rows)
        assert self.board.publish(gen, self.case.rids, blob)
        return gen, k, flip

    def post(self, copier: BatchCopier, stream: Any, gen: int, level: Level,
             n: int | None = None) -> Any:
        """A READ of the case's blocks (the first ``n``) told hold ``gen``, its kernel picking
        the blocks it checks at ``level``."""
        c = self.case
        return copier.copy_lane(self.lane, c.rids[:n], c.lids[:n], stream, None, gen,
                                level is Level.SAMPLE)

    def close(self) -> None:
        host_unregister(self.view.region[0])
        self.view.close()
        self.board.close()


def check_board_lanes(copier: BatchCopier, stream: Any, dev: Any) -> list[dict[str, Any]]:
    """A digest lane finds the hold's rows on the board itself: equal rows say none differ
    and how many rows were compared; a changed expected word is named; a generation the
    board does not show, or rows of another shape, compare nothing (None: the host digests);
    a source byte changed after the digest was fixed is caught."""
    out = []
    for kind, heads, level in (("NHD", 8, Level.FULL), ("NHD", 8, Level.SAMPLE),
                               ("NHD", 1, Level.SAMPLE), ("HND", 8, Level.FULL),
                               ("joined", 8, Level.SAMPLE), ("NHD", 1, Level.FULL)):
        c = Case(kind, 4, 96, heads, 64, dev)
        bl = BoardLane(copier, c)
        try:
            row: dict[str, Any] = {"layout": kind, "heads": heads, "level": level.value}
            gen, k, _ = bl.hold(level)
            p = bl.post(copier, stream, gen, level)
            p.wait()
            row["equal_says_none"] = p.mismatch == NO_MISMATCH and not p.failed()
            row["rows_compared"] = (p.compared, k)
            row["bytes_copied"] = bool(torch.equal(c._blocks(c.src, c.rids),
                                                   c._blocks(c.dst, c.lids)))
            gen2, _, flip = bl.hold(level, change=True)
            p = bl.post(copier, stream, gen2, level)
            p.wait()
            row["names_changed_word"] = p.mismatch == flip
            p = bl.post(copier, stream, 999_999, level)  # not shown on the board
            p.wait()
            row["unknown_generation_compares_nothing"] = (p.mismatch is None
                                                          and p.compared == 0
                                                          and not p.failed())
            p = bl.post(copier, stream, gen, level, n=c.rids.shape[0] - 1)  # rows of 64
            p.wait()
            row["other_shape_compares_nothing"] = p.mismatch is None and p.compared == 0
            # blocks picked at the other level: other rows than the hold's, so nothing is
            # compared (the host digests)
            other = Level.FULL if level is Level.SAMPLE else Level.SAMPLE
            p = bl.post(copier, stream, gen, other)
            p.wait()
            row["other_level_compares_nothing"] = p.mismatch is None and p.compared == 0
            # a source byte of the last block (checked at every level) changed after the
            # digest was fixed: what lands differs from the producer's rows
            last = int(c.rids[-1])
            if kind == "joined":
                c.src[0][last, 0].view(torch.int16).view(-1)[5] ^= 1
            else:
                c.src[0][0, last].view(torch.int16).view(-1)[5] ^= 1
            p = bl.post(copier, stream, gen, level)
            p.wait()
            row["changed_source_caught"] = p.mismatch not in (None, NO_MISMATCH)
            # and one in the last layer's instead: its segments are the grid's last rows of
            # units, the ones a change to the order the kernel takes units in moves first
            # (bench/results/gpu_session_5dc24ba/tail_swap/ moved their checked units)
            if kind == "joined":
                c.src[0][last, 0].view(torch.int16).view(-1)[5] ^= 1
                c.src[-1][last, 1].view(torch.int16).view(-1)[7] ^= 1
            else:
                c.src[0][0, last].view(torch.int16).view(-1)[5] ^= 1
                c.src[-1][1, last].view(torch.int16).view(-1)[7] ^= 1
            p = bl.post(copier, stream, gen, level)
            p.wait()
            row["changed_last_layer_caught"] = p.mismatch not in (None, NO_MISMATCH)
            row["ok"] = (row["bytes_copied"] and row["rows_compared"][0] == k
                         and all(v for key, v in row.items() if isinstance(v, bool)))
        finally:
            bl.close()
        out.append(row)
        print(row, flush=True)
    return out


def board_lane_timing(copier: BatchCopier, stream: Any, dev: Any) -> dict[str, Any]:
    """Device time alone of the 70B TP8-rank request (80 layers, 1 head, 256 blocks)
    through a plain lane and through a digest lane that finds its rows on the board
    (``sample`` and ``full``), with the device copy of the same bytes."""
    c = Case("NHD", 80, 300, 1, 256, dev)
    nbytes = 80 * 2 * 256 * c.unit
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    plain = copier.lane(np.array(c.sbase, dtype=np.uint64), np.array(c.dbase, dtype=np.uint64),
                        c.unit, (300, 300), c.smap, c.dmap)
    assert plain is not None
    bl = BoardLane(copier, c)
    try:
        gens = {level: bl.hold(level)[0] for level in (Level.SAMPLE, Level.FULL)}

        def timed(fn: Any) -> float:
            return device_us(fn, stream)

        res: dict[str, Any] = {
            "device_copy_us": timed(lambda: b.copy_(a)),
            "plain_lane_us": timed(lambda: copier.copy_lane(plain, c.rids, c.lids, stream,
                                                            None)),
        }
        for level, gen in gens.items():
            res[f"board_lane_{level.value}_us"] = timed(
                lambda g=gen, lv=level: bl.post(copier, stream, g, lv))  # type: ignore[misc]
            p = bl.post(copier, stream, gen, level)
            p.wait()
            res[f"board_lane_{level.value}_matched"] = (p.mismatch == NO_MISMATCH
                                                        and p.compared > 0)
        res["board_lane_unknown_us"] = timed(lambda: bl.post(copier, stream, 999_999,
                                                             Level.FULL))
        res["board_lane_unknown_sample_us"] = timed(lambda: bl.post(copier, stream, 999_999,
                                                                    Level.SAMPLE))
        for level in ("sample", "full"):
            res[f"ratio_board_lane_{level}_over_plain"] = (res[f"board_lane_{level}_us"]
                                                          / res["plain_lane_us"])
    finally:
        bl.close()
    print(res, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    copier = BatchCopier(dev)
    assert copier.computes_addresses, "the CUDA C kernel did not build"
    stream = torch.cuda.Stream(dev)
    equal = check_equal(copier, stream, dev)
    lanes = check_board_lanes(copier, stream, dev)
    lane_cost = board_lane_timing(copier, stream, dev)
    cost = timing(copier, stream, dev)
    ok = (all(r["ok"] for r in equal + lanes)
          and all(v for k, v in cost.items() if k.startswith(("full_digests", "compare_",
                                                              "straddling_", "regions_")))
          and all(v for k, v in lane_cost.items() if k.endswith("_matched")))
    write(args.out, "gpu_fused_digest_check.json", {"equal": equal, "board_lanes": lanes,
                                                    "board_lane_cost": lane_cost,
                                                    "cost": cost, "ok": ok})
    if not ok:
        sys.exit("FAILED")


if __name__ == "__main__":
    main()
