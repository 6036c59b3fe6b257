"""Writes README.md of this folder from its JSONs (run from the repository root)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    e = json.loads((HERE / "e2e16.json").read_text())
    a = json.loads((HERE / "ab_iov.json").read_text())
    modes = e["cases"]["16-blocks"]["modes"]
    rows = []
    for mode in ("sleep", "spin"):
        m = modes[mode]
        k, alone = m["kvlink"]["median_s"], m["transport_alone"]["median_s"]
        sock = m["baselines"]["plain_socket"]["median_s"]
        rows.append(f"| {mode} | {k * 1e3:.3f} | {alone * 1e3:.3f} | "
                    + f"{sock * 1e3:.3f} | {k / sock:.2f}x |"
                    + f" {k / alone:.2f}x | {m['verified']} / {m['mismatches']} |")
    lo, hi = a["b_vs_a_90pct"]
    med = a["median_s"]
    text = f"""# CPU, 2-core VM, HEAD 602d598's library (2026-12-07 ~20:00 UTC)

Written by `make_readme.py` from the JSONs here (command, machine and date inside each).

`{e['command']}` — issue 19's CPU 16-block line, public API over tcp on 127.0.0.1, medians
in ms ("alone": the same extents on the worker's transport; "socket": a plain socket moving
the same bytes), every request verified:

| mode | kvlink | alone | socket | kvlink / socket | kvlink / alone | verified / wrong |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

`{a['command']}` — tcp's C mover handing the kernel 256 buffers per socket call (b) against
64 (a, the tree as is; b: `IOV_PER_CALL` 256 in a copy of kvlink/_native.c), one run,
interleaved: a {med['iov64'] * 1e3:.3f} ms, b {med['iov256'] * 1e3:.3f} ms, b vs a
{a['b_vs_a'] * 100:+.1f} % [{lo * 100:+.1f}, {hi * 100:+.1f}] (90 % interval): no gain, not
taken.
"""
    (HERE / "README.md").write_text(text)


if __name__ == "__main__":
    main()
