"""Tally the launches of README.md's A/B into tally.json, from the saved outputs in outs/.

    python bench/results/vllm_transports_cpu/autogroup/tally.py

outs/<run>.out.txt: `launch.py --check` as printed (the model-download progress lines left
out); outs/<run>.stalls.txt: the servers' log lines saying a transfer blocked or did not
complete. Which configuration each run was is not in its output: RUNS says (README.md).
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
OWN, ONE = "sessions of their own", "one session"
#: run -> (servers' sessions, where both workers ran, transport, the decode's Mooncake peer
#: thread in SCHED_IDLE)
RUNS = {
    "c0w1": (OWN, "CPU 0", "mooncake", False), "c0w2": (OWN, "CPU 0", "mooncake", False),
    "c0i_1": (OWN, "CPU 0", "mooncake", True), "c0i_2": (OWN, "CPU 0", "mooncake", True),
    "c0i_3": (OWN, "CPU 0", "mooncake", True), "c0w3": (OWN, "CPU 0", "mooncake", True),
    "c0w4": (OWN, "CPU 0", "mooncake", False), "c0w5": (OWN, "CPU 0", "mooncake", False),
    "c0s_1": (ONE, "CPU 0", "mooncake", False), "c0s_4221": (ONE, "CPU 0", "mooncake", False),
    "c0s_24903": (ONE, "CPU 0", "mooncake", False),
    "c0s_18286": (ONE, "CPU 0", "mooncake", False),
    "c0s_20382": (ONE, "CPU 0", "nixl", False), "c0s_12450": (ONE, "CPU 0", "nixl", False),
    "u1s_18563": (ONE, "unpinned", "mooncake", False),
    "u1s_30864": (ONE, "unpinned", "mooncake", False),
    "u1s_8955": (ONE, "unpinned", "nixl", False),
    # b01bc10's core0.sh runs (the folder above, named from outs/; no stall lines saved:
    # their check failed)
    "../../core0_mooncake_1": (OWN, "CPU 0", "mooncake", False),
    "../../core0_mooncake_2": (OWN, "CPU 0", "mooncake", False),
    "../../core0_mooncake_3": (OWN, "CPU 0", "mooncake", False),
}


def main() -> None:
    runs = []
    for name, (sessions, cpus, transport, idle) in RUNS.items():
        base = HERE / "outs" / name
        out = base.with_name(base.name + ".out.txt").read_text().splitlines()
        stalled = base.with_name(base.name + ".stalls.txt")
        stalls = stalled.read_text().splitlines() if stalled.exists() else []
        equal = sum(line.endswith("==") for line in out)
        loaded = any("every prompt token loaded" in line for line in out)
        runs.append({"run": name, "sessions": sessions, "workers": cpus,
                     "transport": transport, "peer_thread_sched_idle": idle,
                     "answers_equal": equal, "stalls_logged": len(stalls),
                     "passed": equal == 8 and not stalls and loaded})
    groups: dict[str, dict[str, int]] = {}
    for r in runs:
        g = groups.setdefault(f"{r['sessions']}, {r['workers']}", {"launches": 0, "passed": 0})
        g["launches"] += 1
        g["passed"] += r["passed"]
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": platform.node()
              + f" ({platform.machine()}, kernel {platform.release()})",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "groups": groups, "runs": runs}
    (HERE / "tally.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(groups, indent=1))


if __name__ == "__main__":
    main()
