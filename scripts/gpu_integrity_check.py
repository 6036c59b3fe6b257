"""GPU check of the integrity digest (kvlink.integrity on CUDA caches), one GPU.

    python scripts/gpu_integrity_check.py [--out bench/results/gpu_integrity_check.json]

1. Equal: the fused kernel's digests (kvlink.integrity.kernel) equal the host's (numpy over a copy
   of the same bytes) and the torch per-plane path's, for K/V split NHD and HND caches, the
   packed ``(B, H, N, C)`` layout and a head slice; a range of layers taken later
   (``digest_later``, a layer-wise push's) equals those layers' digests, and launching it
   behind a stream busy for ~50 ms returns at once (the host does not wait for the stream), as
   does the same range digested into a landing board's digest area (page-locked, plane by
   plane: what a same-host decode reads there) and a consumer's check of landed bytes (its
   own stream), with the same values, and the consumer's check in one kernel
   (``Table.check``) agrees with the producer's digests and finds the flipped byte below;
   one flipped byte changes exactly the digest of its (block, layer, plane, head).
2. Cost: ``full`` and ``sample`` digests of the Llama-3-70B TP8-rank 4096-token request
   (80 layers, 1 KV head, 256 blocks of 16 tokens, bf16; 160 MiB) against one device copy of
   the same bytes, CUDA-event timed, median of 20.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from _common import write_result  # noqa: E402

from kvlink import integrity  # noqa: E402
from kvlink.integrity import Level, checked, compute, device, digest, spec_planes  # noqa: E402  # noqa: E402
from kvlink.layout import KVCacheSpec  # noqa: E402


def _layers(kind: str, layers: int, blocks: int, heads: int, tokens: int, dim: int,
            dev: str) -> list[Any]:
    g = torch.Generator(device=dev).manual_seed(7)
    out = []
    for _ in range(layers):
        if kind == "NHD":
            t = torch.randint(-2**15, 2**15, (2, blocks, tokens, heads, dim), dtype=torch.int16,
                              device=dev, generator=g).view(torch.bfloat16)
        elif kind == "HND":
            t = torch.randint(-2**15, 2**15, (2, blocks, heads, tokens, dim), dtype=torch.int16,
                              device=dev, generator=g).view(torch.bfloat16).transpose(2, 3)
        else:  # packed (B, H, N, 2D), LBHNC
            t = torch.randint(-2**15, 2**15, (blocks, heads, tokens, 2 * dim),
                              dtype=torch.int16, device=dev, generator=g).view(torch.bfloat16)
        out.append(t)
    return out


def _spec(kind: str, layers: list[Any]) -> KVCacheSpec:
    return KVCacheSpec.from_tensors(layers, kv_packed=kind == "packed", total_kv_heads=int(
        layers[0].shape[1] if kind == "packed" else layers[0].shape[3]))


def check_equal() -> list[dict[str, Any]]:
    rows = []
    for kind in ("NHD", "HND", "packed"):
        layers = _layers(kind, 4, 12, 4, 16, 64, "cuda")
        spec = _spec(kind, layers)
        ids = np.array([9, 2, 5, 11])
        planes = spec_planes(spec)  # (its digest table, built once: as a worker's)
        fused = digest(planes, ids)
        per_plane = np.stack([
            np.stack([device.torch_plane(v, ids, 0, 4) for v in row], axis=1)
            for row in spec_planes(spec)], axis=1)
        host_layers = [t.cpu() for t in layers]
        host = digest(spec_planes(_spec(kind, host_layers)), ids)
        sliced = digest(spec_planes(spec), ids, (1, 3))
        # a layer-wise push's range (kvlink.integrity.digest_later: layers [1, 3), launched
        # behind a busy stream, read later): the same values as the whole request's
        torch.cuda._sleep(50_000_000)  # (the stream busy: the host must not wait for it)
        t0 = time.perf_counter()
        later = integrity.digest_later(planes, ids, (1, 3))
        launch_ms = (time.perf_counter() - t0) * 1e3
        ranged = later.result()
        # the same range into a landing board's digest area (kvlink.landing: page-locked,
        # plane by plane), as a same-host push's ranges go: launched behind a busy stream,
        # the host not waiting; what the decode reads there, the same values
        into_ms, area_equal = _into_area(planes, ids, fused[:, 1:3])
        # a consumer's check of landed bytes (kvlink.integrity.compute.landed): on a stream of its
        # own, so a busy caller's stream (a forward in flight) is not waited for. Once first,
        # as a worker's first check: its stream and pinned buffers are made then (a first
        # pinned allocation may wait for the device: 28 ms behind the busy stream, once)
        compute.landed(planes, ids, (0, 4))
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        landed = compute.landed(planes, ids, (0, 4))
        landed_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        # the consumer's check in one kernel (kvlink.integrity.kernel.Table.check): agrees with the
        # producer's digests, whole and for a head slice, and finds the flipped byte below
        agrees = (device.checked_on_gpu(planes, ids, 0, fused) == (True, None)
                  and device.checked_on_gpu(planes, ids, 1, fused[..., 1:3])
                  == (True, None))
        # one flipped byte: layer 2, plane 0, block 5, head 3
        raw = layers[2].view(torch.int16)
        if kind == "packed":
            raw[5, 3, 7, 1] ^= 1
        elif kind == "NHD":
            raw[0, 5, 7, 3, 1] ^= 1
        else:
            raw[0, 5, 7, 3, 1] ^= 1  # the transposed view: (2, B, N, H, D) indices
        flipped = digest(spec_planes(spec), ids)
        changed = np.argwhere(flipped != fused).tolist()
        found = device.checked_on_gpu(planes, ids, 0, fused)
        # the same check with the digests as a landing board's area keeps them (plane by
        # plane: what a decode's end-of-push check hands the kernel as they are), then with
        # the flipped byte's digests: the kernel's reduction words, left by the check that
        # found it, serve the next one (they reset themselves: one launch a check)
        k, nl, per, nh = fused.shape
        by_plane = np.ascontiguousarray(fused.transpose(1, 2, 0, 3)).reshape(nl * per, k, nh)
        found_by_plane = device.checked_on_gpu(planes, ids, 0, by_plane, plane_major=True)
        agrees_after = device.checked_on_gpu(planes, ids, 0, flipped) == (True, None)
        repeats = [device.checked_on_gpu(planes, ids, 0, want)[1]
                   for want in (fused, flipped) * 20]
        repeats_ok = repeats == [(2, 2, 0, 3), None] * 20
        row = {"layout": kind, "fused_equals_host": bool(np.array_equal(fused, host)),
               "fused_equals_torch_per_plane": bool(np.array_equal(fused, per_plane)),
               "head_slice_equal": bool(np.array_equal(sliced, fused[..., 1:3])),
               "layer_range_later_equal": bool(np.array_equal(ranged, fused[:, 1:3])),
               "layer_range_launch_ms_behind_busy_stream": launch_ms,
               "layer_range_into_area_equal": area_equal,
               "layer_range_into_area_ms_behind_busy_stream": into_ms,
               "landed_check_equal": bool(np.array_equal(landed, fused)),
               "landed_check_ms_behind_busy_stream": landed_ms,
               "flip_changed": changed, "kernel_check_agrees": agrees,
               "kernel_check_found": list(found[1] or ()),
               "kernel_check_plane_major_found": list(found_by_plane[1] or ()),
               "kernel_check_agrees_after_a_mismatch": agrees_after,
               "kernel_check_40_alternating_ok": repeats_ok}
        row["ok"] = (row["fused_equals_host"] and row["fused_equals_torch_per_plane"]
                     and row["head_slice_equal"] and row["layer_range_later_equal"]
                     and launch_ms < 20 and row["landed_check_equal"] and landed_ms < 20
                     and area_equal and into_ms < 20
                     and changed == [[2, 2, 0, 3]] and agrees
                     and found == (True, (2, 2, 0, 3))
                     and found_by_plane == (True, (2, 2, 0, 3)) and agrees_after
                     and repeats_ok)
        print(row, flush=True)
        rows.append(row)
    return rows


def _into_area(planes: Any, ids: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    """``digest_later`` of layers [1, 3) into a real landing board's digest area, behind a
    stream busy for ~50 ms: (the call's ms, whether the prefill's Later and the decode's read
    of the area both equal ``want``)."""
    from kvlink import landing

    board = landing.LandingBoard.create()
    assert board is not None
    view = landing.LandingView.open(board.name, board.token)
    assert view is not None
    try:
        slot = board.take()
        assert slot is not None
        k, layers, per, heads = want.shape
        got = board.take_area(slot, 8 * (landing.AREA_HEAD + k + want.size))
        assert got is not None
        area = view.area(*got)
        assert area is not None and view.pin(), "the landing board could not be page-locked"
        tag = landing.tag_of(3)
        place = area.open(tag, ids, (layers, per, heads))
        assert place is not None
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        later = integrity.digest_later(planes, ids, (1, 3), into=place)
        ms = (time.perf_counter() - t0) * 1e3
        mine = later.result()
        read = board.digests(slot, tag)
        # (the decode reads them as the area keeps them: plane by plane)
        by_plane = want.transpose(1, 2, 0, 3).reshape(layers * per, k, heads)
        equal = (read is not None and np.array_equal(mine, want)
                 and np.array_equal(read[1], by_plane) and read[0].tolist() == ids.tolist())
        return ms, equal
    finally:
        torch.cuda.synchronize()
        view.close()
        board.close()


def _event_ms(fn: Any, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cost() -> dict[str, Any]:
    nb, req = 512, 256
    layers = _layers("NHD", 80, nb, 1, 16, 128, "cuda")
    spec = _spec("NHD", layers)
    planes = spec_planes(spec)
    ids = np.random.default_rng(1).permutation(nb)[:req]
    nbytes = 80 * 2 * req * 16 * 128 * 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _event_ms(lambda: dst.copy_(src))
    out: dict[str, Any] = {"bytes": nbytes, "device_copy_ms": copy_ms}
    for level in ("full", "sample"):
        sel = ids[checked(Level(level), "bench", ids)]
        ms = _event_ms(lambda sel=sel: digest(planes, sel))
        t0 = time.perf_counter()
        digest(planes, sel)
        wall = (time.perf_counter() - t0) * 1e3
        out[level] = {"blocks": int(sel.shape[0]), "digest_ms": ms, "wall_ms": wall,
                      "ratio_digest_over_copy": ms / copy_ms}
        print(f"{level}: {sel.shape[0]} blocks, digest {ms:.3f} ms (wall {wall:.3f}) vs device "
              f"copy {copy_ms:.3f} ms of the request's {nbytes / 2**20:.0f} MiB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/gpu_integrity_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    rows = check_equal()
    c = cost()
    ok = all(r["ok"] for r in rows)
    write_result("gpu_integrity_check", {"device_name": torch.cuda.get_device_name(0),
                                         "equal": rows, "cost": c, "ok": ok}, args.out)
    if not ok:
        sys.exit("FAILED: digests differ between paths")


if __name__ == "__main__":
    main()
