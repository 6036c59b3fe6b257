"""What KV integrity costs a request end to end, through the public API, levels interleaved.

    .venv/bin/python bench/integrity_overhead.py                       # CPU, tcp
    python bench/integrity_overhead.py --device cuda                   # GPU, cuda_ipc
    python bench/integrity_overhead.py --device cuda --spin            # polling in a tight loop

The two processes of bench/e2e_request.py (producer holds, consumer ``read`` -> ``poll``,
vLLM FlashAttention-shaped bf16 caches, shuffled decode block ids, the caller sleeping 0.2 ms
between polls), both workers registered with ``integrity="full"`` and switched to
``off`` / ``sample`` / ``full`` request by request (``Checker.level``), so the three levels
share one run, one machine state and one warm connection; every request verified element by
element afterwards (untimed). Timed: ``read()`` to the ``poll()`` that reports the request
finished — which, with integrity on, includes the consumer's digest of what landed and the
comparison. The producer's digest at ``hold()`` (the prefill's cost, paid once per request
before any reader can start) is timed separately in this process on the same geometry
(``hold_digest_s``). Overhead = (level - off) / off of the median, with a 90 % bootstrap
interval; a fourth series, ``off_control`` (integrity off again, interleaved like the rest),
is the run's noise floor: its "overhead" is what two identical series differ by (on one H200
host the same tree measured 0.42-0.57 ms in consecutive runs, bench/results/gpu_checks_1c48c77/,
so an overhead of a few percent means something only against the control of its own run).
The order is a fresh seeded permutation every round: a request's time depends on what ran
just before it (code it shares is still in the caches) — with a fixed rotation ``off`` always
followed the control, and the control, identical to ``off``, came out 8-12 % slower than it
(bench/results/integrity_overhead_order_1c48c77/). Goals (issue 24): GPU 70B TP8
request ``full`` ≤ 10 %, ``sample`` ≤ 2 %; CPU ``sample`` ≤ 2 %, ``full`` reported.
Writes bench/results/integrity_overhead_<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_request as e2e
from _common import change_interval, write_result
from e2e_producer import (
    add_idle_poll_arg,
    add_layer_gap_arg,
    add_omp_arg,
    quiet_omp,
    regions_label,
    use_layer_gap,
)

LEVELS = ("off", "sample", "full")
SERIES = (*LEVELS, "off_control")  # timed, interleaved; the control runs at "off"


def hold_digest_seconds(cons: Any, level: str, reps: int) -> float:
    """Median time of the producer-side digest of one request at ``level`` (same geometry)."""
    from kvlink.integrity import Level, checked, digest

    planes = cons.w.integrity.planes
    ids = np.arange(cons.case.blocks, dtype=np.int64)
    times = []
    for _ in range(reps):
        e2e._sync(cons.device)
        t0 = time.perf_counter()
        digest(planes, ids[checked(Level(level), "bench", ids)])
        e2e._sync(cons.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fault_round(cons: Any, prod: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Injected fault, through the same two processes: one element of the request's last
    block (always sampled), V plane of its middle layer, changed after the hold. With
    integrity on the receive must fail naming the block; off (the control), it passes."""
    out: dict[str, Any] = {}
    for level in LEVELS:
        cons.w.integrity.level = type(cons.w.integrity.level)(level)
        prod.ask(("integrity", level), "integrity")
        held = cons._hold(f"fault-{level}", 1)
        rids = held[0][2]
        prod.ask(("corrupt", cons.case.layers // 2, rids[-1]), "corrupted")
        lids = cons._local_ids(1)
        failures = cons.w.integrity.failures
        try:
            cons.kvlink(held, lids, args.spin, None)
            why = ""
        except RuntimeError as exc:
            why = str(exc)
        caught = bool(why) and "integrity" in why and f"remote {rids[-1]}" in why
        out[level] = {"failed_receive": bool(why), "reason": why[:300],
                      "caught": caught if level != "off" else None,
                      "counted": cons.w.integrity.failures - failures}
        print(f"  fault at {level}: " + (f"failed: {why[:160]}" if why else "finished"),
              flush=True)
    out["ok"] = (out["sample"]["caught"] and out["full"]["caught"]
                 and not out["off"]["failed_receive"])
    return out


def _profilers(args: argparse.Namespace) -> dict[str, Any]:
    """--profile: one cProfile per level, enabled only around its timed requests."""
    if not args.profile:
        return {}
    import cProfile

    return {lv: cProfile.Profile() for lv in LEVELS}


def write_profile_diff(profs: dict[str, Any], requests: int, path: str) -> None:
    """What each level adds to a request, function by function: (level - off) of the
    profiler's inclusive and own time per request, largest first — where integrity's host
    time goes (the profiler's own cost per call is in both columns alike)."""
    import pstats

    per: dict[str, dict[tuple[str, int, str], tuple[float, float, float]]] = {}
    for lv, prof in profs.items():
        st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        per[lv] = {k: (v[1] / requests, v[2] / requests, v[3] / requests)
                   for k, v in st.items()}
    lines = [f"cProfile per request ({requests} a level), microseconds; the profiler's cost "
             "is in every figure"]
    for lv in ("sample", "full"):
        rows = []
        for k in set(per[lv]) | set(per["off"]):
            n1, t1, c1 = per[lv].get(k, (0.0, 0.0, 0.0))
            n0, t0, c0 = per["off"].get(k, (0.0, 0.0, 0.0))
            rows.append((c1 - c0, t1 - t0, n1 - n0, c1, k))
        rows.sort(key=lambda r: -abs(r[0]))
        lines.append(f"\n-- {lv} - off: inclusive, own, calls, inclusive at {lv}; function")
        for dc, dt, dn, c1, (f, ln, fn) in rows[:40]:
            where = f"{Path(f).parent.name}/{Path(f).name}:{ln}" if ln else f
            lines.append(f"{dc * 1e6:9.1f} {dt * 1e6:9.1f} {dn:7.1f} {c1 * 1e6:9.1f}  "
                         f"{fn} ({where})")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"  profile (level - off, per request): {path}", flush=True)


def run_case(args: argparse.Namespace, name: str, prod: Any) -> dict[str, Any]:
    cons = e2e.Consumer(args, name, prod)
    try:
        samples: dict[str, list[float]] = {lv: [] for lv in SERIES}
        phases: dict[str, list[dict[str, float]]] = {lv: [] for lv in SERIES}
        checks: dict[str, list[float]] = {lv: [] for lv in SERIES}
        cons.one_round("warmup", 1, False, {}, count_it=False)
        profs = _profilers(args)
        order = np.random.default_rng(args.seed)
        run = args.run_length
        for _ in range(-(-args.requests // run)):
            # see the module docstring; --run-length N: each level's requests N in a row
            levels = [lv for lv in order.permutation(SERIES).tolist() for _ in range(run)]
            for level in levels:
                if len(samples[level]) >= args.requests:
                    continue
                setting = "off" if level == "off_control" else level
                cons.w.integrity.level = type(cons.w.integrity.level)(setting)
                prod.ask(("integrity", setting), "integrity")
                held = cons._hold(level, 1)
                lids = cons._local_ids(1)
                exps = [cons._expected(no, rids) for _, no, rids, _ in held]
                cons._sentinel(lids)
                c0 = cons.w.integrity.check_seconds
                prof = profs.get(level)
                if prof is not None:
                    prof.enable()
                samples[level].append(cons.kvlink(held, lids, args.spin, None))
                if prof is not None:
                    prof.disable()
                checks[level].append(cons.w.integrity.check_seconds - c0)
                ph = cons.w.phases.pop(held[0][0], None)
                if ph is not None:
                    phases[level].append(dataclasses.asdict(ph))
                for li, exp in zip(lids, exps):
                    cons._check(level, li, exp)
        if profs:
            write_profile_diff(profs, args.requests, f"{args.profile}.{name}.txt")
        faults = fault_round(cons, prod, args)
        med = {lv: statistics.median(v) for lv, v in samples.items()}
        c = cons.case
        nbytes = c.layers * 2 * c.blocks * c.page_elems * 2
        out = {
            "bytes": nbytes, "requests_per_level": args.requests,
            "median_s": med,
            "p90_s": {lv: float(np.percentile(v, 90)) for lv, v in samples.items()},
            "overhead_vs_off": {lv: (med[lv] - med["off"]) / med["off"] for lv in SERIES},
            "overhead_vs_off_90pct": {lv: change_interval(samples["off"], samples[lv])
                                      for lv in SERIES if lv != "off"},
            "hold_digest_s": {lv: hold_digest_seconds(cons, lv, 5) for lv in ("sample", "full")},
            "faults": faults,
            "checked_blocks": cons.w.integrity.checked_blocks,
            "fused_blocks": cons.w.integrity.fused_blocks,  # digested by the copy kernel
            "board_validated": cons.w.board_validated,
            "integrity_failures": cons.w.integrity.failures,
            "mismatches": dict(cons.mismatches), "samples_s": samples,
            "consumer_check_median_s": {lv: statistics.median(v) for lv, v in checks.items()},
            "phases_median_s": {lv: {k: statistics.median(p[k] for p in ps) for k in ps[0]}
                                for lv, ps in phases.items() if ps},
        }
        # the copy kernel's part: lane copies timed on the device (one post in 32), by kind
        # ("plain" is off's, "sample" and "full" the digest lanes'), against the request's
        seconds = getattr(cons.peer.transport, "device_seconds", dict)() if cons.peer else {}
        out["device_copy_median_s"] = {k: statistics.median(v) for k, v in seconds.items() if v}
        out["device_copy_timed"] = {k: len(v) for k, v in seconds.items()}
        if out["device_copy_median_s"]:
            print("  the copy on the device (timed lane copies, median): " + ", ".join(
                f"{k} {v * 1e6:.1f} us ({out['device_copy_timed'][k]})"
                for k, v in out["device_copy_median_s"].items()))
        for lv, ph in out["phases_median_s"].items():
            print(f"  phases {lv}: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in ph.items())
                  + f"; of which the consumer's check "
                  f"{out['consumer_check_median_s'][lv] * 1e3:.3f} ms")
        iv = out["overhead_vs_off_90pct"]
        print(f"{name}: " + ", ".join(f"{lv} {med[lv] * 1e3:.3f} ms" for lv in SERIES)
              + " | overhead " + ", ".join(
                  f"{lv} {out['overhead_vs_off'][lv] * 100:+.1f}% "
                  f"[{iv[lv][0] * 100:+.1f}, {iv[lv][1] * 100:+.1f}]"
                  for lv in ("sample", "full", "off_control"))
              + " | hold digest " + ", ".join(f"{lv} {s * 1e3:.3f} ms"
                                              for lv, s in out["hold_digest_s"].items()),
              flush=True)
        return out
    finally:
        cons.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--cases", default=None,
                    help="default cpu: 1gib,70b-tp8; cuda: 70b-tp8,8b-tp1")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level (default cuda 30, cpu 6)")
    ap.add_argument("--run-length", type=int, default=1, metavar="N",
                    help="a level's requests N in a row, the levels' runs in a fresh order "
                         "each round (default 1: request by request). A deployment runs one "
                         "level: its path is then warm from the request before, which one "
                         "request at a time in turn is not")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--spin", action="store_true",
                    help="poll in a tight loop (default: sleep 0.2 ms between polls)")
    add_layer_gap_arg(ap)
    add_idle_poll_arg(ap)
    add_omp_arg(ap)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="cProfile each level's timed requests; what each level adds to a "
                         "request, function by function, to PREFIX.<case>.txt (the figures "
                         "then include the profiler's cost)")
    args = ap.parse_args()
    use_layer_gap(args.layer_gap)
    omp = quiet_omp(args.omp_spin)  # (torch is imported later)
    args.transport = "cuda_ipc" if args.device == "cuda" else "tcp"
    args.device_name = f"cuda:{args.gpu}" if args.device == "cuda" else "cpu"
    args.options, args.inflight, args.integrity, args.op = {}, 1, "full", "read"
    args.requests = args.requests or (30 if args.device == "cuda" else 6)
    if args.run_length < 1:
        sys.exit(f"--run-length must be at least 1, got {args.run_length}")
    names = (args.cases or ("70b-tp8,8b-tp1" if args.device == "cuda" else "1gib,70b-tp8")
             ).split(",")
    if args.device == "cuda":
        torch = e2e._torch()
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device visible")
        torch.cuda.set_device(args.gpu)
    prod = e2e.Producer(args.device_name, args.transport, args.options, args.timeout,
                        integrity="full")
    cases: dict[str, Any] = {}
    try:
        for n in names:
            cases[n] = run_case(args, n, prod)
        bad = _write(args, omp, cases)  # (before the producer's stop: a slow teardown, or a
        # run cut off during it, loses no result)
    finally:
        prod.stop()
    if bad:
        sys.exit(f"FAILED: {bad} mismatches or integrity failures")


