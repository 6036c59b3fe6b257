"""The cases, caches and producer (prefill) process of ``bench/e2e_request.py``: what both
processes agree on (geometry, the pattern each element holds) and the producer's loop."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

BS, DIM = 16, 128  # tokens per block, head dim
POLL_SLEEP = 0.0002
MiB = 1 << 20
ALONE = "transport-alone-baseline"  # the standing hold the transport-alone baseline reads under


@dataclasses.dataclass(frozen=True)
class Case:
    layers: int
    heads: int  # KV heads this rank holds
    blocks: int  # blocks per request
    cpu_requests: int  # default request count on CPU (GPU: 50)

    @property
    def page_elems(self) -> int:
        return BS * self.heads * DIM

    @property
    def nbytes(self) -> int:
        return self.layers * 2 * self.blocks * self.page_elems * 2


CASES = {
    "16-blocks": Case(layers=80, heads=1, blocks=16, cpu_requests=50),  # 70b-tp8 geometry
    "70b-tp8": Case(layers=80, heads=1, blocks=256, cpu_requests=12),  # 160 MiB / 4096 tokens
    "8b-tp1": Case(layers=32, heads=8, blocks=256, cpu_requests=4),  # 512 MiB / 4096 tokens
    "1gib": Case(layers=32, heads=8, blocks=512, cpu_requests=2),  # 1 GiB / 8192 tokens
    "4mib": Case(layers=32, heads=8, blocks=2, cpu_requests=50),  # 8b-tp1 geometry, 32 tokens
    # pages of 4 MiB (16 tokens x 1024 heads): what a transport sees of a large page; 1 GiB
    # in 256 extents of 4 MiB (issue 22's "4 MiB" through the public API)
    "4mib-pages": Case(layers=2, heads=1024, blocks=64, cpu_requests=2),
}
CPU_CASES = ["16-blocks", "70b-tp8"]
GPU_CASES = ["70b-tp8", "8b-tp1", "16-blocks"]


# --------------------------------------------------------------------------- shared
def _torch() -> Any:
    import torch

    return torch


#: set (``--layer-gap``): each layer's pages lie apart from the next layer's, so a worker
#: registers one region per layer, as a vLLM cache (a tensor per layer) has it — the copy
#: kernels check every extent against the registered regions (docs/cuda_ipc.md)
LAYER_GAP_ENV = "KVLINK_BENCH_LAYER_GAP"


def layer_gap() -> bool:
    return os.environ.get(LAYER_GAP_ENV, "") not in ("", "0")


def add_layer_gap_arg(ap: Any) -> None:
    """The benches' ``--layer-gap`` flag (an argparse parser); :func:`use_layer_gap` after."""
    ap.add_argument("--layer-gap", action="store_true",
                    help="each layer's pages apart from the next: one registered region per "
                         "layer, as vLLM's tensor per layer (default: one for the cache)")


def add_idle_poll_arg(ap: Any) -> None:
    """The benches' ``--no-idle-poll`` flag (an argparse parser): see
    ``bench/e2e_request.Consumer.kvlink``."""
    ap.add_argument("--no-idle-poll", action="store_true",
                    help="no idle poll after each timed window (before 2026-12-03's runs: the "
                         "worker then sends what it owes peers inside a later window)")


def add_omp_arg(ap: Any) -> None:
    """The benches' ``--omp-spin`` flag (an argparse parser); :func:`quiet_omp` after."""
    ap.add_argument("--omp-spin", action="store_true",
                    help="leave OMP_WAIT_POLICY as it is (before 2026-12-04's runs: unset, so "
                         "the bench's own torch work spun into the timed windows on the CPU)")


def quiet_omp(spin: bool) -> str:
    """Before torch is imported (in this process and every one spawned from here): OpenMP's
    threads sleep once a parallel region ends (``OMP_WAIT_POLICY=PASSIVE``, unless it is set
    or ``spin``), and the policy in force. Why: on the CPU each window's requests are filled
    and verified with torch (untimed), and libgomp's threads, left to spin after those
    regions, then took one of a 2-core machine's cores inside the next timed window — the
    plain-socket baseline, run in processes of its own, never met them. The same tree's
    16-block READ over tcp took 4-12 % longer with them spinning, in each of four pairs
    (bench/results/e2e_request_cpu_tcp_omp/)."""
    if not spin:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ.get("OMP_WAIT_POLICY", "unset")


def use_layer_gap(on: bool) -> None:
    """``--layer-gap``: set for :class:`Cache`, in every process spawned from here."""
    if on:
        os.environ[LAYER_GAP_ENV] = "1"


def regions_label() -> str:
    """What a result file says of the registered regions."""
    return "one per layer (--layer-gap)" if layer_gap() else "one"


