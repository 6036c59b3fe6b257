"""Tally README.md's runs into tally.json from the pytest outputs saved beside it.

    python bench/results/vllm_hetero_tp_e48c77c/tally.py

one_session_N.log: ``KVLINK_VLLM_HETERO_E2E=1 .venv/bin/python -m pytest -q
tests/test_vllm_hetero_tp.py`` at 75b97a1 (servers in the launcher's session);
own_sessions_N.log: the same with launch.py's Server back on ``start_new_session=True``.
"""

from __future__ import annotations

import json
import platform
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAST = re.compile(r"(\d+) passed(?:, (\d+) failed)?.* in ([\d.]+)s")


def main() -> None:
    runs = []
    for log in sorted(HERE.glob("*.log")):
        m = None
        for line in log.read_text().splitlines():
            m = LAST.search(line) or m
        assert m is not None, f"{log.name}: no pytest summary line"
        runs.append({"run": log.stem, "passed": int(m[1]), "failed": int(m[2] or 0),
                     "seconds": float(m[3])})
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": platform.node()
              + f" ({platform.machine()}, kernel {platform.release()})",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "runs": runs}
    (HERE / "tally.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
