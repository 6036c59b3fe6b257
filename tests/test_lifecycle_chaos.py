"""Randomized lifecycle schedules over real processes and transports (kvlink/demo/chaos.py).

Each schedule: a producer process holding requests under 0.5 s leases and reusing blocks the
moment they are released, serving push requests late, killed mid-flight and restarted under
the same engine id; a consumer pulling half the requests and having the other half pushed,
with random delays and step stalls. After every finished receive its bytes must be the
request's own; no byte lands in a failed push's blocks afterwards; every receive resolves
before its deadline; the producer that ran to the end released each hold once and holds
nothing. CI runs ``KVLINK_CHAOS_SCHEDULES``
schedules (default 6, about 15 s) over tcp, and half as many over NIXL (UCX) and Mooncake TE —
their engines' connections to a killed producer, and to its restart at the same address, are
theirs, not kvlink's; ``bench/lifecycle_soak.py`` runs hundreds. Over cuda_ipc (both caches
on one GPU, a producer killed with the consumer's mappings of its cache open) where CUDA is
here; elsewhere that case is skipped, saying so, and runs in ``scripts/gpu_checks.sh``'s
``soak`` step on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

import pytest

from kvlink.demo.chaos import run_schedules
from kvlink.doctor import cuda_section

#: the transports a schedule runs over, each with the module it needs and how to install it
_NEEDS = {"nixl": ("nixl._api", "pip install 'kvlink[nixl]'"),
          "mooncake": ("mooncake.engine", "pip install 'kvlink[mooncake-cpu]' (+ apt-get install "
                                          "libibverbs1)")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # (its package is missing)
        return False


@pytest.mark.fault("randomized schedules: stalls, lease expiries, push cancels, kills, restarts")
@pytest.mark.parametrize("transport", ["tcp", "nixl", "mooncake", "cuda_ipc"])
def test_random_schedules_never_finish_with_wrong_bytes(
        transport: str, observed: Callable[[str], None], caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    if transport in _NEEDS and not _importable(_NEEDS[transport][0]):
        why = f"{_NEEDS[transport][0]} is not importable: {_NEEDS[transport][1]}"
        print(f"\nskipping the lifecycle schedules over {transport}: {why}")
        pytest.skip(why)
    if transport == "cuda_ipc" and not cuda_section()["available"]:
        why = ("no CUDA GPU here: the schedules over cuda_ipc run on a GPU machine "
               "(scripts/gpu_checks.sh LABEL soak)")
        print(f"\nskipping the lifecycle schedules over cuda_ipc: {why}")
        pytest.skip(why)
    caplog.set_level(logging.ERROR)  # refusals and expiries are the point: not news
    n = int(os.environ.get("KVLINK_CHAOS_SCHEDULES", "6"))
    n = n if transport == "tcp" else max(1, n // 2)
    total = run_schedules(range(n), transport=transport)
    with capsys.disabled():  # CI's log says how many schedules ran, and what they saw
        print(f"\nlifecycle schedules run over {transport}: {total}")
    observed(f"{transport}: {total['schedules']} schedules, {total['finished']} finished "
             f"({total['verified']} verified, {total['pushed']} pushed), {total['failed']} "
             f"failed {total['reasons']}, {total['kills']} kills; violations: "
             f"{total['violations'] or 'none'}")
    assert total["schedules"] == n
    assert not total["violations"], total["violations"]
    assert total["verified"] == total["finished"] > 0
    assert total["kills"] == n and total["failed"] > 0
    if transport == "tcp":  # pushes that finished, their bytes verified (10-17 in 6 schedules)
        assert total["pushed"] > 0
    else:
        # pushes were asked (their failures checked: no WRITE lands after one). Few finish
        # here: over nixl 0 to 7 of ~35 in 3 schedules (0 in one CI run at be673ec; the same
        # with leases and push timeouts doubled), since a push must be written within the
        # schedule's 0.3 s and a restarted producer's first WRITE to the decode opens a
        # connection first. Pushes that finish over nixl and mooncake, bytes checked, are
        # tests/test_vllm_transports.py's (through vLLM); their WRITEs, the transports' tests'.
        assert total["pushed"] + total["reasons"].get("push: not written", 0) > 0
