"""GPU check of the factored copy (``BatchCopier.copy_runs`` / ``kv_move_runs``), one process.

    python scripts/gpu_runs_check.py [--out DIR]

A 70B-TP8-rank-shaped request (160 segments of 256 blocks of 4 KiB, decode ids in shuffled runs
of 1-8) copied by ``copy_runs`` from random bytes into a zeroed buffer, compared byte for byte
with the same extents applied on the host (``Runs.expand``); a second copy whose source base is
outside the registered region must come back failed with nothing written; and the timing of
the forms of the same copy (``copy`` of the expanded extents from pinned records, ``copy_runs``
with its table passed with the launch and, forced, uploaded first, and ``copy_lane``: a
``kvlink.gpu.lane.Lane`` bound once, given the block ids) against one device copy of the same
bytes, CUDA events, same run; each form's host time too. Every table form and the lane are
checked byte for byte and for the refusal (the lane's bases translated at bind, the refused
lane's not: its kernel looks each unit up). The lane copies the copier timed on the device
itself (``device_times``: what cuda_ipc expects a copy to take) must agree with the CUDA events
around the same copies within 0.8-1.25x. Writes gpu_runs_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlink import native
from kvlink.gpu.copy import BatchCopier, RegionMap
from kvlink.transport import Runs

SEGS, NB, UNIT, N = 160, 600, 4096, 256


def _ids(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(decode ids in shuffled runs of 1-8, prefill ids): the request's blocks."""
    cuts = np.cumsum(rng.integers(1, 9, size=N))
    pieces = np.split(np.arange(N), cuts[cuts < N])
    lids = np.concatenate([pieces[k] for k in rng.permutation(len(pieces))]) + 100
    return lids.astype(np.int64), (np.arange(N) + 7).astype(np.int64)


def _runs(src: int, dst: int, rng: np.random.Generator, coalesce: bool = True) -> Runs:
    """The request's table: decode ids in shuffled runs of 1-8, one run per block unless
    ``coalesce`` (then adjacent blocks on both sides are one run)."""
    lids, rids = _ids(rng)
    if coalesce:
        edge = np.ones(N + 1, dtype=bool)
        edge[1:N] = (np.diff(lids) != 1) | (np.diff(rids) != 1)
        at = edge.nonzero()[0]
    else:
        at = np.arange(N + 1)
    starts, lens = at[:-1], np.diff(at).astype(np.uint64) * np.uint64(UNIT)
    seg = np.arange(SEGS, dtype=np.uint64) * np.uint64(NB * UNIT)
    return Runs(np.uint64(dst) + seg, np.uint64(src) + seg,
                lids[starts].astype(np.uint64) * np.uint64(UNIT),
                rids[starts].astype(np.uint64) * np.uint64(UNIT), lens, SEGS * N)


def _table(r: Runs) -> np.ndarray:  # READ: source = remote side, destination = local side
    return np.concatenate([r.remote_base, r.local_base, r.remote_at, r.local_at, r.lens])


