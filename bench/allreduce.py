"""GPU all-reduce latency per size: custom one-/two-shot vs torch symm-mem vs NCCL, eager and graph.

    python3 bench/allreduce.py --nproc 2                  # spawns one process per GPU
    torchrun --nproc-per-node 8 bench/allreduce.py        # or under torchrun

Sizes 16 B .. 8 MiB (bf16 by default). For each size and backend: eager latency (CUDA events
around ``iters`` back-to-back calls) and CUDA-graph latency (``graph_calls`` calls captured in one
graph, replayed ``replays`` times); the per-rank figures are gathered and the slowest rank's is
reported. Every backend's result is checked once per size against NCCL's (and the two custom modes
against each other, bit for bit). NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NCCL_NVLS_ENABLE=0). Writes bench/results/allreduce_<N>gpu.json (or $OUT/...) with the command,
machine, date, raw numbers and ``suggested_one_shot_max_bytes``: the largest size at which custom
one-shot is still no slower than two-shot in graph mode, for config.py's GPU table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvlink.allreduce.config import AllReduceConfig  # noqa: E402

os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

KiB = 1024
MiB = 1024 * KiB
SIZES = [16, 64, 256, KiB, 4 * KiB, 16 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB]
BACKENDS = ("custom_one_shot", "custom_two_shot", "symm_one_shot", "symm_two_shot", "nccl")


def _bench_rank(rank: int, world: int, local_rank: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from kvlink.allreduce import AllReduceConfig, CustomAllReduce, SymmMemAllReduce

    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    cpu_group = dist.new_group(backend="gloo")
    dtype = getattr(torch, opts["dtype"])
    cfg = AllReduceConfig(
        max_bytes=max(opts["sizes"]), max_blocks=opts["max_blocks"], num_warps=opts["num_warps"]
    )
    impls: dict[str, Any] = {}
    notes: dict[str, str] = {}
    try:
        impls["custom"] = CustomAllReduce(cpu_group, device, cfg)
    except Exception as exc:
        notes["custom"] = str(exc)
    try:
        impls["symm"] = SymmMemAllReduce(cpu_group, dist.group.WORLD, device, cfg)
    except Exception as exc:
        notes["symm"] = str(exc)

    def fn(backend: str) -> Any:
        if backend.startswith("custom_") and "custom" in impls:
            mode = backend.removeprefix("custom_")
            return lambda x, y: impls["custom"].all_reduce(x, y, mode=mode)
        if backend.startswith("symm_") and "symm" in impls:
            mode = backend.removeprefix("symm_")
            return lambda x, y: impls["symm"].all_reduce(x, y, mode=mode)
        if backend == "nccl":

            def nccl(x: Any, y: Any) -> Any:
                y.copy_(x)
                dist.all_reduce(y)
                return y

            return nccl
        return None

    # the dispatcher as a serving engine would build it: its log line and who takes which size
    from kvlink.allreduce import AllReduce

    disp = AllReduce(cpu_group, dist.group.WORLD, device, cfg)
    dispatch: dict[str, Any] = {"log_line": disp.summary(), "calls": []}
    for nbytes in (16, 128 * KiB, 2 * max(opts["sizes"])):
        n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        x = torch.full((n,), float(rank + 1), dtype=dtype, device=device)
        got = disp.all_reduce(x)
        want = float(world * (world + 1) // 2)
        dispatch["calls"].append(
            {"bytes": nbytes, "backend": disp.backend_for(x).name,
             "correct": bool((got == want).all())}
        )
    torch.cuda.synchronize()
    disp.close()

    rows = []
    for nbytes in opts["sizes"]:
        n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        gen = torch.Generator(device=device).manual_seed(rank * 7 + n)
        x = torch.randn(n, device=device, generator=gen).to(dtype)
        ref = torch.empty_like(x)
        ref.copy_(x)
        dist.all_reduce(ref)
        row: dict[str, Any] = {"bytes": nbytes, "elements": n}
        results: dict[str, Any] = {}
        for backend in BACKENDS:
            call = fn(backend)
            if call is None:
                row[backend] = None
                continue
            y = torch.empty_like(x)
            if backend.startswith("symm") and impls["symm"].unsupported(x):
                row[backend] = {"skipped": impls["symm"].unsupported(x)}
                continue
            for _ in range(opts["warmup"]):
                call(x, y)
            torch.cuda.synchronize()
            results[backend] = y.clone()
            tol = 2e-2 * world if dtype != torch.float32 else 1e-4 * world
            close = bool(torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * 4))
            # eager
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            dist.barrier(group=cpu_group)
            start.record()
            for _ in range(opts["iters"]):
                call(x, y)
            end.record()
            end.synchronize()
            eager_us = start.elapsed_time(end) * 1e3 / opts["iters"]
            # graph
            graph_us = None
            try:
                graph = torch.cuda.CUDAGraph()
                outs = torch.empty_like(x)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    call(x, outs)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for _ in range(opts["graph_calls"]):
                        call(x, outs)
                if "custom" in impls and backend.startswith("custom"):
                    impls["custom"].register_graph_buffers()
                graph.replay()
                torch.cuda.synchronize()
                dist.barrier(group=cpu_group)
                start.record()
                for _ in range(opts["replays"]):
                    graph.replay()
                end.record()
                end.synchronize()
                graph_us = start.elapsed_time(end) * 1e3 / (opts["replays"] * opts["graph_calls"])
                del graph
            except Exception as exc:
                row.setdefault("graph_errors", {})[backend] = f"{type(exc).__name__}: {exc}"[:300]
            row[backend] = {"eager_us": eager_us, "graph_us": graph_us, "matches_nccl": close}
        if "custom_one_shot" in results and "custom_two_shot" in results:
            row["custom_modes_bit_identical"] = bool(
                torch.equal(results["custom_one_shot"], results["custom_two_shot"])
            )
        rows.append(row)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows, group=cpu_group)
    for impl in impls.values():
        impl.close()
    return {"rows_per_rank": everyone, "notes": notes, "dispatch": dispatch}


def _slowest(rows_per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size and backend, the slowest rank's eager/graph latency."""
    merged = []
    for i, row in enumerate(rows_per_rank[0]):
        out: dict[str, Any] = {"bytes": row["bytes"], "elements": row["elements"]}
        for key in ("custom_modes_bit_identical", "graph_errors"):
            if key in row:
                out[key] = row[key]
        for backend in BACKENDS:
            cells = [rows[i].get(backend) for rows in rows_per_rank]
            if not cells[0] or "skipped" in cells[0]:
                out[backend] = cells[0]
                continue
            out[backend] = {
                "eager_us": max(c["eager_us"] for c in cells),
                "graph_us": (
                    max(c["graph_us"] for c in cells)
                    if all(c["graph_us"] is not None for c in cells)
                    else None
                ),
                "matches_nccl": all(c["matches_nccl"] for c in cells),
            }
        merged.append(out)
    return merged


