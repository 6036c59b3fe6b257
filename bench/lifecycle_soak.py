"""Lifecycle soak: many randomized schedules (kvlink/demo/chaos.py) over real processes.

    .venv/bin/python bench/lifecycle_soak.py [--schedules 200] [--start 0] [--transport nixl]
        [--integrity full]

Every schedule kills and restarts the producer under the same engine id, stalls the consumer's
step loop past leases and reads requests late; a violation is a finished receive whose bytes
are not its request's own, a read unresolved past its deadline, or a producer hold released
twice or leaked. Writes bench/results/lifecycle_soak.json (the counts; the baseline of a
correctness figure is zero violations, so there is no ratio).
"""

from __future__ import annotations

import argparse
import logging
import time

from _common import write_result

from kvlink.demo.chaos import run_schedules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", type=int, default=200)
    ap.add_argument("--start", type=int, default=1000, help="first seed (CI runs 0..5)")
    ap.add_argument("--transport", default="tcp",
                    choices=["tcp", "nixl", "mooncake", "cuda_ipc"],
                    help="cuda_ipc: both caches on GPU 0 (a GPU machine)")
    ap.add_argument("--integrity", default="off", choices=["off", "sample", "full"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.disable(logging.ERROR)
    t0 = time.monotonic()
    total = run_schedules(range(args.start, args.start + args.schedules),
                          transport=args.transport, integrity=args.integrity)
    total["seconds"] = round(time.monotonic() - t0, 1)
    total["seeds"] = [args.start, args.start + args.schedules]
    total["transport"], total["integrity"] = args.transport, args.integrity
    print(total)
    write_result("lifecycle_soak", total, args.out)
    if total["violations"]:
        raise SystemExit(f"{len(total['violations'])} violations")


if __name__ == "__main__":
    main()