class Cache:
    """One bf16 tensor (layers, K|V, blocks, tokens, heads, dim); per-layer views are vLLM's
    FlashAttention shape ``(2, blocks, 16, heads, 128)``. With :func:`layer_gap`, a block's
    worth of unused pages follows each plane (the views then stride over it): one registered
    region per layer instead of one for the whole cache."""

    def __init__(self, case: Case, nblocks: int, device: str) -> None:
        torch = _torch()
        self.case, self.nblocks, self.device = case, nblocks, device
        gap = 1 if layer_gap() else 0
        # zeros: every page is touched now, no first-touch page faults inside a timed window
        self.t = torch.zeros((case.layers, 2, nblocks + gap, BS, case.heads, DIM),
                             dtype=torch.bfloat16, device=device)[:, :, :nblocks]
        self.i16 = self.t.view(torch.int16)
        self.layers = [self.t[i] for i in range(case.layers)]

    def spec(self) -> Any:
        from kvlink.layout import KVCacheSpec

        # kv_dim said, not inferred: a cache of 2 blocks, (2, 2, 16, heads, 128), is ambiguous
        return KVCacheSpec.from_tensors(self.layers, total_kv_heads=self.case.heads,
                                        dtype="bfloat16", kv_dim=0)


def pattern(case: Case, req_no: int, layer: int, blocks: Any, device: str) -> Any:
    """int16 (2, n, page) contents of prefill ``blocks`` of ``layer`` for request ``req_no``:
    unique per (request, layer, K|V, block), varying along the page, never negative (the
    sentinel is -1). Pure int64 arithmetic without overflow: the same on CPU and GPU."""
    torch = _torch()
    kv = torch.arange(2, dtype=torch.int64, device=device)[:, None, None]
    b = blocks.to(device=device, dtype=torch.int64)[None, :, None]
    key = (((req_no * 1009 + layer) * 2 + kv) * 1000003 + b * 7919) & 0x7FFFFFFF
    e = torch.arange(case.page_elems, dtype=torch.int64, device=device)[None, None, :]
    return (((key * 2654435761 + e * 40503) >> 7) & 0x7FFF).to(torch.int16)


