"""Writes README.md from this folder's JSONs (run from the repository root): no figure is typed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(name: str) -> Any:
    return json.loads((HERE / name).read_text())


def pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def ms(s: float) -> str:
    return f"{1e3 * s:.3f}"


def main() -> None:
    e2e = load("min/e2e.json")
    rows = []
    for case in ("70b-tp8", "8b-tp1"):
        for mode in ("sleep", "spin", "inflight8", "inflight8_spin"):
            m = e2e["cases"][case]["modes"][mode]
            rows.append(
                f"| {case} | {mode} | {ms(m['kvlink']['median_s'])} | "
                f"{ms(m['baselines']['device_copy']['median_s'])} | "
                f"{m['ratio_device_copy_over_kvlink']:.3f} | "
                f"{ms(m['worker_phases_median_s']['post'])} | {m['verified']} | "
                f"{m['mismatches']} |")
    goals = "\n".join(f"- {g['goal']}: {g['value']:.3f} ({'met' if g['met'] else 'NOT met'})"
                      for g in e2e["goals"])
    io = load("min/io_new.json")
    c = io["cases"]["70b-tp8"]
    o, q, dc = c["overhead_vs_off"], c["overhead_vs_off_90pct"], c["device_copy_median_s"]
    lv = "; ".join(f"`{k}` {pct(o[k])} [{100 * q[k][0]:+.1f}, {100 * q[k][1]:+.1f}]"
                   for k in ("sample", "full", "off_control"))
    kernel = " / ".join(f"{1e6 * dc[k]:.1f}" for k in ("plain", "sample", "full"))
    soak = load("checks_b/lifecycle_soak_cuda_ipc.json")
    integ = load("checks_a/gpu_integrity_check.json")["ok"]
    fused = load("checks_a/gpu_fused_digest_check.json")["ok"]
    runs = {k: v for k, v in load("checks_b/gpu_runs_check.json").items()
            if isinstance(v, bool)}
    runs_ok = all(v == ("refused_failed" in k or not k.endswith("_failed"))
                  for k, v in runs.items())
    order = load("checks_b/gpu_stream_order.json")["ordered_all_zero"]
    cases = dict(load("checks_c/gpu_cuda_ipc.json")["cases"])
    ipc = cases["a_1GiB_4MiB"]["cuda_ipc_read_ratio_to_device_copy"]
    ipc_w = cases["a_1GiB_4MiB"].get("cuda_ipc_write_verified")
    landing = all(v for v in load("checks_c/gpu_landing_check.json").values()
                  if isinstance(v, bool))
    gpu = (HERE / "min/gpu.txt").read_text().strip()
    cpu = (HERE / "min/host.txt").read_text().split(":", 1)[1].strip()
    text = f"""# c1c7cf6's library on one H100 (2026-12-08 ~00:05-00:10 UTC)

One start of the device machine (`{gpu}`, host CPU `{cpu}`; asked for an H200, given an
H100), three calls on the warm machine: `min/min.sh`, then `scripts/gpu_checks.sh c1c7cf6
runs order soak` (`checks_b/`) and `... ipc landing` (`checks_c/`); `checks_a/` is
`gpu_checks.sh c1c7cf6 integrity fused` from inside `min.sh`. The library is
`git archive c1c7cf6 kvlink kvlink_transports`. Every figure below is read from the JSONs by
`make_readme.py`.

## Issue 19 through the public API (`{e2e['command']}`)

| case | mode | kvlink ms | device copy ms | copy / kvlink | post phase ms | verified | mismatches |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Goals as the run printed them:
{goals}

## Issue 24's overhead (`{io['command']}`)

70B TP8-rank request, {c['requests_per_level']} requests a level, `off` median
{ms(c['median_s']['off'])} ms: {lv} (90 % intervals); the copy kernel in situ plain /
sample / full {kernel} us; faults {'ok' if c['faults']['ok'] else 'NOT OK'}, mismatches
{sum(c['mismatches'].values())}.

## Correctness on the GPU
- `checks_a/`: the integrity package's digest kernel against the host's (`ok`: {integ})
  and the copy kernel's fused digest (`ok`: {fused}) — the first GPU run since the package
  split (8bceff1).
- `checks_b/`: lanes byte for byte, refusals writing nothing ({runs_ok}: every `*_verified`
  and `*_wrote_nothing` true, every `*_failed` false but the refused ones);
  copies after the caller's stream (`ordered_all_zero`: {order}); the lifecycle soak over
  cuda_ipc, integrity `{soak['integrity']}`: {soak['schedules']} schedules,
  {soak['finished']} finished ({soak['verified']} verified), {soak['kills']} kills,
  violations {len(soak['violations'])}.
- `checks_c/`: cuda_ipc between two processes (1 GiB in 4 MiB extents: READ
  {ipc:.2f}x a device copy, WRITE verified: {ipc_w}); the landing board's signal on the
  device (every check true: {landing}).
"""
    (HERE / "README.md").write_text(text)


if __name__ == "__main__":
    main()
