"""CPU all-reduce latency: kvlink's shared-memory all-reduce vs gloo, same run, same machine.

    python bench/allreduce_cpu.py                       # world 2 and 4, bf16, 1 KiB .. 8 MiB
    python bench/allreduce_cpu.py --world 2 --dtype float32 --rounds 9

Each size is measured in interleaved rounds (gloo, shm auto, shm one-shot, shm two-shot, then
again), so slow drift on a shared machine hits every backend alike; a round's latency is the
slowest rank's mean per call, the reported figure is the median over rounds, and the ratio is the
median of per-round ratios. Iteration counts are chosen by rank 0 and broadcast (every rank must
make the same calls). Writes bench/results/allreduce_cpu.json (command, machine, date, raw
numbers) and prints the 128 KiB ratio (goal: >= 5x faster than gloo) plus the size where two-shot
starts to win, for kvlink/allreduce/config.py's CPU table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KiB = 1024
MiB = 1024 * KiB
DEFAULT_SIZES = [1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 128 * KiB, 512 * KiB, 2 * MiB, 8 * MiB]
BACKENDS = ("gloo", "shm", "shm_one_shot", "shm_two_shot")
HEADLINE = 128 * KiB


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        from kvlink.allreduce import AllReduceConfig, ShmAllReduce

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        dtype = getattr(torch, args["dtype"])
        shm = ShmAllReduce(config=AllReduceConfig(max_bytes=max(args["sizes"])))

        def call(backend: str, x: torch.Tensor, y: torch.Tensor) -> None:
            if backend == "gloo":
                dist.all_reduce(x)
            elif backend == "shm":
                shm.all_reduce(x, out=y)
            elif backend == "shm_one_shot":
                shm.all_reduce(x, out=y, mode="one_shot")
            else:
                shm.all_reduce(x, out=y, mode="two_shot")

        rows = []
        for nbytes in args["sizes"]:
            n = nbytes // torch.empty((), dtype=dtype).element_size()
            x = torch.ones(n, dtype=dtype)
            y = torch.empty_like(x)
            iters: dict[str, int] = {}
            for b in BACKENDS:  # warm up, and let rank 0 size the rounds (~target_s each)
                for _ in range(3):
                    call(b, x, y)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(5):
                    call(b, x, y)
                per = (time.perf_counter() - t0) / 5
                iters[b] = max(3, min(2000, int(args["target_s"] / max(per, 1e-7))))
            box = [iters]
            dist.broadcast_object_list(box, src=0)
            iters = box[0]
            samples: dict[str, list[float]] = {b: [] for b in BACKENDS}
            per_call: dict[str, list[float]] = {b: [] for b in BACKENDS}
            clock = time.perf_counter
            for _ in range(args["rounds"]):
                for b in BACKENDS:
                    dist.barrier()
                    calls = per_call[b]
                    t0 = clock()
                    for _ in range(iters[b]):
                        t = clock()
                        call(b, x, y)
                        calls.append(clock() - t)
                    mine = (clock() - t0) / iters[b]
                    everyone: list[Any] = [None] * world
                    dist.all_gather_object(everyone, mine)
                    samples[b].append(max(everyone))
            p50 = {b: statistics.median(v) for b, v in per_call.items()}
            p50s: list[Any] = [None] * world
            dist.all_gather_object(p50s, p50)
            rows.append(
                {
                    "bytes": nbytes,
                    "elements": n,
                    "iters": iters,
                    "samples_s": samples,
                    "per_call_p50_us": {b: max(r[b] for r in p50s) * 1e6 for b in BACKENDS},
                }
            )
        shm.close()
        result: dict[str, Any] = {"ok": True, "rows": rows}
    except BaseException:
        result = {"ok": False, "traceback": traceback.format_exc()}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    os._exit(0)


def run_world(world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    out = Path(args["tmp"]) / f"world{world}.json"
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, args, str(out)), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args["deadline_s"])
    for p in procs:
        if p.exitcode is None:
            p.kill()
    result = json.loads(out.read_text()) if out.exists() else {"ok": False, "traceback": "none"}
    if not result["ok"]:
        raise SystemExit(f"world {world} failed:\n{result['traceback']}")
    rows: list[dict[str, Any]] = result["rows"]
    for row in rows:
        s = row["samples_s"]
        row["median_us"] = {b: statistics.median(v) * 1e6 for b, v in s.items()}
        row["ratio_gloo_over_shm"] = statistics.median(
            g / k for g, k in zip(s["gloo"], s["shm"], strict=True)
        )
        p50 = row["per_call_p50_us"]
        row["ratio_p50_gloo_over_shm"] = p50["gloo"] / p50["shm"]
        row["ratio_two_over_one_shot"] = statistics.median(
            t / o for t, o in zip(s["shm_two_shot"], s["shm_one_shot"], strict=True)
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="bytes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-s", type=float, default=0.05, help="seconds per round and backend")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "allreduce_cpu.json"))
    opts = ap.parse_args()
    load_start = os.getloadavg()  # the machine is shared: record how busy it was
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args = {
            "dtype": opts.dtype,
            "sizes": sorted(opts.sizes),
            "rounds": opts.rounds,
            "target_s": opts.target_s,
            "tmp": tmp,
            "deadline_s": 600.0,
        }
        worlds = {}
        for world in opts.world:
            t0 = time.time()
            rows = run_world(world, args)
            worlds[str(world)] = {"rows": rows, "seconds": round(time.time() - t0, 1)}
            print(f"world {world} ({opts.dtype}), per-call latency in us (median of rounds):")
            cols = ("bytes", "gloo", "shm", "1-shot", "2-shot", "gloo/shm", "p50 ratio")
            print("  " + " ".join(f"{c:>9}" for c in cols))
            for r in rows:
                m = r["median_us"]
                print(
                    f"  {r['bytes']:>9} {m['gloo']:>10.1f} {m['shm']:>9.1f} "
                    f"{m['shm_one_shot']:>9.1f} {m['shm_two_shot']:>9.1f} "
                    f"{r['ratio_gloo_over_shm']:>8.1f}x {r['ratio_p50_gloo_over_shm']:>8.1f}x"
                )
    headline = {}
    suggested = {}
    for world, data in worlds.items():
        rows = data["rows"]
        head = [r for r in rows if r["bytes"] == HEADLINE]
        if head:
            headline[world] = {
                "bytes": HEADLINE,
                "gloo_us": head[0]["median_us"]["gloo"],
                "shm_us": head[0]["median_us"]["shm"],
                "ratio": head[0]["ratio_gloo_over_shm"],
                "gloo_p50_us": head[0]["per_call_p50_us"]["gloo"],
                "shm_p50_us": head[0]["per_call_p50_us"]["shm"],
                "ratio_p50": head[0]["ratio_p50_gloo_over_shm"],
                "goal_ratio": 5.0,
                "meets_goal": head[0]["ratio_gloo_over_shm"] >= 5.0,
            }
        one_shot_ok = [r["bytes"] for r in rows if r["ratio_two_over_one_shot"] >= 1.0]
        suggested[world] = max(one_shot_ok) if one_shot_ok else 0
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": opts.dtype,
        "method": "interleaved rounds; round latency = slowest rank's mean per call; "
        "reported = median over rounds; ratio = median of per-round gloo/shm; also per-call "
        "p50 (slowest rank's median call) and its ratio, which ignores scheduler tails",
        "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()},
        "headline_128KiB": headline,
        "suggested_cpu_one_shot_max_bytes": suggested,
        "worlds": worlds,
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(doc, indent=2) + "\n")
    for world, h in headline.items():
        print(
            f"128 KiB, world {world}: gloo {h['gloo_us']:.1f} us, shm {h['shm_us']:.1f} us, "
            f"shm is {h['ratio']:.1f}x faster (goal >= 5x); per-call p50 {h['gloo_p50_us']:.1f} "
            f"vs {h['shm_p50_us']:.1f} us = {h['ratio_p50']:.1f}x"
        )
    print(f"suggested CPU one-shot max bytes by world: {suggested}")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
