"""Two kvlink trees, one request each in turn, in one run: a change measured against its base.

    .venv/bin/python bench/ab_trees.py --a DIR --b DIR                       # CPU, tcp
    python bench/ab_trees.py --a DIR --b DIR --device cuda --spin            # GPU, cuda_ipc

Why: on one H200 the same tree run four times in a row measured the 70B TP8-rank request at
0.42-0.57 ms polled in a loop (bench/results/gpu_checks_1c48c77/, docs/history/e2e.md "What
one start can resolve"), so two trees run one after the other cannot show a change of a few percent.
Here each tree — a directory holding ``kvlink/`` and ``kvlink_transports/`` (``git worktree
add``, or ``git archive REV kvlink kvlink_transports | tar -x -C DIR``) — gets a process pair of
its own, bench/e2e_request.py's producer and consumer importing that tree, side by side on the
same machine; the driver asks them in turn, in a fresh random order every round, for one
request each (the producer holds it, the consumer ``read(..., generation)`` -> ``poll`` until
finished; every request verified afterwards, untimed) and keeps the consumer's timed window
(``--inflight N``: N requests read at once, then polled until all are finished).
Between turns both wait on a pipe, so neither runs while the other is timed. What it reports:
each tree's median, and (median b - median a) / median a with a 90 % bootstrap interval. Run
it with ``--b`` the same as ``--a`` for the floor (an A/A), which should hold 0.

Writes bench/results/ab_trees_<device>.json (``--out``); the trees are named by ``--label-a``
/ ``--label-b`` (default: their ``git rev-parse --short HEAD``, else the directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import change_interval, write_result  # noqa: E402
from e2e_producer import (  # noqa: E402
    add_idle_poll_arg,
    add_layer_gap_arg,
    add_omp_arg,
    quiet_omp,
    regions_label,
    use_layer_gap,
)

TAG = "AB "  # a child's answers on its stdout start with this (the rest is its log)


# --------------------------------------------------------------------------- a tree's side
def child(spec: dict[str, Any]) -> None:
    """One tree's producer and consumer; answers ``go`` with one timed request."""
    from e2e_producer import Producer, _torch
    from e2e_request import Consumer

    args = argparse.Namespace(**spec)
    if args.device == "cuda":
        _torch().cuda.set_device(args.gpu)
    prod = Producer(args.device_name, args.transport, args.options, args.timeout)
    try:
        cons = Consumer(args, args.case, prod)
        try:
            cons.one_round("warmup", 1, False, {}, count_it=False)
            import kvlink

            print(TAG + json.dumps({"kvlink": str(Path(kvlink.__file__).resolve())}),
                  flush=True)
            for line in sys.stdin:
                if line.strip() != "go":
                    break
                held = cons._hold("ab", args.inflight)
                lids = cons._local_ids(args.inflight)
                exps = [cons._expected(no, rids) for _, no, rids, _ in held]
                cons._sentinel(lids)
                dt = cons.kvlink(held, lids, args.spin, None)
                bad = sum(cons._check("ab", li, exp) for li, exp in zip(lids, exps))
                print(TAG + json.dumps({"s": dt, "bad": bad}), flush=True)
        finally:
            cons.close()
    finally:
        prod.stop()