def _jsonable(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {k: _jsonable(x) for k, x in dataclasses.asdict(v).items()}
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return repr(v)


def worker_stats(w: Any) -> dict[str, Any]:
    """What the worker says about itself: transport counters, descriptor counts, and per-phase
    timings if this KVWorker version has them (looked up by name, never required)."""
    out: dict[str, Any] = {"transport_stats": _jsonable(w.stats()),
                           "descriptor_counts_raw_coalesced": list(w.descriptor_counts())}
    grace = getattr(w, "poll_grace", None)  # (the polls' waits for copies about to end)
    if grace is not None:
        out["poll_grace"] = _jsonable(grace)
    for name in ("phase_stats", "phases", "phase_seconds", "phase", "timings", "stats_phases"):
        v = getattr(w, name, None)
        if v is None:
            continue
        try:
            out[name] = _jsonable(v() if callable(v) else v)
        except Exception as exc:  # an attribute mid-change by its author: record why
            out[name] = f"unreadable: {type(exc).__name__}: {exc}"
    return out


def phase_medians(w: Any, case: str) -> dict[str, dict[str, float]]:
    """Per mode, the median of each of the worker's per-request phases (``KVWorker.phases``:
    request id -> phase -> seconds, where this KVWorker version keeps them); {} if none."""
    ph = getattr(w, "phases", None)
    if not isinstance(ph, Mapping):
        return {}
    by_mode: dict[str, dict[str, list[float]]] = {}
    for rid, p in ph.items():
        d = _jsonable(p)
        if not isinstance(d, dict):
            continue
        tag = str(rid)[len(case) + 1:].rsplit("-", 1)[0]  # ids are <case>-<mode>-<n>
        for k, v in d.items():
            if isinstance(v, (int, float)):
                by_mode.setdefault(tag, {}).setdefault(k, []).append(float(v))
    return {tag: {k: statistics.median(v) for k, v in ks.items()}
            for tag, ks in by_mode.items()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        _torch().cuda.synchronize()


# --------------------------------------------------------------------------- producer
def producer(cmd_q: Any, rep_q: Any, device: str, transport: str,
             options: dict[str, Any], idle_timeout: float, integrity: str = "off") -> None:
    """The prefill process: a cache per case, fills and holds what the consumer asks for."""
    try:
        _producer(cmd_q, rep_q, device, transport, options, idle_timeout, integrity)
    except BaseException as exc:
        rep_q.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def _producer(cmd_q: Any, rep_q: Any, device: str, transport: str,
              options: dict[str, Any], idle_timeout: float, integrity: str = "off") -> None:
    from kvlink.worker import KVWorker, WorkerConfig

    torch = _torch()
    if device.startswith("cuda"):
        torch.cuda.set_device(int(device.split(":")[1]))
    parent = mp.parent_process()
    w: Any = None
    cache: Cache | None = None
    last = time.monotonic()
    try:
        while True:
            if parent is not None and not parent.is_alive():
                return  # the consumer died: do not linger
            if time.monotonic() - last > idle_timeout:
                return
            try:
                cmd = cmd_q.get(timeout=0.005)
            except queue.Empty:
                if w is not None:
                    w.released()  # serves lease ends and expiries
                continue
            last = time.monotonic()
            if cmd[0] == "stop":
                return
            if cmd[0] == "integrity":  # bench/integrity_overhead.py: the level of next holds
                from kvlink.integrity import Level

                assert w is not None
                w.integrity.level = Level(cmd[1])
                rep_q.put(("integrity", cmd[1]))
            if cmd[0] == "case":
                _, name, nblocks = cmd
                if w is not None:
                    w.close()
                case = CASES[name]
                cache = None
                if device.startswith("cuda"):  # a fresh allocation for the next case's export
                    torch.cuda.empty_cache()
                cache = Cache(case, nblocks, device)
                _sync(device)
                w = KVWorker(WorkerConfig(engine_id=f"e2e-p-{name}", transports=[transport],
                                          transport_options={transport: dict(options)},
                                          lease_seconds=24 * 3600.0, integrity=integrity))
                w.register(cache.spec())
                # the transport-alone baseline reads under a standing hold of the whole cache
                # (a least-privilege owner serves no READ without one: kvlink.grants)
                alone = w.hold(ALONE, np.arange(nblocks, dtype=np.int64))
                rep_q.put(("ready", (w.side_port, alone)))
            elif cmd[0] == "hold":
                assert cache is not None and w is not None
                held = []
                n = cache.case.blocks
                for req_id, req_no, slot in cmd[1]:
                    s0 = slot * n
                    ids = torch.arange(s0, s0 + n, dtype=torch.int64)
                    for li in range(cache.case.layers):
                        cache.i16[li, :, s0:s0 + n] = pattern(
                            cache.case, req_no, li, ids, device).view(2, n, BS, cache.case.heads,
                                                                       DIM)
                    _sync(device)  # blocks are offered only once their contents are final
                    gen = w.hold(req_id, np.arange(s0, s0 + n, dtype=np.int64))
                    held.append((req_id, list(range(s0, s0 + n)), int(gen)))
                rep_q.put(("held", held))
            elif cmd[0] == "blank":  # --op write: the slots a WRITE will fill, sentinel-filled
                assert cache is not None
                n = cache.case.blocks
                for slot in cmd[1]:
                    cache.i16[:, :, slot * n:(slot + 1) * n] = -1
                _sync(device)
                rep_q.put(("blanked", [list(range(s * n, (s + 1) * n)) for s in cmd[1]]))
            elif cmd[0] == "check":  # --op write: what landed in the slots, element by element
                assert cache is not None
                n = cache.case.blocks
                bad = []
                for req_no, slot in cmd[1]:
                    ids = torch.arange(slot * n, (slot + 1) * n, dtype=torch.int64)
                    wrong = 0
                    for li in range(cache.case.layers):
                        want = pattern(cache.case, req_no, li, ids, device)
                        got = cache.i16[li, :, slot * n:(slot + 1) * n].reshape(want.shape)
                        wrong += int((got != want).sum().item())
                    bad.append(wrong)
                rep_q.put(("checked", bad))
            elif cmd[0] == "corrupt":  # injected fault (bench/integrity_overhead.py): one
                assert cache is not None  # element of a held block changes after its hold
                _, layer, block = cmd
                cache.i16[layer, 1, block, 0, 0, 3] ^= 1
                _sync(device)
                rep_q.put(("corrupted", block))
            elif cmd[0] == "stats":
                rep_q.put(("stats", worker_stats(w) if w is not None else {}))
    finally:
        if w is not None:
            w.close()


class Producer:
    """The consumer's handle on the producer process: every wait bounded, death noticed."""

    def __init__(self, device: str, transport: str, options: dict[str, Any],
                 timeout: float, integrity: str = "off") -> None:
        ctx = mp.get_context("spawn")
        self.cmd_q, self.rep_q = ctx.Queue(), ctx.Queue()
        self.timeout = timeout
        self.proc = ctx.Process(target=producer, daemon=True,
                                args=(self.cmd_q, self.rep_q, device, transport, options,
                                      max(600.0, 4 * timeout), integrity))
        self.proc.start()

    def ask(self, cmd: tuple[Any, ...], want: str, timeout: float | None = None) -> Any:
        self.cmd_q.put(cmd)
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            try:
                kind, *rest = self.rep_q.get(timeout=0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"producer died (exit code {self.proc.exitcode})"
                                       ) from None
                continue
            if kind == "error":
                raise RuntimeError(f"producer failed: {rest[0]}")
            if kind == want:
                return rest[0] if len(rest) == 1 else rest
        raise TimeoutError(f"producer did not answer {cmd[0]!r} within "
                           f"{timeout or self.timeout:.0f} s")

    def stop(self) -> None:
        try:
            self.cmd_q.put(("stop",))
        except (OSError, ValueError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# --------------------------------------------------------------------------- consumer
def run_shuffled(rng: np.random.Generator, nblocks: int) -> np.ndarray:
    """All of [0, nblocks) as runs of 1-8 consecutive ids, the runs in random order."""
    runs, pos = [], 0
    while pos < nblocks:
        n = int(rng.integers(1, 9))
        runs.append(np.arange(pos, min(pos + n, nblocks), dtype=np.int64))
        pos += n
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {"median_s": float(np.median(a)), "p10_s": float(np.percentile(a, 10)),
            "p90_s": float(np.percentile(a, 90)), "n": len(xs)}
