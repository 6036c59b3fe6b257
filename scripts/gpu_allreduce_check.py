"""GPU correctness check of the custom all-reduce: W processes sharing ONE GPU (cuda:0).

    python3 scripts/gpu_allreduce_check.py                 # worlds 2 and 4, all on cuda:0
    python3 scripts/gpu_allreduce_check.py --worlds 2 --spread   # rank r on cuda:(r % ngpus)

CUDA IPC handles cannot be opened by the process that exported them, but processes on one device
can open each other's, so one GPU is enough to exercise the real protocol (kernels of different
processes time-slice on the GPU, so this checks correctness, not speed). For each world size,
dtype (bf16/fp16/fp32) and size (16 B .. 8 MiB, plus 1 element and odd counts), one-shot,
two-shot and dispatcher ("auto") results must equal a reference sum (fp32 in rank order, rounded
once) bit for bit, and be bit-identical across ranks; then the same calls are captured into a
CUDA graph (inputs registered in place, plus one misaligned input that must fall back to the
staging copy), replayed twice with fresh inputs, and checked again. Prints a summary and writes
JSON to $OUT/gpu_allreduce_check.json (or bench/results/gpu_allreduce_check.json). Exit status 0
means everything passed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
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

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

DTYPES = ("bfloat16", "float16", "float32")
BYTE_TARGETS = (16, 256, 4096, 65536, 131072, 1 << 20, 8 << 20)
MAX_BYTES = 8 << 20


def element_counts(itemsize: int) -> list[int]:
    """1 element, each byte target, and an odd count near most targets (never above 8 MiB)."""
    counts = {1, 3}
    for target in BYTE_TARGETS:
        n = max(1, target // itemsize)
        counts.add(n)
        counts.add(n - 3 if n * itemsize >= MAX_BYTES else n + 5)
    return sorted(c for c in counts if c > 0 and c * itemsize <= MAX_BYTES)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], out: str) -> None:
    result: dict[str, Any] = {"rank": rank, "failures": [], "digests": {}, "checked": 0}
    try:
        _run_rank(rank, world, port, opts, result)
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["traceback"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def _run_rank(rank: int, world: int, port: int, opts: dict[str, Any], res: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from kvlink.allreduce import AllReduce, AllReduceConfig, CustomAllReduce

    lines: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("kvlink.allreduce").addHandler(_Grab())
    logging.getLogger("kvlink.allreduce").setLevel(logging.INFO)

    ndev = torch.cuda.device_count()
    device = torch.device("cuda", rank % ndev if opts["spread"] else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cfg = AllReduceConfig(max_bytes=MAX_BYTES, enable_symm_mem=False)
    disp = AllReduce(cpu_group=None, device_group=None, device=device, config=cfg)
    res["log_line"] = next((m for m in lines if m.startswith("all-reduce rank")), "")
    res["backends"] = disp.backend_names
    custom = disp._custom
    if not isinstance(custom, CustomAllReduce):
        raise RuntimeError(f"custom backend not enabled: {res['log_line']}")

    def inputs(r: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(r * 1_000_003 + n * 7919 + salt)
        return (torch.randn(n, device=device, generator=gen) * 4).to(dtype)

    def reference(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        acc = inputs(0, n, dtype, salt).float()
        for r in range(1, world):
            acc += inputs(r, n, dtype, salt).float()
        return acc.to(dtype)

    def check(key: str, got: torch.Tensor, n: int, dtype: torch.dtype, salt: int) -> None:
        ref = reference(n, dtype, salt)
        res["checked"] += 1
        if not torch.equal(got.reshape(-1).view(torch.int8), ref.view(torch.int8)):
            diff = int((got.reshape(-1) != ref).sum())
            res["failures"].append(f"{key}: {diff}/{n} elements differ from the reference")
        res["digests"][key] = hashlib.sha1(got.cpu().view(torch.uint8).numpy()).hexdigest()

    t0 = time.perf_counter()
    # ---------------------------------------------------------------- eager
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for n in element_counts(torch.empty((), dtype=dtype).element_size()):
            x = inputs(rank, n, dtype, 0)
            keep = x.clone()
            for mode in ("one_shot", "two_shot"):
                y = custom.all_reduce(x, mode=mode)
                check(f"eager/{dtype_name}/{n}/{mode}", y, n, dtype, 0)
            y = disp.all_reduce(x)
            check(f"eager/{dtype_name}/{n}/dispatch", y, n, dtype, 0)
            if not torch.equal(x, keep):
                res["failures"].append(f"eager/{dtype_name}/{n}: input was modified")
    torch.cuda.synchronize()
    res["eager_seconds"] = time.perf_counter() - t0

    # ---------------------------------------------------------------- CUDA graphs
    t0 = time.perf_counter()
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        counts = element_counts(torch.empty((), dtype=dtype).element_size())
        cases: list[tuple[str, int, str, torch.Tensor]] = []
        for n in counts:
            for mode in ("one_shot", "two_shot"):
                cases.append((f"{n}/{mode}", n, mode, torch.empty(n, dtype=dtype, device=device)))
        # one misaligned input (offset by one element): must be staged, not registered
        n_mis = 4097
        backing = torch.empty(n_mis + 1, dtype=dtype, device=device)
        cases.append((f"{n_mis}/misaligned", n_mis, "auto", backing[1:]))
        for _, n, mode, buf in cases:  # warm-up compiles every kernel variant outside capture
            buf.copy_(inputs(rank, n, dtype, 1))
            custom.all_reduce(buf, mode=mode)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        outs: list[torch.Tensor] = []
        with custom.capture(), torch.cuda.graph(graph):
            for _, _, mode, buf in cases:
                outs.append(custom.all_reduce(buf, mode=mode))  # type: ignore[arg-type]
        res.setdefault("graph_rows_registered", 0)
        res["graph_rows_registered"] = custom.buffers._registered
        for salt in (11, 12):  # two replays with fresh inputs: no host work between them
            for _, n, _, buf in cases:
                buf.copy_(inputs(rank, n, dtype, salt))
            graph.replay()
            torch.cuda.synchronize()
            for (key, n, _, _), out in zip(cases, outs, strict=True):
                check(f"graph{salt}/{dtype_name}/{key}", out, n, dtype, salt)
        del graph
    res["graph_seconds"] = time.perf_counter() - t0
    res["staged_graph_inputs"] = sum(
        1 for item in custom.buffers._graph_inputs if item.staged
    )
    disp.close()


def run_world(world: int, opts: dict[str, Any], tmp: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, opts, tmp), daemon=True)
        for r in range(world)
    ]
    t0 = time.time()
    for p in procs:
        p.start()
    deadline = t0 + opts["deadline_s"]
    while time.time() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    ranks = []
    for r in range(world):
        path = Path(tmp, f"rank{r}.json")
        ranks.append(json.loads(path.read_text()) if path.exists() else {"ok": False})
        if path.exists():
            path.unlink()
    failures: list[str] = []
    if hung:
        failures.append(f"ranks {hung} hung past {opts['deadline_s']} s and were killed")
    for r, rr in enumerate(ranks):
        if not rr.get("ok"):
            failures.append(f"rank {r} crashed: {rr.get('traceback', 'no result')}")
        failures.extend(f"rank {r}: {f}" for f in rr.get("failures", []))
    digests = [rr.get("digests", {}) for rr in ranks]
    mismatched = sorted(k for k in digests[0] if any(d.get(k) != digests[0][k] for d in digests))
    failures.extend(f"not bit-identical across ranks: {k}" for k in mismatched[:20])
    return {
        "world": world,
        "passed": not failures,
        "checked_per_rank": [rr.get("checked", 0) for rr in ranks],
        "failures": failures[:50],
        "log_line": ranks[0].get("log_line", ""),
        "eager_seconds": ranks[0].get("eager_seconds"),
        "graph_seconds": ranks[0].get("graph_seconds"),
        "staged_graph_inputs": ranks[0].get("staged_graph_inputs"),
        "graph_rows_registered": ranks[0].get("graph_rows_registered"),
        "wall_seconds": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--spread", action="store_true", help="rank r on cuda:(r %% device_count)")
    ap.add_argument("--deadline-s", type=float, default=420.0)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT or bench/results)")
    args = ap.parse_args(argv)
    import tempfile

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    opts = {"spread": args.spread, "deadline_s": args.deadline_s}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            r = run_world(world, opts, tmp)
            results.append(r)
            status = "PASS" if r["passed"] else "FAIL"
            print(
                f"[{status}] world {world}: {r['checked_per_rank']} checks per rank, "
                f"eager {r['eager_seconds'] or 0:.1f}s graph {r['graph_seconds'] or 0:.1f}s, "
                f"{r['graph_rows_registered']} graph rows ({r['staged_graph_inputs']} staged)"
            )
            print(f"       {r['log_line']}")
            for f in r["failures"][:10]:
                print(f"       {f}")
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
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__,
            "triton": triton_version,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "all_passed": all(r["passed"] for r in results),
        "results": results,
    }
    out = args.out
    if out is None:
        base = os.environ.get("OUT") or str(ROOT / "bench" / "results")
        out = str(Path(base) / "gpu_allreduce_check.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'ALL PASSED' if doc['all_passed'] else 'FAILURES'}; wrote {out}")
    return 0 if doc["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
