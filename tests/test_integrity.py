"""End-to-end KV integrity (kvlink.integrity): a wrong KV is a failed receive, never a finished one.

Real KVWorkers over the real tcp transport and side channel on 127.0.0.1; the producer holds a
request (its digests are fixed then), the consumer READs it. Each fault class is injected, and
said so: a byte flipped in the producer's block after the hold (memory corruption), a held
block overwritten with another request's KV (reuse under a READ), a transport that reads the
neighbouring block (the consumer lands another request's KV — a fake tcp transport, because
the real one cannot be made to misaddress on demand), a consumer whose framework reads its
memory in another layout than kvlink described (a layout disagreement the geometry check cannot
see). Each is caught with ``integrity="full"``; the same fault with integrity off finishes
"successfully" with the wrong bytes (the control, so each test can fail).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvlink.demo import data
from kvlink.errors import ConfigError
from kvlink.integrity import Checker, Level, checked, digest, spec_planes, tensor_planes
from kvlink.transport import Extents, register_transport
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig
from kvlink_transports.tcp import TcpTransport

GEO = data.Geometry(layers=3, kv_heads=2, head_dim=8, block_size=4)
NBLOCKS = 16
HELD = [3, 7, 8, 12]  # the prefill's blocks of the request
LOCAL = [1, 2, 5, 9]  # where the decode puts them


class Rank:
    def __init__(self, engine: str, tp: int = 1, rank: int = 0, fill: bool = True,
                 planes: Any = None, **cfg: Any) -> None:
        self.buf, self.layers = data.allocate(GEO, NBLOCKS, tp, rank)
        if fill:
            data.fill(GEO, self.layers, tp, rank)
        else:
            self.buf[:] = np.random.default_rng(7).integers(1, 2**16, self.buf.shape,
                                                             dtype=np.uint16)
        self.spec = data.spec_of(GEO, self.layers, tp, rank)
        self.w = KVWorker(WorkerConfig(engine_id=engine, tp_rank=rank, tp_size=tp, **cfg))
        self.w.register(self.spec, planes(self) if planes is not None else None)

    def remote(self, tp: int = 1) -> RemoteEngine:
        return RemoteEngine(self.w.config.engine_id, "127.0.0.1", self.w.side_port, tp)

    def block(self, ids: list[int]) -> npt.NDArray[np.uint16]:
        return np.stack([np.asarray(lv)[:, ids] for lv in self.layers])


def pull(prefill: Rank, decode: Rank, req: str = "r1") -> tuple[bool, str]:
    """Hold on the prefill, READ on the decode (told the generation), until an outcome."""
    gen = prefill.w.hold(req, HELD)
    decode.w.read(req, prefill.remote(), LOCAL, HELD, generation=gen)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, failed = decode.w.poll()
        prefill.w.poll()
        if req in done:
            return True, ""
        if req in failed:
            return False, failed[req]
        time.sleep(0.001)
    raise AssertionError(f"{req} neither finished nor failed within 20 s")


def pair(level: str, **decode_kw: Any) -> tuple[Rank, Rank]:
    return Rank("p", integrity=level), Rank("d", fill=False, integrity=level, **decode_kw)


def closed(*ranks: Rank) -> None:
    for r in ranks:
        r.w.close()


# ---------------------------------------------------------------------------- the digest
def test_digest_is_the_same_across_layouts_and_tp_sizes() -> None:
    """One head's digest does not depend on NHD/HND or on which rank holds it."""
    nhd = Rank("a", integrity="full")
    hnd_geo = data.Geometry(layers=3, kv_heads=2, head_dim=8, block_size=4, layout="HND")
    buf, layers = data.allocate(hnd_geo, NBLOCKS, 2, 1)
    data.fill(hnd_geo, layers, 2, 1)
    spec = data.spec_of(hnd_geo, layers, 2, 1)  # rank 1 of 2: head 1 only
    try:
        whole = digest(spec_planes(nhd.spec), HELD)
        half = digest(spec_planes(spec), HELD)
        assert whole.shape == (4, 3, 2, 2) and half.shape == (4, 3, 2, 1)
        assert np.array_equal(whole[..., 1:], half)
        assert not np.array_equal(whole[..., :1], half)
    finally:
        closed(nhd)
        del buf


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_c_digest_equals_numpys(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host planes are digested in one C call where kvlink's helpers build
    (kvlink/_digest.c); the same values as numpy's plane-by-plane path, whole and for a head
    slice, on random KV — and ids outside the planes raise, as numpy's indexing does."""
    from kvlink import native
    from kvlink.integrity import host

    if native.load() is None:
        print(f"\nskipping: kvlink's C helpers did not build here ({native.why_not()})")
        pytest.skip(f"kvlink's C helpers did not build here ({native.why_not()})")
    geo = data.Geometry(layers=3, kv_heads=4, head_dim=16, block_size=4, layout=layout)
    buf, layers = data.allocate(geo, NBLOCKS, 1, 0)
    buf[:] = np.random.default_rng(5).integers(0, 2**16, buf.shape, dtype=np.uint16)
    planes = spec_planes(data.spec_of(geo, layers, 1, 0))
    ids = np.array([9, 0, 15, 4, 4])
    c_whole, c_slice = digest(planes, ids), digest(planes, ids, (1, 3))
    assert host.HOST_TABLES[id(planes)][1] is not None  # (the C path was taken)
    with pytest.raises(IndexError):
        digest(planes, np.array([NBLOCKS]))
    # numpy's path, as where the helpers do not build (not a fake: the path they replace)
    monkeypatch.setattr(host, "_c_helpers", None)
    assert np.array_equal(c_whole, digest(planes, ids))
    assert np.array_equal(c_slice, digest(planes, ids, (1, 3)))
    assert np.array_equal(c_slice, c_whole[..., 1:3])
    del buf


def test_sample_picks_a_deterministic_subset_and_at_least_one_block() -> None:
    ids = np.arange(4096)
    keep = checked(Level.SAMPLE, "req-a", ids)
    assert np.array_equal(keep, checked(Level.SAMPLE, "req-a", ids))
    assert 4096 / 64 < keep.sum() < 4096 / 16
    assert not np.array_equal(keep, checked(Level.SAMPLE, "req-b", ids))
    assert checked(Level.SAMPLE, "req-a", np.array([5])).sum() == 1
    assert checked(Level.FULL, "x", ids).all() and not checked(Level.OFF, "x", ids).any()


def test_a_level_set_at_run_time_says_whether_it_checks_and_samples() -> None:
    """``Checker.on`` / ``.sampling`` are attributes kept by the level's setter (read on a
    READ's path without a call): they follow every change of level, as the lanes do."""
    c = Checker(Level.SAMPLE)
    assert (c.level, c.on, c.sampling) == (Level.SAMPLE, True, True)
    for level, on, sampling in ((Level.OFF, False, False), (Level.FULL, True, False),
                                (Level.SAMPLE, True, True), (Level.OFF, False, False)):
        c.level = level
        assert (c.level, c.on, c.sampling) == (level, on, sampling)


def test_bad_level_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"integrity must be one of .*got 'ful'"):
        WorkerConfig(engine_id="x", integrity="ful")