# --------------------------------------------------------------------------- the driver
class Tree:
    """A child process importing one tree, and its answers."""

    def __init__(self, name: str, root: Path, spec: dict[str, Any]) -> None:
        if not (root / "kvlink" / "__init__.py").is_file():
            sys.exit(f"{root}: no kvlink/ package there (a worktree or an exported commit)")
        self.name, self.root = name, root
        env = dict(os.environ, KVLINK_COMMIT=name,
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(HERE))
        self.samples: list[float] = []
        self.bad = 0
        ready = self.answer()  # its warm-up request done, and which kvlink it imported
        if not Path(ready["kvlink"]).is_relative_to(root):
            self.close()
            sys.exit(f"tree {name}: its process imported {ready['kvlink']}, not {root}'s "
                     "kvlink (an installed copy first on the path?)")

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                got: dict[str, Any] = json.loads(line[len(TAG):])
                return got
        sys.exit(f"tree {self.name}: its process ended (exit code {self.proc.wait()})")

    def one(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        got = self.answer()
        self.samples.append(float(got["s"]))
        self.bad += int(got["bad"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _label(root: Path) -> str:
    got = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10).stdout.strip()
    return got or root.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--a", type=Path, help="the base tree")
    ap.add_argument("--b", type=Path, help="the changed tree (the same as --a: an A/A)")
    ap.add_argument("--label-a", default=None)
    ap.add_argument("--label-b", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--case", default=None, help="a bench/e2e_request.py case "
                    "(default: 70b-tp8 on cuda, 16-blocks on cpu)")
    ap.add_argument("--requests", type=int, default=40, help="rounds (one window a tree each)")
    ap.add_argument("--inflight", type=int, default=1,
                    help="requests posted at once in each window (read all, then poll)")
    ap.add_argument("--transport", default=None,
                    help="the transport both trees use (default: cuda_ipc on cuda, else tcp)")
    ap.add_argument("--spin", action="store_true",
                    help="poll in a tight loop (default: sleep 0.2 ms between polls)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    add_layer_gap_arg(ap)
    add_idle_poll_arg(ap)
    add_omp_arg(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_layer_gap(args.layer_gap)
    omp = quiet_omp(args.omp_spin)  # (the trees' processes inherit it)
    if args.child is not None:
        child(json.loads(args.child))
        return
    if args.a is None or args.b is None:
        ap.error("--a and --b are required")
    cuda = args.device == "cuda"
    spec = {"device": args.device, "gpu": args.gpu,
            "device_name": f"cuda:{args.gpu}" if cuda else "cpu",
            "transport": args.transport or ("cuda_ipc" if cuda else "tcp"), "options": {},
            "inflight": args.inflight,
            "integrity": "off", "op": "read", "case": args.case or
            ("70b-tp8" if cuda else "16-blocks"), "spin": args.spin,
            "timeout": args.timeout, "seed": args.seed, "profile": None,
            "no_idle_poll": args.no_idle_poll}
    names = (args.label_a or _label(args.a), args.label_b or _label(args.b))
    if names[0] == names[1]:  # an A/A
        names = (f"{names[0]} (a)", f"{names[1]} (b)")
    trees = [Tree(names[0], args.a.resolve(), spec), Tree(names[1], args.b.resolve(), spec)]
    order = np.random.default_rng(args.seed)
    try:
        for _ in range(args.requests):
            for i in order.permutation(2).tolist():
                trees[i].one()
    finally:
        for t in trees:
            t.close()
    a, b = trees
    med = {t.name: float(np.median(t.samples)) for t in trees}
    change = (med[b.name] - med[a.name]) / med[a.name]
    lo, hi = change_interval(a.samples, b.samples, args.seed)
    window = "" if args.inflight == 1 else f", {args.inflight} in flight"
    print(f"{spec['case']} ({args.device}, {'spin' if args.spin else 'sleep'}{window}): "
          f"a {a.name} {med[a.name] * 1e3:.3f} ms, b {b.name} {med[b.name] * 1e3:.3f} ms, "
          f"b vs a {change * 100:+.1f} % [{lo * 100:+.1f}, {hi * 100:+.1f}]"
          f"{'' if a.bad + b.bad == 0 else f'; MISMATCHES a {a.bad}, b {b.bad}'}", flush=True)
    write_result(f"ab_trees_{args.device}", {
        "case": spec["case"], "device": args.device, "transport": spec["transport"],
        "in_flight": args.inflight,
        "registered_regions": regions_label(),
        "idle_poll_after_each_window": not args.no_idle_poll,
        "omp_wait_policy": omp,
        "poll": "tight loop" if args.spin else "sleep 0.2 ms between polls",
        "trees": {"a": {"name": a.name, "dir": str(a.root)},
                  "b": {"name": b.name, "dir": str(b.root)}},
        "order": "one request per tree per round, a fresh random order every round",
        "median_s": med, "b_vs_a": change, "b_vs_a_90pct": [lo, hi],
        "samples_s": {t.name: t.samples for t in trees},
        "mismatches": {t.name: t.bad for t in trees},
    }, args.out or str(HERE / "results" / f"ab_trees_{args.device}.json"))
    if a.bad or b.bad:
        sys.exit(f"FAILED: mismatches (a {a.bad}, b {b.bad})")


if __name__ == "__main__":
    main()
