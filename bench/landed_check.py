"""A consumer's integrity check of landed bytes on one GPU: its host time per check.

    python bench/landed_check.py [--reps 50] [--out bench/results/landed_check.json]

What a decode pays, with integrity on, on the poll that ends a push (or a READ whose digests
were not compared by its copy kernel): ``kvlink.integrity.compute.landed`` — the digests of the
blocks that landed, on a stream of its own, waited for — for the Llama-3-70B TP8-rank
4096-token request (80 layers, 1 KV head, 256 blocks of 16 tokens, bf16: 160 MiB), at
``sample``'s blocks and at ``full``'s. Wall time per check (median of ``--reps``, after a
warm-up), and the same check while another stream of this process is busy (the caller's
forward: it must not be waited for); the baseline measured in the same run: a device copy of
the request's 160 MiB (CUDA events) and ``integrity.digest`` of the same blocks on the
caller's stream; and the check as a decode makes it now, in one kernel that digests and
compares (``kvlink.integrity.device.checked_on_gpu``). Values are checked equal to ``digest``'s.
``--cold``: each check after a sweep of the host's caches (bench/_common.sweep). JSON with
command, machine, date.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import sweep, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cold", action="store_true",
                    help="before each timed check, a pass over 32 MiB and a burst of Python "
                         "objects (bench/_common.sweep: what a serving loop runs between two "
                         "checks), so each check meets cold caches as in a serving decode")
    args = ap.parse_args()
    import torch

    from kvlink.integrity import Level, checked, compute, device, digest, spec_planes
    from kvlink.layout import KVCacheSpec

    nb, req = 512, 256
    layers = [torch.randint(-2**15, 2**15, (2, nb, 16, 1, 128), dtype=torch.int16,
                            device="cuda").view(torch.bfloat16) for _ in range(80)]
    spec = KVCacheSpec.from_tensors(layers, total_kv_heads=1)
    planes = spec_planes(spec)
    ids = np.random.default_rng(1).permutation(nb)[:req].astype(np.int64)
    nbytes = 80 * 2 * req * 16 * 128 * 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy_ms() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        return float(a.elapsed_time(b))

    def wall_us(fn: Any, busy: bool = False) -> list[float]:
        fn()  # warm: buffers, streams, parameters
        out = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(20_000_000)  # the caller's stream busy (~10 ms)
            if args.cold:
                sweep()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return out

    copy = statistics.median(copy_ms() for _ in range(args.reps))
    res: dict[str, Any] = {"device_copy_ms": copy, "bytes": nbytes}
    for level in ("sample", "full"):
        sel = ids[checked(Level(level), "bench", ids)]
        equal = bool(np.array_equal(compute.landed(planes, sel, (0, 1)),
                                    digest(planes, sel)))
        landed = wall_us(lambda sel=sel: compute.landed(planes, sel, (0, 1)))
        busy = wall_us(lambda sel=sel: compute.landed(planes, sel, (0, 1)), busy=True)
        plain = wall_us(lambda sel=sel: digest(planes, sel))
        want = digest(planes, sel)
        kernel_ok = device.checked_on_gpu(planes, sel, 0, want) == (True, None)
        kernel = wall_us(lambda sel=sel, want=want: device.checked_on_gpu(
            planes, sel, 0, want))
        row = {"blocks": int(sel.shape[0]), "values_equal_digest": equal,
               "landed_check_us_median": statistics.median(landed),
               "landed_check_us_p90": float(np.percentile(landed, 90)),
               "landed_check_behind_busy_stream_us_median": statistics.median(busy),
               "digest_on_callers_stream_us_median": statistics.median(plain),
               "kernel_check_agrees": kernel_ok,
               "kernel_check_us_median": statistics.median(kernel),
               "kernel_check_us_p90": float(np.percentile(kernel, 90))}
        row["landed_over_device_copy"] = row["landed_check_us_median"] / (copy * 1e3)
        res[level] = row
        print(f"{level}: {row['blocks']} blocks, values equal {equal}: check "
              f"{row['landed_check_us_median']:.1f} us (p90 {row['landed_check_us_p90']:.1f}; "
              f"behind a busy stream {row['landed_check_behind_busy_stream_us_median']:.1f}), "
              f"digest on the caller's stream {row['digest_on_callers_stream_us_median']:.1f} "
              f"us; the check in one kernel {row['kernel_check_us_median']:.1f} us (p90 "
              f"{row['kernel_check_us_p90']:.1f}, agrees {kernel_ok}); device copy of the "
              f"request {copy * 1e3:.1f} us", flush=True)
    res["ok"] = all(res[lv]["values_equal_digest"] and res[lv]["kernel_check_agrees"]
                    for lv in ("sample", "full"))
    write_result("landed_check", {
        "what": "a consumer's integrity check of landed bytes (kvlink.integrity.compute.landed), "
                "wall us per check, 70B TP8-rank 4096-token request, sample and full blocks",
        "device": torch.cuda.get_device_name(), "reps": args.reps, "cold": args.cold, **res},
        args.out)


if __name__ == "__main__":
    main()