# ---------------------------------------------------------------------------- clean runs
@pytest.mark.parametrize("level", ["sample", "full"])
def test_clean_pull_passes_and_checks(level: str) -> None:
    prefill, decode = pair(level)
    try:
        assert pull(prefill, decode) == (True, "")
        assert np.array_equal(decode.block(LOCAL), prefill.block(HELD))
        assert decode.w.integrity.checked_blocks >= 1 and decode.w.integrity.failures == 0
    finally:
        closed(prefill, decode)


def test_heterogeneous_tp_pull_passes() -> None:
    """Decode TP 2 reads its head from a TP 1 prefill: no false alarm on a head slice."""
    prefill = Rank("p", integrity="full")
    decodes = [Rank("d", tp=2, rank=r, fill=False, integrity="full") for r in range(2)]
    try:
        gen = prefill.w.hold("r1", HELD)
        for d in decodes:
            d.w.read("r1", prefill.remote(), LOCAL, HELD, generation=gen)
        left = {0, 1}
        deadline = time.monotonic() + 20
        while left:
            assert time.monotonic() < deadline, "TP 2 decode did not finish"
            prefill.w.poll()
            for r in list(left):
                done, failed = decodes[r].w.poll()
                assert "r1" not in failed, failed
                if "r1" in done:
                    left.discard(r)
            time.sleep(0.001)
        assert all(d.w.integrity.checked_blocks == 4 for d in decodes)
    finally:
        closed(prefill, *decodes)