def _write(args: argparse.Namespace, omp: str, cases: dict[str, Any]) -> int:
    """Print the goals and write the run's JSON; returns how many requests went wrong (the
    fault round's failures are wanted; anything else is a failure of the run)."""
    bad = int(sum(sum(c["mismatches"].values()) + c["integrity_failures"]
                  - c["faults"]["sample"]["counted"] - c["faults"]["full"]["counted"]
                  + (0 if c["faults"]["ok"] else 1) for c in cases.values()))
    goals: dict[str, bool | None] = {"gpu 70b full <= 10%": None, "gpu 70b sample <= 2%": None,
                                     "cpu 1 GiB sample <= 2%": None}
    if "70b-tp8" in cases:
        ov = cases["70b-tp8"]["overhead_vs_off"]
        if args.device == "cuda":
            goals["gpu 70b full <= 10%"] = ov["full"] <= 0.10
            goals["gpu 70b sample <= 2%"] = ov["sample"] <= 0.02
    if "1gib" in cases and args.device == "cpu":
        goals["cpu 1 GiB sample <= 2%"] = cases["1gib"]["overhead_vs_off"]["sample"] <= 0.02
    print("goals:", goals)
    suffix = "_spin" if args.spin else ""
    write_result(f"integrity_overhead_{args.device}{suffix}", {
        "device": args.device, "transport": args.transport,
        "device_name": e2e._gpu_name(args) if args.device == "cuda" else "cpu",
        "kvlink_commit": e2e._git_commit(),
        "poll": "tight loop" if args.spin else "sleep 0.2 ms between polls",
        "levels": ("interleaved request by request" if args.run_length == 1 else
                   f"interleaved in runs of {args.run_length} requests a level")
                  + " (Checker.level switched on both sides)",
        "run_length": args.run_length,
        "registered_regions": regions_label(),
        "idle_poll_after_each_window": not args.no_idle_poll,
        "omp_wait_policy": omp,
        "goals": goals, "total_bad": bad, "cases": cases,
    }, args.out or f"bench/results/integrity_overhead_{args.device}{suffix}.json")
    return bad


if __name__ == "__main__":
    main()