def buffers(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, RegionMap, RegionMap,
                                         BatchCopier, torch.cuda.Stream]:
    """Random source and zeroed destination of SEGS x NB blocks, their region maps, a copier
    with the CUDA C kernel and a side stream (shared with gpu_copy_units_probe.py)."""
    nbytes = SEGS * NB * UNIT
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    sp, dp = src.data_ptr(), dst.data_ptr()
    smap = RegionMap([sp], [sp + nbytes], [0], dev)
    dmap = RegionMap([dp], [dp + nbytes], [0], dev)
    copier = BatchCopier(dev)
    assert copier.computes_addresses, "the CUDA C kernel did not build"
    return src, dst, smap, dmap, copier, torch.cuda.Stream(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    nbytes = SEGS * NB * UNIT
    src, dst, smap, dmap, copier, stream = buffers(dev)
    sp, dp = src.data_ptr(), dst.data_ptr()
    runs = _runs(sp, dp, np.random.default_rng(0))
    flat = runs.expand()
    want = np.zeros(nbytes, dtype=np.uint8)
    host_src = src.cpu().numpy()
    for (la, ln), (ra, _) in zip(flat.local.tolist(), flat.remote.tolist(), strict=True):
        want[la - dp:la - dp + ln] = host_src[ra - sp:ra - sp + ln]
    out: dict[str, object] = {"extents": runs.descriptors, "bytes": runs.nbytes,
                              "table_words": int(_table(runs).shape[0])}
    cuda = copier._cuda  # the table travels with the launch, then (forced) uploaded
    assert cuda is not None and cuda.table_class(int(_table(runs).shape[0]))
    for form in ("with_launch", "uploaded"):
        cuda._no_tables = "" if form == "with_launch" else "forced by gpu_runs_check"
        dst.zero_()
        p = copier.copy_runs(_table(runs), SEGS, int(runs.lens.shape[0]), smap, dmap, stream)
        p.wait()
        out[f"{form}_failed"] = p.failed()
        out[f"{form}_verified"] = bool(np.array_equal(dst.cpu().numpy(), want))
        # refused: a source base outside the registered region; nothing may be written
        dst.zero_()
        bad = Runs(runs.local_base, runs.remote_base + np.uint64(nbytes), runs.local_at,
                   runs.remote_at, runs.lens, runs.raw_descriptors)
        p = copier.copy_runs(_table(bad), SEGS, int(bad.lens.shape[0]), smap, dmap, stream)
        p.wait()
        out[f"{form}_refused_failed"] = p.failed()
        out[f"{form}_refused_wrote_nothing"] = not bool(dst.any().item())
    cuda._no_tables = ""
    lids, rids = _ids(np.random.default_rng(0))  # the same blocks as ``runs``
    lane = copier.lane(runs.remote_base, runs.local_base, UNIT, (NB, NB), smap, dmap)
    assert lane is not None and lane.fits(N)
    dst.zero_()
    p = copier.copy_lane(lane, rids, lids, stream, None)
    p.wait()
    out["lane_failed"] = p.failed()
    out["lane_verified"] = bool(np.array_equal(dst.cpu().numpy(), want))
    # lanes launch through the C launcher where it builds (kvlink.native); the ctypes
    # launch it replaces, for the same lane, byte for byte
    launcher = cuda.launcher
    out["lane_launcher"] = "native" if launcher is not None else f"ctypes ({native.why_not()})"
    if launcher is not None:  # the ids as a scheduler hands them over: lists, converted in C
        dst.zero_()
        p = copier.copy_lane(lane, rids.tolist(), lids.tolist(), stream, None)
        p.wait()
        out["lane_lists_failed"] = p.failed()
        out["lane_lists_verified"] = bool(np.array_equal(dst.cpu().numpy(), want))
    cuda.launcher = None
    dst.zero_()
    p = copier.copy_lane(lane, rids, lids, stream, None)
    p.wait()
    out["lane_ctypes_failed"] = p.failed()
    out["lane_ctypes_verified"] = bool(np.array_equal(dst.cpu().numpy(), want))
    cuda.launcher = launcher
    dst.zero_()
    far = copier.lane(runs.remote_base + np.uint64(nbytes), runs.local_base, UNIT, (NB, NB),
                      smap, dmap)
    assert far is not None
    p = copier.copy_lane(far, rids, lids, stream, None)
    p.wait()
    out["lane_refused_failed"] = p.failed()
    out["lane_refused_wrote_nothing"] = not bool(dst.any().item())
    # the lane translated its bases at bind (no lookup on the device); the one whose bases
    # lie past the region could not, and its kernel looked each unit up and refused it
    out["lane_translated"] = lane.translated
    out["far_lane_not_translated"] = not far.translated
    # the kernel takes the ids themselves: one past a side's block count is refused there —
    # the post fails and that block pair is not copied (the others may be): id NB of segment s
    # is block 0 of segment s + 1, which no other pair writes (the decode ids start at 100)
    # and whose source no other pair reads (the prefill ids start at 7)
    head = dst.view(SEGS, NB * UNIT)[:, :UNIT]
    for side in ("src", "dst"):
        dst.zero_()
        bad_src, bad_dst = rids.copy(), lids.copy()
        (bad_src if side == "src" else bad_dst)[-1] = NB
        p = copier.copy_lane(lane, bad_src, bad_dst, stream, None)
        p.wait()
        untouched = (not bool(dst.view(SEGS, NB * UNIT)[:, lids[-1] * UNIT:(lids[-1] + 1)
                                                       * UNIT].any().item())
                     if side == "src" else not bool(head.any().item()))
        others = bool(dst.view(SEGS, NB * UNIT)[:, lids[0] * UNIT].any().item())
        out[f"lane_{side}_id_refused"] = p.failed() and untouched and others
    # a mark after the copies enqueued so far (what a let-go hold board waits for before it
    # is unregistered): not passed while a copy before it still runs, passed once it ended
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # (~25 ms: the copy below queues behind it)
    p = copier.copy_lane(lane, rids, lids, stream, None)
    mark = copier.mark(stream)
    out["mark_waits_for_the_copy"] = not copier.passed(mark) and not p.done()
    p.wait()
    stream.synchronize()
    out["mark_passed_after_it"] = copier.passed(mark)
    # a lane's copy ends when its kernel's last block marks the end word in its status buffer
    # (no event): polled without any sync until done() says so, its bytes must all be there
    # for work enqueued next on another stream (the default one here; the copy's stream is
    # not synchronised with it)
    dst.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # (~10 ms: the poll sees it running first)
    p = copier.copy_lane(lane, rids, lids, stream, None)
    looks = 0
    while not p.done():
        looks += 1
    got = dst.cpu().numpy()  # (a copy on the default stream)
    out["lane_end_word"] = {"event": p.event, "marked": p.end is not None, "looks": looks,
                            "failed": p.failed(), "verified": bool(np.array_equal(got, want))}
    copier.device_times()  # (the copies above: each behind a sleep or checked, not timed)
    # timing: copy of the expanded pinned records vs copy_runs vs a device copy, same bytes
    kinds = ("copy_expanded", "copy_runs", "copy_runs_uploaded", "copy_lane",
             "copy_lane_ctypes", "device_copy")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    times.update({f"host_{k}_us": [] for k in kinds[:5]})
    flat_src = torch.empty(runs.nbytes, dtype=torch.uint8, device=dev)
    for i in range(60):
        for kind in kinds:
            cuda._no_tables = "forced by gpu_runs_check" if kind.endswith("uploaded") else ""
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.synchronize()
            t0 = time.perf_counter()
            a.record(stream)
            if kind == "copy_expanded":
                ext = runs.expand(copier.host_extents)
                p = copier.copy(ext.remote, smap, ext.local, dmap, stream)
            elif kind.startswith("copy_lane"):
                cuda.launcher = None if kind.endswith("ctypes") else launcher
                p = copier.copy_lane(lane, rids, lids, stream, None)
                cuda.launcher = launcher
            elif kind.startswith("copy_runs"):
                p = copier.copy_runs(_table(runs), SEGS, int(runs.lens.shape[0]), smap, dmap,
                                     stream)
            else:
                with torch.cuda.stream(stream):
                    flat_src.copy_(src[:runs.nbytes])
                p = None
            host = time.perf_counter() - t0
            b.record(stream)
            b.synchronize()
            if p is not None:
                p.wait()
                assert not p.failed()
                times[f"host_{kind}_us"].append(host * 1e6)
            if i >= 10:
                times[kind].append(a.elapsed_time(b) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    out["median_us"] = med
    # the lane copies the copier timed itself on the device (the first five, then one in 32:
    # what cuda_ipc expects its copies to take, ends_in), against the same copies' CUDA
    # events above
    timed = copier.device_times()
    out["lane_device_times"] = {
        "n": len(timed), "bytes": sorted({b for b, _ in timed}),
        "median_us": statistics.median(s for _, s in timed) * 1e6 if timed else None}
    out["ratio_device_copy_over_copy_runs"] = med["device_copy"] / med["copy_runs"]
    out["ratio_device_copy_over_copy_expanded"] = med["device_copy"] / med["copy_expanded"]
    out["ratio_device_copy_over_copy_lane"] = med["device_copy"] / med["copy_lane"]
    out["ratio_device_copy_over_copy_lane_ctypes"] = (med["device_copy"]
                                                      / med["copy_lane_ctypes"])
    print(json.dumps(out, indent=1))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _common import write_result  # command, machine, date

    write_result("gpu_runs_check", {"device_name": torch.cuda.get_device_name(dev), **out},
                 str(Path(args.out) / "gpu_runs_check.json"))
    forms = ("with_launch", "uploaded", "lane", "lane_ctypes")
    ok = all(out[f"{f}_{k}"] for f in forms for k in ("verified", "refused_failed",
                                                      "refused_wrote_nothing")
             if f"{f}_{k}" in out) and out["lane_ctypes_verified"] and out.get(
        "lane_lists_verified", True) and not out.get("lane_lists_failed") and bool(
        out["mark_waits_for_the_copy"]) and bool(out["mark_passed_after_it"]) and not any(
        out[f"{f}_failed"] for f in forms) and all(out[f"lane_{s}_id_refused"]
                                                    for s in ("src", "dst")) and bool(
        out["lane_translated"]) and bool(out["far_lane_not_translated"])
    end = out["lane_end_word"]
    assert isinstance(end, dict)
    ok = ok and end["event"] == 0 and end["marked"] and end["looks"] > 0 and not end[
        "failed"] and end["verified"]
    dt = out["lane_device_times"]
    assert isinstance(dt, dict)
    if launcher is not None:  # (lanes time their copies through the C launcher only)
        ok = ok and dt["n"] > 0 and dt["bytes"] == [runs.nbytes] and (
            0.8 <= dt["median_us"] / med["copy_lane"] <= 1.25)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