def test_consumer_with_integrity_fails_closed_without_digests() -> None:
    prefill, decode = Rank("p"), Rank("d", fill=False, integrity="sample")
    try:
        ok, why = pull(prefill, decode)
        assert not ok and "sent no digest" in why
    finally:
        closed(prefill, decode)


def push(prefill: Rank, decode: Rank, req: str = "r1", lease: bool = True,
         before: Any = None, landed: Any = None) -> tuple[bool, str]:
    """Push mode: the decode asks, the prefill WRITEs its HELD blocks (under the hold's lease
    when ``lease``) into LOCAL; ``before(prefill)`` runs after the hold, before the push;
    ``landed(decode)`` runs when the WRITE has landed, before the decode checks it."""
    if lease:
        prefill.w.hold(req, HELD)
    if landed is not None:
        orig = decode.w._check_pushed

        def check(aw: Any, *args: Any, **kw: Any) -> Any:
            landed(decode)
            return orig(aw, *args, **kw)

        decode.w._check_pushed = check  # type: ignore[method-assign]
    decode.w.expect_push(req, prefill.remote(), LOCAL, timeout=20)
    if before is not None:
        before(prefill)
    pushed = False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not pushed:
            for msg in prefill.w.push_requests():
                prefill.w.push(msg, HELD, lease=req if lease else None)
                pushed = True
        prefill.w.poll()
        done, failed = decode.w.poll()
        if req in done:
            return True, ""
        if req in failed:
            return False, failed[req]
        time.sleep(0.001)
    raise AssertionError(f"push of {req} neither finished nor failed within 20 s")


@pytest.mark.parametrize("lease", [True, False], ids=["held", "unheld"])
def test_clean_push_passes_and_checks(lease: bool) -> None:
    """A push's "written" carries the prefill's digests (the hold's, or taken at the push)
    by the decode's block ids; the decode checks what landed before the push finishes."""
    prefill = Rank("p", integrity="full", serve_pushes=True)
    decode = Rank("d", fill=False, integrity="full")
    try:
        assert push(prefill, decode, lease=lease) == (True, "")
        assert np.array_equal(decode.block(LOCAL), prefill.block(HELD))
        assert decode.w.integrity.checked_blocks == 4 and decode.w.integrity.failures == 0
    finally:
        closed(prefill, decode)


def _flip_landed(decode: Rank) -> None:
    """Injected fault: one byte of landed block 5, layer 1, K plane, flipped in flight."""
    np.asarray(decode.layers[1])[0, 5, 2, 0, 3] ^= 1


@pytest.mark.parametrize("level", ["full", "off"], ids=["full", "off control"])
@pytest.mark.parametrize("fault", ["flipped after the hold", "corrupted landing"])
def test_push_faults_fail_the_receive(level: str, fault: str) -> None:
    """A byte flipped in the prefill's held block after the digest was fixed, or in the
    decode's landed block before it is checked (both injected): the push fails naming the
    block; with integrity off the same push finishes with the wrong bytes (the control)."""
    prefill = Rank("p", integrity=level, serve_pushes=True)
    decode = Rank("d", fill=False, integrity=level)
    try:
        if fault == "flipped after the hold":
            ok, why = push(prefill, decode, before=_flip_after_hold)
        else:
            ok, why = push(prefill, decode, landed=_flip_landed)
        if level == "off":
            assert ok, why  # silently wrong: what integrity is for
            return
        assert not ok and "differs from the producer's" in why, why
        assert "local block" in why and decode.w.integrity.failures == 1
    finally:
        closed(prefill, decode)


