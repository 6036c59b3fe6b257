"""Which steps the vLLM connector's worker treats as idle (it then yields to its transfers).

vLLM's GPU model runner V2 — the default on CUDA — calls ``start_load_kv`` outside any
forward's context, so the context's attention metadata is None on every step. The connector
took that for "no forward", and a prefill holding blocks yielded ``idle_yield_ms`` on every
step it computed. The step's plan now says whether it runs a forward (the scheduler's
scheduled tokens: tests/test_vllm_scheduler.py checks that part on vLLM's own scheduler).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_vllm_e2e import VLLM_MISSING
from test_vllm_metrics import _make_pair, _start

from kvlink.integrations.vllm.metadata import SendReq, StepPlan

if VLLM_MISSING:  # (CI installs vLLM: there it runs)
    print(f"\nskipping the vLLM connector's idle steps: {VLLM_MISSING}")
    pytest.skip(VLLM_MISSING, allow_module_level=True)

YIELD_S = 0.4  # idle_yield_ms here: long enough that a wrong yield cannot hide in the noise


def _timed_step(conn: object, plan: StepPlan) -> float:
    t0 = time.perf_counter()
    _start(conn, plan)  # type: ignore[arg-type]  # (as V2 calls it: no forward context)
    return time.perf_counter() - t0


def test_a_step_with_a_forward_does_not_yield_outside_a_forward_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with _make_pair(monkeypatch, idle_yield_ms=YIELD_S * 1e3,
                    kv_lease_duration=30) as pair:
        _start(pair.prod, StepPlan(send=[SendReq("r1", (1, 3))]))  # held: work outstanding
        assert pair.prod._worker is not None and pair.prod._worker.pending()
        computing = _timed_step(pair.prod, StepPlan(forward=True))
        idle = _timed_step(pair.prod, StepPlan(forward=False))
        assert computing < YIELD_S / 4, f"a step with a forward yielded {computing:.3f} s"
        assert idle >= YIELD_S * 0.9, f"an idle step yielded only {idle:.3f} s"
