"""GPU check of the landing signal (kvlink.landing, ``kv_signal``): the device moves a landing
flag in host shared memory only after the copy's bytes are there, only after the caller's
stream, never for a copy that refused an extent, and never out of its chain. One process.

    python scripts/gpu_landing_check.py [--out DIR]

A decode's landing board (/dev/shm) mapped again the way a prefill maps it, page-locked for
the device (``cuMemHostRegister``), then through ``BatchCopier.copy`` / ``copy_runs``:

1. 256 MiB copied with a signal, after a 50 ms kernel on the caller's stream: the flag must not
   move before that kernel ends (checked at 20 ms), must move once the copy is done, and the
   destination must equal the source when the host first sees it move;
2. the flag's latency: host time from the post to the flag seen (spinning), for a 4 MiB copy,
   against the same copy's completion event seen by ``query()`` in the same loop;
3. a copy that refuses an extent (outside the destination map): failed, flag unchanged;
4. a signal whose ``expect`` is not the flag (a range before it never landed): unchanged;
5. through a lane (``copy_lane``, the C launcher where it builds: how a whole push posts
   since 2026-12-06): the flag moved, and already moved when the copy is seen done (the
   signal comes before the end mark), the bytes there; a lane post the device refuses (a
   block id past the destination's count): failed, flag unchanged.
Writes gpu_landing_check.json; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_common import write

from kvlink import landing
from kvlink.gpu import ipc
from kvlink.gpu.copy import BatchCopier, RegionMap
from kvlink.transport import make_extents


def _flag(board: landing.LandingBoard, slot: int) -> int:
    return int(board._slots[slot, 0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    board = landing.LandingBoard.create()
    assert board is not None, "no /dev/shm"
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    ipc.ensure_context(0)
    base = ipc.host_register(view.base, view.nbytes)
    copier = BatchCopier(dev)
    assert copier.computes_addresses, "the CUDA C kernel did not build"
    stream = torch.cuda.Stream(dev)
    caller = torch.cuda.current_stream(dev)
    out: dict[str, object] = {"registered_device_pointer_equals_host": base == view.base}
    slot = board.take()
    assert slot is not None
    tag = landing.tag_of(424242)
    view.start(slot, tag, landing.Hold(0, 0, None))

    def sig(start: int, stop: int) -> tuple[int, int, int]:
        s = view.signal(slot, tag, start, stop)
        return base + s.offset, s.expect, s.value

    # 1. ordering after the caller's stream, bytes before the flag
    n = 256 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    smap = RegionMap([src.data_ptr()], [src.data_ptr() + n], [0], dev)
    dmap = RegionMap([dst.data_ptr()], [dst.data_ptr() + n], [0], dev)
    chunk = 4 << 20
    starts = np.arange(0, n, chunk, dtype=np.uint64)
    lens = np.full(starts.shape, chunk, dtype=np.uint64)
    s_ext = make_extents(np.uint64(src.data_ptr()) + starts, lens)
    d_ext = make_extents(np.uint64(dst.data_ptr()) + starts, lens)
    warm = landing.value(tag, 0)  # the signal kernel compiled (NVRTC) before anything timed
    p = copier.copy(s_ext[:1], smap, d_ext[:1], dmap, stream, None, (base + view.offset(slot),
                                                                   warm, warm))
    p.wait()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on an H200 (1e9 cycles ran ~0.5 s)
    p = copier.copy(s_ext, smap, d_ext, dmap, stream, caller.cuda_stream, sig(0, 1))
    out["post_returned_after_s"] = time.perf_counter() - t0
    while time.perf_counter() - t0 < 0.02:
        pass
    out["flag_unmoved_while_caller_stream_busy"] = _flag(board, slot) == landing.value(tag, 0)
    while _flag(board, slot) != landing.value(tag, 1):
        assert time.perf_counter() - t0 < 10, "the flag never moved"
    seen = time.perf_counter() - t0
    out["flag_seen_after_s"] = seen
    out["bytes_there_when_flag_seen"] = bool(torch.equal(src, dst))
    p.wait()
    out["copy_ok"] = not p.failed()

    # 2. latency of the flag against the completion event, 4 MiB
    m = 4 << 20
    s4 = make_extents(np.array([src.data_ptr()], dtype=np.uint64),
                      np.array([m], dtype=np.uint64))
    d4 = make_extents(np.array([dst.data_ptr()], dtype=np.uint64),
                      np.array([m], dtype=np.uint64))
    flag_us, event_us = [], []
    for i in range(60):
        lo = 1 + i
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = copier.copy(s4, smap, d4, dmap, stream, None, sig(lo, lo + 1))
        ev = p.completion_event()
        got_flag = got_event = 0.0
        while not (got_flag and got_event):
            now = time.perf_counter()
            if not got_flag and _flag(board, slot) == landing.value(tag, lo + 1):
                got_flag = now - t0
            if not got_event and ev.query():
                got_event = now - t0
            assert now - t0 < 5, "a 4 MiB copy did not end"
        if i >= 10:
            flag_us.append(got_flag * 1e6)
            event_us.append(got_event * 1e6)
        p.wait()
    out["median_us_post_to_flag_seen"] = statistics.median(flag_us)
    out["median_us_post_to_event_seen"] = statistics.median(event_us)
    last = 61

    # 3. a refused copy moves nothing
    before = _flag(board, slot)
    bad = make_extents(np.array([dst.data_ptr() + n], dtype=np.uint64),
                       np.array([m], dtype=np.uint64))
    p = copier.copy(s4, smap, bad, dmap, stream, None, sig(last, last + 1))
    p.wait()
    out["refused_copy_failed"] = p.failed()
    out["refused_copy_left_flag"] = _flag(board, slot) == before

    # 4. out of chain: expects layer `last + 5`, the flag shows `last`
    p = copier.copy(s4, smap, d4, dmap, stream, None, sig(last + 5, last + 6))
    p.wait()
    out["out_of_chain_left_flag"] = _flag(board, slot) == before

    # 5. a lane's post with its signal (a whole push's WRITE), then one the device refuses
    unit = 64 << 10
    blocks = n // unit
    lane = copier.lane(np.array([src.data_ptr()], dtype=np.uint64),
                       np.array([dst.data_ptr()], dtype=np.uint64), unit, (blocks, blocks),
                       smap, dmap)
    assert lane is not None, "no lane here"
    dst.zero_()
    ids = np.random.default_rng(5).permutation(blocks)[:64].astype(np.int64)
    torch.cuda.synchronize()
    p = copier.copy_lane(lane, ids, ids, stream, None, signal=sig(last, last + 1))
    while not p.done():
        pass
    out["lane_flag_moved_when_done"] = _flag(board, slot) == landing.value(tag, last + 1)
    p.wait()
    out["lane_copy_ok"] = not p.failed()
    want = src.view(blocks, unit)[torch.as_tensor(ids, device=dev)]
    out["lane_bytes_there"] = bool(torch.equal(dst.view(blocks, unit)[
        torch.as_tensor(ids, device=dev)], want))
    out["lane_through_c_launcher"] = bool(copier.takes_lists)
    far = ids.copy()
    far[3] = blocks + 7  # past the destination's count: refused on the device
    p = copier.copy_lane(lane, ids, far, stream, None, signal=sig(last + 1, last + 2))
    p.wait()
    out["lane_refused_failed"] = p.failed()
    out["lane_refused_left_flag"] = _flag(board, slot) == landing.value(tag, last + 1)
    torch.cuda.synchronize()
    ipc.host_unregister(view.base)
    view.close()
    board.close()
    checks = ("flag_unmoved_while_caller_stream_busy", "bytes_there_when_flag_seen", "copy_ok",
              "refused_copy_failed", "refused_copy_left_flag", "out_of_chain_left_flag",
              "lane_flag_moved_when_done", "lane_copy_ok", "lane_bytes_there",
              "lane_refused_failed", "lane_refused_left_flag")
    out["passed"] = all(bool(out[k]) for k in checks)
    for k, v in out.items():
        print(f"{k}: {v}")
    write(args.out, "gpu_landing_check.json", out)
    sys.exit(0 if out["passed"] else 1)


if __name__ == "__main__":
    main()