# ---------------------------------------------------------------------------- faults
def _flip_after_hold(prefill: Rank) -> None:
    """Injected fault: one byte of held block 8, layer 2, V plane, flipped after the hold."""
    np.asarray(prefill.layers[2])[1, 8, 3, 1, 5] ^= 1


def _reuse_after_hold(prefill: Rank) -> None:
    """Injected fault: held block 12 given to another request, which wrote its KV there."""
    for lv in prefill.layers:
        arr = np.asarray(lv)
        arr[:, 12] = arr[:, 0]


class _Hold:
    """``KVWorker.hold`` that runs ``fault`` right after the hold fixed the digests: an
    injected fault (the real worker cannot be made to corrupt its own memory on demand)."""

    def __init__(self, rank: Rank, fault: Any) -> None:
        self.rank, self.fault, self.real = rank, fault, rank.w.hold

    def __call__(self, *a: Any, **kw: Any) -> int:
        gen: int = self.real(*a, **kw)
        self.fault(self.rank)
        return gen


@pytest.mark.parametrize("level", ["off", "full"])
@pytest.mark.parametrize("fault,where", [(_flip_after_hold, "local block 5 (remote 8), layer 2"),
                                         (_reuse_after_hold, "local block 9 (remote 12)")])
def test_producer_side_corruption_is_a_failed_receive(level: str, fault: Any, where: str) -> None:
    prefill, decode = pair(level)
    try:
        want = prefill.block(HELD)
        prefill.w.hold = _Hold(prefill, fault)  # type: ignore[method-assign]
        ok, why = pull(prefill, decode)
        if level == "off":  # the control: the fault passes silently
            assert ok and not np.array_equal(decode.block(LOCAL), want)
        else:
            assert not ok and "integrity: KV of r1 differs" in why and where in why, why
            assert decode.w.integrity.failures == 1
    finally:
        closed(prefill, decode)


class _Misaddressing(TcpTransport):
    """A fake tcp transport (injected fault): every READ's remote extents point one block
    further — the consumer lands the neighbouring block, another request's KV."""

    name = "tcp_misaddressing"
    shift = 0

    def post(self, op: Any, peer: str, local: Extents, remote: Extents,
             notify: bytes | None = None, *, ticket: bytes = b"") -> int:
        remote = remote.copy()
        remote["addr"] += np.uint64(self.shift)
        return super().post(op, peer, local, remote, notify, ticket=ticket)


@pytest.mark.parametrize("level", ["off", "full"])
def test_consumer_landing_another_requests_blocks_is_a_failed_receive(level: str) -> None:
    register_transport("tcp_misaddressing", _Misaddressing)
    prefill = Rank("p", integrity=level, transports=["tcp_misaddressing"], grants=False)
    decode = Rank("d", fill=False, integrity=level, transports=["tcp_misaddressing"],
                  grants=False)
    _Misaddressing.shift = int(prefill.spec.block_stride[0, 0])
    try:
        ok, why = pull(prefill, decode)
        if level == "off":
            assert ok and not np.array_equal(decode.block(LOCAL), prefill.block(HELD))
        else:
            assert not ok and "integrity: KV of r1 differs" in why, why
    finally:
        _Misaddressing.shift = 0
        closed(prefill, decode)


def _hnd_views(rank: Rank) -> Any:
    """The decode's framework reads its memory head-major (HND), while kvlink was told (and
    the producer uses) token-major: a disagreement no geometry field shows."""
    out = []
    for lv in rank.layers:
        arr = np.asarray(lv)  # (2, B, N, H, D) as kvlink described it
        b, n, h, d = arr.shape[1:]
        flat = arr.reshape(2, b, n * h * d)
        out.append([flat[kv].reshape(b, h, n, d) for kv in range(2)])
    return tensor_planes(out)


@pytest.mark.parametrize("level", ["off", "full"])
def test_layout_disagreement_is_a_failed_receive(level: str) -> None:
    prefill = Rank("p", integrity=level)
    decode = Rank("d", fill=False, integrity=level, planes=_hnd_views)
    try:
        ok, why = pull(prefill, decode)
        if level == "off":
            assert ok  # every byte arrived as described; the model would read them wrongly
        else:
            assert not ok and "integrity: KV of r1 differs" in why, why
    finally:
        closed(prefill, decode)