def _suggest(rows: list[dict[str, Any]]) -> int | None:
    best = None
    for row in rows:
        one, two = row.get("custom_one_shot"), row.get("custom_two_shot")
        if not one or not two or one.get("graph_us") is None or two.get("graph_us") is None:
            continue
        if one["graph_us"] <= two["graph_us"]:
            best = row["bytes"]
    return best


def _report(result: dict[str, Any], world: int, opts: dict[str, Any]) -> None:
    import torch

    rows = _slowest(result["rows_per_rank"])
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
            "torch": torch.__version__,
            "triton": triton_version,
            "cuda": torch.version.cuda,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world": world,
        "dtype": opts["dtype"],
        "method": f"eager: {opts['iters']} calls between CUDA events; graph: "
        f"{opts['graph_calls']} calls per graph x {opts['replays']} replays; slowest rank",
        "custom_config": {"max_blocks": opts["max_blocks"], "num_warps": opts["num_warps"]},
        "notes": result["notes"],
        "dispatch": result["dispatch"],
        "suggested_one_shot_max_bytes": _suggest(rows),
        "rows": rows,
    }
    base = os.environ.get("OUT") or str(ROOT / "bench" / "results")
    out = Path(opts["out"] or Path(base) / f"allreduce_{world}gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"world {world}, {opts['dtype']}: latency per call in us (eager / graph)")
    print(f"{'bytes':>9} " + " ".join(f"{b:>19}" for b in BACKENDS))
    for row in rows:
        cells = []
        for b in BACKENDS:
            c = row.get(b)
            if not c or "skipped" in c:
                cells.append(f"{'-':>19}")
            else:
                g = f"{c['graph_us']:.1f}" if c["graph_us"] is not None else "err"
                flag = "" if c["matches_nccl"] else "!"
                cells.append(f"{c['eager_us']:>9.1f} / {g:>6}{flag:1}")
        print(f"{row['bytes']:>9} " + " ".join(cells))
    print(result["dispatch"]["log_line"])
    print(f"dispatch calls: {result['dispatch']['calls']}")
    for name, note in result["notes"].items():
        print(f"{name} unavailable: {note}")
    print(f"suggested one-shot max bytes (world {world}): {doc['suggested_one_shot_max_bytes']}")
    print(f"wrote {out}")


def _spawned(rank: int, world: int, port: int, opts: dict[str, Any]) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    _entry(opts)


def _entry(opts: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    try:
        result = _bench_rank(rank, world, local_rank, opts)
        if rank == 0:
            _report(result, world, opts)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many ranks (no torchrun)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--graph-calls", type=int, default=50)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--max-blocks", type=int, default=AllReduceConfig.max_blocks)
    ap.add_argument("--num-warps", type=int, default=AllReduceConfig.num_warps)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    opts = {
        "dtype": a.dtype,
        "sizes": sorted(a.sizes),
        "iters": a.iters,
        "warmup": a.warmup,
        "graph_calls": a.graph_calls,
        "replays": a.replays,
        "out": a.out,
        "max_blocks": a.max_blocks,
        "num_warps": a.num_warps,
    }
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _entry(opts)
        return
    nproc = a.nproc
    if nproc <= 0:
        import torch

        nproc = torch.cuda.device_count()
    if nproc < 2:
        raise SystemExit(f"need >= 2 GPUs for a multi-GPU all-reduce bench, have {nproc}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, nproc, port, opts)) for r in range(nproc)]
    for p in procs:
        p.start()
    t0 = time.time()
    for p in procs:
        p.join(max(1.0, 900 - (time.time() - t0)))
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    if bad:
        raise SystemExit(f"ranks {bad} failed or hung")


if __name__ == "__main__":
    main()