@pytest.mark.parametrize("kind", ["split", "joined", "pair", "mla", "packed", "packed-mla"])
def test_vllm_tensor_views_digest_like_the_spec(kind: str) -> None:
    """The connector digests vLLM's own tensors (``DetectedLayout.planes``); for a correct
    description they give exactly the spec's digests, so the two sides may mix either."""
    import torch

    from kvlink.integrations.vllm.layout import detect

    g = torch.Generator().manual_seed(3)
    shapes = {"split": (2, 6, 4, 2, 8), "joined": (6, 2, 4, 2, 8), "mla": (6, 4, 16),
              "packed": (6, 2, 4, 16), "packed-mla": (6, 1, 4, 16)}
    caches: dict[str, Any] = {}
    for i in range(3):
        if kind == "pair":
            caches[f"l{i}"] = (torch.randn(6, 4, 2, 8, generator=g),
                               torch.randn(6, 4, 2, 8, generator=g))
        else:
            caches[f"l{i}"] = torch.randn(*shapes[kind], generator=g)
    found = detect(caches, total_kv_heads=2, tp_size=1, tp_rank=0,
                   use_mla=kind in ("mla", "packed-mla"))
    assert found.kind == kind and found.planes is not None
    ids = np.array([0, 3, 5])
    assert np.array_equal(digest(spec_planes(found.spec), ids),
                          digest(tensor_planes(found.planes), ids))


@pytest.mark.parametrize("level", ["off", "full"])
def test_connector_fails_a_corrupted_pull(level: str) -> None:
    """Through the vLLM connector's worker side (PullWorker, vLLM-shaped packed caches, the
    digests over vLLM's own tensors): a byte flipped in the prefill's block after its hold
    (injected) is a failed receive with integrity on, a silent wrong load with it off."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_vllm_e2e import _pair, _remote_r1, _Steps

    from kvlink.demo.run import free_port_range
    from kvlink.integrations.vllm.metadata import RecvReq, SendReq, StepPlan

    port = free_port_range(1)
    extra = {"side_channel_port": port, "integrity": level}
    prod, cons, src, _dst = _pair(extra, extra, tensors=True)
    try:
        steps = _Steps(prod, cons)
        prod.start(StepPlan(send=[SendReq("r1", (1, 3))]))
        src[1][3, 1, 2, 5] += 1.0  # injected: the prefill's block 3 changes after the hold
        cons.start(StepPlan(recv=[RecvReq("d1", _remote_r1(port, [1, 3]), (4, 0), 64)]))
        res = steps.recv()
        assert res.finished_recving == {"d1"}  # vLLM's contract: failed ones are finished too
        if level == "off":
            assert not res.failed_recving
        else:
            assert "integrity: KV of r1 differs" in res.failed_recving["d1"], res
            assert "local block 0 (remote 3), layer 1" in res.failed_recving["d1"]
    finally:
        prod.close()
        cons.close()


def test_match_pairs_digested_blocks_with_the_positions_read() -> None:
    """The reader's pairing of the producer's digested ids with the ids it read (vectorised:
    a sort and a search): a prefix read, ids it did not read, and none at all."""
    from kvlink.integrity import match

    i, j = match([7, 3, 9, 4], [3, 4, 8])
    assert i.tolist() == [1, 3] and j.tolist() == [0, 1]
    i, j = match([5], [6])
    assert i.size == 0 and j.size == 0
    i, j = match([], [1])
    assert i.size == 0


def test_a_landing_areas_digests_check_like_the_wires() -> None:
    """A decode's end-of-push check takes the digests as its landing board's area keeps them
    (plane by plane, kvlink.landing: ``plane_major``), which a GPU's kernel reads as they
    are: the same verdicts as the wire's block-major form — agreement, and a flipped byte
    named by block, layer, plane and head — for every block read and for a subset digested
    (`sample`). Host planes here (the device's check: scripts/gpu_integrity_check.py)."""
    buf, layers = data.allocate(GEO, NBLOCKS, 1, 0)
    buf[:] = np.random.default_rng(3).integers(1, 2**16, buf.shape, dtype=np.uint16)
    spec = data.spec_of(GEO, layers, 1, 0)
    checker = Checker(Level.FULL)
    checker.planes = spec_planes(spec)
    ids = np.array(LOCAL, dtype=np.int64)

    def verdicts(digested: npt.NDArray[np.int64], want: npt.NDArray[np.uint64]
                 ) -> tuple[str | None, str | None]:
        k, nl, per, nh = want.shape
        by_plane = np.ascontiguousarray(want.transpose(1, 2, 0, 3)).reshape(nl * per, k, nh)
        args = ("r", ids, ids, (0, 0, nh), digested)
        return (checker.check(*args, want.astype("<u8").tobytes(), False, nl, per),
                checker.check(*args, by_plane, False, nl, per, plane_major=True))

    for digested in (ids, ids[[1, 3]]):  # every block, and a sample's subset
        want = digest(checker.planes, digested)
        assert verdicts(digested, want) == (None, None)
        np.asarray(layers[2])[1, LOCAL[3], 0, 1, 0] ^= 1  # injected: one byte landed wrong
        wire, area = verdicts(digested, want)
        np.asarray(layers[2])[1, LOCAL[3], 0, 1, 0] ^= 1
        assert wire == area and area is not None
        assert f"local block {LOCAL[3]}" in area and "layer 2, plane 1, head 1" in area


def test_the_copy_kernel_digests_what_it_lands() -> None:
    """kv_move_digest (the cuda_ipc READ with integrity on) against the reference digest, every
    layout, and its in-place compare. Needs a CUDA GPU: there it runs here; the device
    machine's run is scripts/gpu_fused_digest_check.py (bench/results/gpu_checks_a375ba0/),
    and bench/integrity_overhead.py --device cuda drives it end to end with a fault round."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the fused digest runs in "
                    "scripts/gpu_fused_digest_check.py on the device machine")
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts/gpu_fused_digest_check.py"
    spec = importlib.util.spec_from_file_location("gpu_fused_digest_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from kvlink.gpu.copy import BatchCopier

    dev = torch.device("cuda:0")
    rows = mod.check_equal(BatchCopier(dev), torch.cuda.Stream(dev), dev)
    assert all(r["ok"] for r in rows), rows


def test_a_pull_samples_by_the_holds_generation_as_a_copy_kernel_can() -> None:
    """A cuda_ipc digest lane's launcher picks the blocks ``sample`` checks itself, from
    what it launches with (so a block not checked reads nothing of the producer's board): the
    producer picks by the hold's generation, which the READ is told — written out here as
    the launcher computes it (kvlink/_native.c's ``mix64``; kvlink.gpu.lane.sample_order) —
    and publishes the rows of exactly those blocks, in order. A push without a hold picks by
    its request id."""
    ids = np.random.default_rng(5).permutation(4096)[:700].astype(np.int64)
    buf, layers = data.allocate(GEO, 4096, 1, 0)  # (buf: the memory the views are of)
    planes = spec_planes(data.spec_of(GEO, layers, 1, 0))
    for gen in (1, 1001, (7 << 40) | 5, 2**63 - 1):
        with np.errstate(over="ignore"):
            x = ids.view(np.uint64) ^ np.uint64(gen)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        picked = (x & np.uint64(63)) == 0
        picked[-1] = True
        assert np.array_equal(picked, checked(Level.SAMPLE, gen, ids))
        producer = Checker(Level.SAMPLE)
        producer.planes = planes
        producer.fix("r-1", gen, ids)
        got, _blob, _folded = producer.for_verdict("r-1", gen)
        assert got == ids[picked].tolist()
        rows = np.frombuffer(producer.for_board("r-1", gen), dtype="<i8")[4:4 + ids.size]
        assert np.array_equal(rows, np.where(picked, np.cumsum(picked) - 1, -1))
    assert not np.array_equal(checked(Level.SAMPLE, 1001, ids), checked(Level.SAMPLE, 1002, ids))
    del buf
    assert np.array_equal(checked(Level.SAMPLE, "r-1", ids), checked(Level.SAMPLE, "r-1", ids))
