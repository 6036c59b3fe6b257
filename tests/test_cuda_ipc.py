"""cuda_ipc: the handshake policy and the copy plan run here; the copy itself needs a GPU.

The GPU half (two processes sharing an H200, bytes verified, ratio to a device copy) is
scripts/gpu_cuda_ipc_check.py, run through the device tool.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.demo import data
from kvlink.gpu import copy as gpucopy
from kvlink.hostid import host_id
from kvlink.transport import Capabilities, Op, register_transport
from kvlink.worker import KVWorker, WorkerConfig
from kvlink_transports.tcp import TcpTransport


class SameHostTcp(TcpTransport):
    """Real tcp, declared same-host-only: exercises the worker's IPC policy without a GPU."""

    name = "samehost_tcp"
    capabilities = Capabilities(ops=frozenset({Op.READ, Op.WRITE}),
                                memory_kinds=frozenset({"cpu"}), same_host_only=True)


register_transport("samehost_tcp", SameHostTcp)
GEO = data.Geometry(layers=2, kv_heads=2, head_dim=8, block_size=4)


def _worker(transports: list[str]) -> KVWorker:
    w = KVWorker(WorkerConfig(engine_id="p", transports=transports))
    _buf, layers = data.allocate(GEO, 8, 1, 0)
    w.register(data.spec_of(GEO, layers, 1, 0))
    w._keep = _buf  # type: ignore[attr-defined]
    return w


def _hs(host: str) -> wire.HandshakeRequest:
    return wire.HandshakeRequest(v=WIRE_VERSION, engine_id="d", agent_name="d/0", tp_rank=0,
                                 tp_size=1, host_id=host, compat="")


def test_same_host_only_descriptors_withheld_from_other_hosts() -> None:
    w = _worker(["samehost_tcp", "tcp"])
    try:
        other = w._answer_handshake(_hs("another-host"))
        mine = w._answer_handshake(_hs(host_id()))
        assert isinstance(other, wire.HandshakeResponse)
        assert isinstance(mine, wire.HandshakeResponse)
        assert sorted(other.transports) == ["tcp"]
        assert sorted(mine.transports) == ["samehost_tcp", "tcp"]
    finally:
        w.close()


def test_transport_refuses_peer_on_other_host() -> None:
    w = _worker(["samehost_tcp"])
    try:
        t = w.transports["samehost_tcp"]
        assert t.unreachable_reason(t.descriptor(), same_host=False) is not None
        assert t.unreachable_reason(t.descriptor(), same_host=True) is None
    finally:
        w.close()


def test_fallback_when_cuda_ipc_cannot_serve(caplog: pytest.LogCaptureFixture) -> None:
    """Config ["cuda_ipc", "tcp"]: on host memory (and without a GPU) tcp is chosen, logged."""
    from kvlink.worker import RemoteEngine

    producer = _worker(["cuda_ipc", "tcp"])
    with caplog.at_level(logging.INFO, logger="kvlink.worker"):
        consumer = _worker(["cuda_ipc", "tcp"])
    try:
        assert list(producer.transports) == ["tcp"]
        with caplog.at_level(logging.INFO, logger="kvlink.worker"):
            peer = consumer.peers.get(RemoteEngine("p", "127.0.0.1", producer.side_port),
                                      0).result(timeout=20)
        assert peer.transport.name == "tcp"
        assert any("transport tcp" in r.getMessage() for r in caplog.records)
        assert any("cuda_ipc" in r.getMessage() for r in caplog.records)
    finally:
        producer.close()
        consumer.close()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 20_000),
       st.integers(1, 20_000))
def test_piece_cuts_cover_every_extent_once(n: int, rows: int, first: int, piece: int) -> None:
    cuts = gpucopy.piece_cuts(n, rows, first, piece)
    assert cuts[-1] == n and all(a < b for a, b in zip([0, *cuts], cuts))
    assert all(c % rows == 0 for c in cuts[:-1]), "a program's rows straddle two launches"
    assert cuts[0] <= max(first, rows) + rows or cuts[0] == n  # the GPU starts early
    assert len(cuts) <= 2 + n // max(piece, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50_000), st.integers(16, 1 << 30))
def test_launch_shape_fills_the_gpu_and_bounds_program_work(n: int, first_len: int) -> None:
    small, large = (4, 1024, 4), (1, 8192, 16)
    (rows, _, _), g = gpucopy.launch_shape(n, first_len, 256 << 10, 528, small, large)
    assert rows == (4 if first_len <= gpucopy.SMALL else 1)
    assert 1 <= g <= 65535
    programs = -(-n // rows) * g
    # enough programs to fill the GPU, unless the extents are too short to split further
    assert programs >= 528 or g >= max(1, first_len // 16384)
    assert -(-first_len // g) <= max(256 << 10, 16384 * 2) or g == 65535


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50_000), st.integers(16, 1 << 30), st.sampled_from([16 << 10, 64 << 10]),
       st.integers(1, 20_000))
def test_cuda_parts_fill_the_gpu_and_bound_part_size(n: int, first_len: int, chunk: int,
                                                     min_parts: int) -> None:
    g = gpucopy.parts_per_extent(n, first_len, chunk, min_parts)
    assert g >= 1
    assert -(-first_len // g) <= chunk  # parts of at most chunk bytes
    # enough parts to fill the GPU, unless parts would drop under 16 KiB
    assert n * g >= min_parts or g >= max(1, first_len // 16384)
    assert -(-first_len // g) >= min(first_len, 16384) // 2  # and never tiny ones


def test_copy_kernel_choice_is_checked_and_falls_back_without_nvrtc(
        caplog: pytest.LogCaptureFixture) -> None:
    """A bad kernel name is a ConfigError naming it (before any device is touched); where the
    CUDA C kernel can't be built (here: no CUDA at all) "auto" gets None, with one warning."""
    import torch

    from kvlink.errors import ConfigError
    from kvlink.gpu import move
    from kvlink.transport import TransportContext
    from kvlink_transports.cuda_ipc import CudaIpcTransport

    with pytest.raises(ConfigError, match="'ptx'"):
        CudaIpcTransport(TransportContext(agent_name="k"), {"kernel": "ptx"})
    with pytest.raises(ConfigError, match="'ptx'"):
        gpucopy.BatchCopier("cuda:0", kernel="ptx")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible, so the CUDA C kernel builds and there is no "
                    "fallback to see; CI (no CUDA) runs this check")
    move.load._warned = False  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="kvlink.cuda_ipc"):
        assert move.load(torch.device("cuda", 0)) is None
        assert move.load(torch.device("cuda", 0)) is None
    warned = [r for r in caplog.records if "CUDA C copy kernel unavailable" in r.getMessage()]
    assert len(warned) == 1


def test_pinned_records_are_recognised_only_where_the_kernel_may_read_them() -> None:
    """Records built by host_extents (and contiguous views of them) are read in place by the
    kernel; any other array (a copy, a strided view, ordinary memory) must be copied first —
    the kernel reading pageable memory would fault the GPU context. The registry forgets the
    memory once no array over it is left."""
    import gc

    import numpy as np

    from kvlink.transport import EXTENT_DTYPE

    known = len(gpucopy._HOST_EXTENTS)
    ext = gpucopy.adopt_host_extents(np.zeros(16 * 12, np.uint8), 10)  # bytes stand in for
    assert ext.shape == (10,) and ext.dtype == EXTENT_DTYPE           # pinned ones here
    at = int(ext.ctypes.data)
    assert gpucopy._pinned_address(ext) == at
    assert gpucopy._pinned_address(ext[3:7]) == at + 3 * 16
    assert gpucopy._pinned_address(ext[::2]) == 0
    assert gpucopy._pinned_address(ext.copy()) == 0
    assert gpucopy._pinned_address(np.empty(10, EXTENT_DTYPE)) == 0
    view = ext[2:]
    del ext
    gc.collect()
    assert gpucopy._pinned_address(view) == at + 2 * 16  # the view keeps the memory alive
    del view
    gc.collect()
    assert len(gpucopy._HOST_EXTENTS) == known and at not in gpucopy._HOST_ADDRESS.values()


def test_copy_kernel_in_the_triton_interpreter() -> None:
    """The kernel's byte movement, device-side bounds check and address translation, run by
    Triton's interpreter on CPU tensors (random lengths, alignments, pieces, rows per program,
    programs per extent; a refused extent fails the post and is not copied)."""
    pytest.importorskip("triton", reason="triton is not installed here (CPU CI): the same "
                        "kernel is checked on the GPU by scripts/gpu_kernel_check.py and "
                        "scripts/gpu_cuda_ipc_check.py")
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("gpucopy_interp.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interp ok" in out.stdout


def test_gpu_copy_needs_a_gpu() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: the IPC copy runs in "
                                "scripts/gpu_cuda_ipc_check.py on the device machine")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the IPC copy runs in scripts/gpu_cuda_ipc_check.py "
                    "on the device machine")


# ----------------------------------------------------------------------------------------------
# Stream order, mapping references and the post/poll contract, with the GPU faked: a fake copier
# hands out copies whose completion the test decides, a fake mapper counts mapping references.


class _FakeStream:
    def __init__(self, raw: int) -> None:
        self.cuda_stream = raw
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        return None


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.recorded_on: list[object] = []

    def query(self) -> bool:
        return self.done

    def record(self, stream: object = None) -> None:
        self.recorded_on.append(stream)


class _FakeDriverEvents:
    """Stands in for kvlink.gpu.move.DriverEvents (no GPU here): events are numbers, complete
    once the test says so."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.free: list[int] = []
        self.recorded: list[tuple[int, int]] = []

    def record(self, stream: int) -> int:
        ev = len(self.recorded) + 1
        self.recorded.append((ev, stream))
        return ev

    def query(self, ev: int) -> bool:
        return ev in self.done

    def synchronize(self, ev: int) -> None:
        self.done.add(ev)

    def recycle(self, ev: int) -> None:
        self.free.append(ev)


class _FakeCopy:
    """What kvlink.gpu.copy.Pending offers the transport."""

    end: Any = None  # a lane's copy: its end word (read by done())
    checks_lane = False  # a digest lane's copy: its kernel's check words (compared, mismatch)
    compared = 0
    mismatch: int | None = None

    def __init__(self, args: tuple[object, ...], after: object) -> None:
        self.args, self.after = args, after
        self.event = _FakeEvent()
        self.error = ""
        self.refused = False
        self.ids = None  # (a lane's launch through the C launcher: the ids it took)
        self.signal: Any = None  # (a lane's push: the landing flag it moves, as the device sees it)

    def done(self) -> bool:
        return self.event.done

    def failed(self) -> bool:
        return self.refused or bool(self.error)

    def completion_event(self) -> _FakeEvent:
        return self.event

    def wait(self) -> None:
        self.event.done = True


class _FakeCopier:
    def __init__(self) -> None:
        self.copies: list[_FakeCopy] = []
        self.raise_next: Exception | None = None
        #: what kvlink.gpu.copy.BatchCopier.device_times reports: set, every copy's time on
        #: the device, in once it ended (the real one times some lane copies by events)
        self.device_seconds: float | None = None
        self.timed: list[_FakeCopy] = []

    def copy(self, src: object, smap: object, dst: object, dmap: object, stream: object,
             after: object = None, signal: object = None) -> _FakeCopy:
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        c = _FakeCopy((src, smap, dst, dmap, stream), after)
        self.copies.append(c)
        if self.device_seconds is not None:
            self.timed.append(c)
        return c

    def device_times(self) -> list[tuple[int, float]]:
        ended = [c for c in self.timed if c.event.done]
        self.timed = [c for c in self.timed if not c.event.done]
        assert self.device_seconds is not None
        return [(4096, self.device_seconds) for _ in ended]  # (_post's one 4 KiB extent)


class _FakeMapper:
    """Counts references per (pid, handle bytes) like kvlink.gpu.ipc.IpcMapper; unmaps at zero."""

    def __init__(self) -> None:
        self.refs: dict[tuple[int, bytes], int] = {}
        self.unmapped: list[tuple[int, bytes]] = []

    def open(self, h: Any) -> int:
        key = (h.pid, h.handle)
        self.refs[key] = self.refs.get(key, 0) + 1
        return int(0x7000_0000_0000 + h.offset + 0x1_0000_0000 * h.pid)

    def close(self, h: Any) -> None:
        key = (h.pid, h.handle)
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.unmapped.append(key)


class _FakeMap:
    def __init__(self, starts: object, ends: object, delta: object, device: object) -> None:
        self.delta = delta


def _fake_transport(monkeypatch: pytest.MonkeyPatch, **options: object) -> Any:
    """A CudaIpcTransport whose GPU parts are fakes: registered over [0x1000, +1 MiB)."""
    import types

    import torch

    from kvlink.transport import Region, RegionTable, TransportContext
    from kvlink_transports import cuda_ipc as mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    t: Any = mod.CudaIpcTransport(TransportContext(agent_name="me", host_id="h"), options)
    t._torch = types.SimpleNamespace(cuda=types.SimpleNamespace(current_device=lambda: 0),
                                     device=lambda *a: None)
    t._current_stream = lambda device: 111  # the caller's current stream (raw handle)
    t._current_device = lambda: 0
    t._device = 0
    t._stream = _FakeStream(222)
    t._copier = _FakeCopier()
    t._mapper = _FakeMapper()
    t._table = RegionTable([Region(0x1000, 1 << 20, "cuda:0")])
    t._local_map = "local-map"
    monkeypatch.setattr(gpucopy, "RegionMap", _FakeMap)
    return t


def _desc(pid: int, handle: bytes = b"h" * 64) -> bytes:
    import msgspec

    from kvlink.gpu.ipc import IpcHandle
    from kvlink_transports import cuda_ipc as mod

    h = IpcHandle(handle, 0, 1 << 20, pid, 0)
    return msgspec.msgpack.encode(mod._Descriptor(v=1, agent=f"peer-{pid}", host_id="h",
                                                  device_uuid="", exports=[
                                                      mod._Export(0x9000, 1 << 20, h.to_bytes())]))


def _ext(addr: int) -> Any:
    from kvlink.transport import make_extents

    return make_extents([addr], [4096])


def _post(t: Any, op: Op, peer: str) -> int:
    return int(t.post(op, peer, _ext(0x1000), _ext(0x9000)))


def test_post_orders_the_copy_after_the_callers_current_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """READ (destination) and WRITE (source) alike: the copier is told to wait for the caller's
    current stream; stream_order=False (the old behaviour) tells it nothing."""
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    t.connect("p", _desc(4242))
    for op in (Op.READ, Op.WRITE):
        h = _post(t, op, "p")
        c = t._copier.copies[-1]
        assert c.after == 111
        assert c.args[4] is t._stream
        assert t.poll(h).status is XferStatus.PENDING
        assert t.completion_event(h) is c.event
        c.event.done = True
        assert t.poll(h).status is XferStatus.DONE
    off = _fake_transport(monkeypatch, stream_order=False)
    off.connect("p", _desc(4242))
    _post(off, Op.READ, "p")
    assert off._copier.copies[-1].after is None


def test_post_never_raises_for_peer_or_runtime_conditions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    h = _post(t, Op.READ, "nobody")
    st = t.poll(h)
    assert st.status is XferStatus.FAILED and "nobody" in st.reason
    assert t.completion_event(h) is None
    t.connect("p", _desc(4242))
    t._copier.raise_next = RuntimeError("CUDA error: an illegal memory access")
    st = t.poll(_post(t, Op.READ, "p"))
    assert st.status is XferStatus.FAILED and "illegal memory access" in st.reason
    t.disconnect("p")
    st = t.poll(_post(t, Op.WRITE, "p"))
    assert st.status is XferStatus.FAILED and "not connected" in st.reason
    # a copy whose launch failed part way (the copier reports it) fails only once it has ended
    t.connect("p", _desc(4242))
    h = _post(t, Op.READ, "p")
    c = t._copier.copies[-1]
    c.error = "RuntimeError: cuLaunchKernel failed"
    assert t.poll(h).status is XferStatus.PENDING
    c.event.done = True
    st = t.poll(h)
    assert st.status is XferStatus.FAILED and "cuLaunchKernel" in st.reason
    assert t.stats.failed == 4


def test_disconnect_in_flight_keeps_the_mapping_until_the_copy_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy holds its mapping: disconnect neither unmaps under it nor fails it early; it
    fails (no byte can land any more) once its event has completed, and then it is unmapped."""
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    mapper = t._mapper
    t.connect("p", _desc(4242))
    h = _post(t, Op.READ, "p")
    c = t._copier.copies[-1]
    t.disconnect("p")
    assert mapper.unmapped == [] and sum(mapper.refs.values()) == 1
    assert t.poll(h).status is XferStatus.PENDING
    c.event.done = True
    st = t.poll(h)
    assert st.status is XferStatus.FAILED and "disconnected" in st.reason
    assert mapper.refs == {} and len(mapper.unmapped) == 1
    t.release(h)
    assert len(mapper.unmapped) == 1  # unmapped exactly once


def test_copies_queued_behind_others_are_expected_at_the_devices_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ends_in`` (what a poll's grace waits on) times a copy from its enqueue: the host's
    time before a launch (here 50 us a post, on a fake clock) is no part of the copy's. Each
    copy below runs 100 us on the device; timed from the post's start, the first looked like
    150 us and every copy queued behind it added the 50 us again, so a poll never found the
    last of several in flight about to end (bench/results/gpu_grace_enqueue/). The clock and
    the copier are stand-ins (this file's fakes): a launch's host time and a copy's end cannot
    be produced on demand without a GPU; scripts/gpu_runs_check.py runs the real ones."""
    from kvlink.transport import XferStatus
    from kvlink_transports import cuda_ipc as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "perf_counter", lambda: now[0])
    t = _fake_transport(monkeypatch)
    launch = t._copier.copy

    def slow_launch(*args: Any, **kw: Any) -> Any:
        now[0] += 50e-6  # the host's time before the copy is enqueued
        return launch(*args, **kw)

    t._copier.copy = slow_launch
    t.connect("p", _desc(4242))
    a = _post(t, Op.READ, "p")  # enqueued at +50 us
    now[0] += 100e-6
    t._copier.copies[-1].event.done = True  # ended (and seen) 100 us after its enqueue
    assert t.poll(a).status is XferStatus.DONE
    now[0] = 2000.0
    b = _post(t, Op.READ, "p")  # enqueued at 2000.00005, ends at .00015
    c = _post(t, Op.READ, "p")  # enqueued at .0001, after b: ends at .00025
    assert t.ends_in(b) == pytest.approx(50e-6)
    assert t.ends_in(c) == pytest.approx(150e-6)


def test_copies_seen_late_round_after_round_stay_expected_at_the_devices_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that posts 8 copies and then polls sees every one of them late. Such
    sightings only bound the device's rate from below; counted, each slowed the estimate
    (less RATE_KEPT a copy), so after a few rounds the last of 8 was expected long after it
    ended, out of a poll's grace (bench/results/gpu_checks_cf9f8d4: 8 in flight 0.58x the
    copy with a caller sleeping between polls). The device's own times of the copies timed
    there keep the pace: here 100 us a copy, every round seen 2 ms late. The clock and the
    copier's device times are stand-ins (this file's fakes): copies seen exactly 2 ms late
    cannot be produced on demand, and device times need a GPU, which this machine lacks;
    scripts/gpu_runs_check.py compares the real timed copies with CUDA events."""
    from kvlink.transport import XferStatus
    from kvlink_transports import cuda_ipc as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "perf_counter", lambda: now[0])
    t = _fake_transport(monkeypatch)
    t._copier.device_seconds = 100e-6
    t.connect("p", _desc(4242))
    a = _post(t, Op.READ, "p")
    now[0] += 100e-6
    t._copier.copies[-1].event.done = True  # seen as it ended
    assert t.poll(a).status is XferStatus.DONE
    for _ in range(10):  # rounds of 8 in flight, all seen 2 ms after their posts
        hs = [_post(t, Op.READ, "p") for _ in range(8)]
        now[0] += 2e-3
        for c in t._copier.copies[-8:]:
            c.event.done = True
        assert all(t.poll(h).status is XferStatus.DONE for h in hs)
    now[0] += 1.0
    b, c = _post(t, Op.READ, "p"), _post(t, Op.READ, "p")
    assert t.ends_in(b) == pytest.approx(100e-6)  # the device's pace, not the sightings'
    assert t.ends_in(c) == pytest.approx(200e-6)
    assert t.copy_rate == pytest.approx(4096 / 100e-6)


def test_a_copy_that_ended_before_the_disconnect_keeps_its_outcome(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    t.connect("p", _desc(4242))
    h = _post(t, Op.READ, "p")
    t._copier.copies[-1].event.done = True
    t.disconnect("p")
    assert t._mapper.refs == {}
    assert t.poll(h).status is XferStatus.DONE


def test_reconnect_in_flight_gets_new_mappings_and_keeps_the_old_until_the_copy_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer reconnecting under the same name (another exporter process: other pid, other
    handle): posts after the reconnect go through the new mappings; the old copy keeps the old
    ones until it has ended, then fails, and only then are they unmapped."""
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    mapper = t._mapper
    t.connect("p", _desc(4242, b"a" * 64))
    h1 = _post(t, Op.READ, "p")
    old = t._copier.copies[-1]
    t.connect("p", _desc(4343, b"b" * 64))
    assert set(mapper.refs) == {(4242, b"a" * 64), (4343, b"b" * 64)}
    h2 = _post(t, Op.READ, "p")
    new = t._copier.copies[-1]
    assert new.args[1] is not old.args[1]  # the new peer's region map, not the old one
    assert int(new.args[1].delta[0]) != int(old.args[1].delta[0])
    new.event.done = True
    assert t.poll(h2).status is XferStatus.DONE
    assert t.poll(h1).status is XferStatus.PENDING
    assert mapper.unmapped == []
    old.event.done = True
    st = t.poll(h1)
    assert st.status is XferStatus.FAILED and "reconnected" in st.reason
    assert mapper.unmapped == [(4242, b"a" * 64)] and set(mapper.refs) == {(4343, b"b" * 64)}
    # the same exporter reconnecting shares its allocation's one mapping (CUDA maps an
    # allocation once per context), with one reference per connect
    t.connect("p", _desc(4343, b"b" * 64))
    assert mapper.refs == {(4343, b"b" * 64): 1}


def test_disconnect_fails_only_that_peers_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    t.connect("a", _desc(1, b"a" * 64))
    t.connect("b", _desc(2, b"b" * 64))
    ha, hb = _post(t, Op.READ, "a"), _post(t, Op.WRITE, "b")
    t.disconnect("a")
    for c in t._copier.copies:
        c.event.done = True
    assert t.poll(ha).status is XferStatus.FAILED
    assert t.poll(hb).status is XferStatus.DONE
    assert set(t._mapper.refs) == {(2, b"b" * 64)}


def test_release_before_the_copy_ends_defers_the_unmap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A released copy and a close keep mappings until their copies end (close waits a bounded
    time); afterwards posts fail, saying why."""
    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    mapper = t._mapper
    t.connect("p", _desc(4242))
    h = _post(t, Op.READ, "p")
    c = t._copier.copies[-1]
    t.release(h)  # the caller gave up on it; the copy still runs
    t.disconnect("p")
    assert mapper.unmapped == []
    c.event.done = True
    t.disconnect("p")  # any later call settles it (here: a no-op one)
    assert len(mapper.unmapped) == 1 and mapper.refs == {}
    t.connect("q", _desc(7, b"q" * 64))
    hq = _post(t, Op.READ, "q")
    t.close(timeout=0.05)  # bounded: the copy has not ended, so its mapping stays
    assert mapper.refs == {(7, b"q" * 64): 1}
    assert t.poll(hq).status is XferStatus.PENDING
    t._copier.copies[-1].event.done = True
    st = t.poll(hq)
    assert st.status is XferStatus.FAILED and "transport closed" in st.reason
    assert mapper.refs == {} and len(mapper.unmapped) == 2
    t.close()  # idempotent
    st = t.poll(_post(t, Op.READ, "q"))
    assert st.status is XferStatus.FAILED and "closed" in st.reason


def test_peer_table_is_safe_under_concurrent_connects_and_posts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Handshake threads replace and forget peers while the caller posts: every post gets a
    handle (never an exception), and every mapping reference is dropped in the end."""
    import threading

    from kvlink.transport import XferStatus

    t = _fake_transport(monkeypatch)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(name: str, pid: int) -> None:
        try:
            while not stop.is_set():
                t.connect(name, _desc(pid, name.encode() * 64))
                t.disconnect(name)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n, i + 1)) for i, n in enumerate("ab")]
    for th in threads:
        th.start()
    handles = []
    try:
        for i in range(3000):
            handles.append(_post(t, Op.READ, "ab"[i % 2]))
            if i % 7 == 0:
                for c in t._copier.copies:
                    c.event.done = True
                for h in handles:
                    t.poll(h)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors
    for c in t._copier.copies:
        c.event.done = True
    states = {t.poll(h).status for h in handles}
    assert XferStatus.PENDING not in states
    for h in handles:
        t.release(h)
    t.close()
    assert t._mapper.refs == {}


def test_copier_waits_for_the_callers_stream_and_reports_failed_launches() -> None:
    """BatchCopier.copy: the copy's stream is ordered after ``after`` before any launch (not
    when ``after`` is that stream, nor without it); a launch that raises gives a copy that fails
    once its event has completed, keeping the buffers the launches read. A completion event
    handed out is a torch event of its own, recorded on the copy's stream at the first ask;
    the copy's own (driver) event goes back once the copy is done."""
    import collections
    import threading
    import types

    from kvlink.transport import make_extents

    cp: Any = object.__new__(gpucopy.BatchCopier)
    cp.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_FakeEvent))
    order: list[object] = []
    cp._lock, cp._events = threading.Lock(), _FakeDriverEvents()
    cp._order = types.SimpleNamespace(wait=lambda s, a: order.append(("wait", s, a)))
    cp._inflight, cp._pinned, cp._onboard = collections.deque(), {}, {}
    stream = _FakeStream(1)

    def launch(*args: Any) -> Any:
        order.append("launch")
        args[-1].append("a buffer the launch reads")
        raise RuntimeError("CUDA error 700")

    cp._copy_locked = launch
    e = make_extents([0x1000], [64])
    p = cp.copy(e, None, e, None, stream, 2)
    assert order == [("wait", 1, 2), "launch"]
    assert "CUDA error 700" in p.error and p.keep[-1] == "a buffer the launch reads"
    assert not p.done()
    ev = p.completion_event()
    assert ev.recorded_on == [stream] and p.completion_event() is ev
    assert cp._events.recorded == [(p.event, 1)]  # after the launches, on the copy's stream
    cp._events.done.add(p.event)
    assert p.done() and p.failed()
    assert cp._events.free == [p.event]
    order.clear()
    cp.copy(e, None, e, None, stream, 1)
    cp.copy(e, None, e, None, stream, None)
    assert order == ["launch", "launch"]


@pytest.mark.parametrize("queried_by", ["ctypes", "c"])
def test_driver_events_record_query_and_recycle(queried_by: str, tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """kvlink.gpu.move.DriverEvents through a fake driver: an event is created once and
    recycled; a query is True at 0, False at CUDA_ERROR_NOT_READY, raises on anything else; a
    record the driver refuses raises and keeps its event for the next. Queried through ctypes
    or through kvlink's C helper (``event_query``, bound to a stand-in for cuEventQuery, in a
    build of this test's own); a C query that finds no context on its thread is asked again
    through ctypes, whose call makes one current."""
    import ctypes
    import types

    from kvlink import native
    from kvlink.gpu import move

    calls: list[str] = []
    rc = {"record": 0, "query": 0}

    def create(ptr: Any, flags: int) -> int:
        calls.append("create")
        ptr._obj.value = 0x77
        return 0

    def call(name: str) -> Any:
        def fn(*args: Any) -> int:
            calls.append(name)
            return rc[name]
        return fn

    ev: Any = object.__new__(move.DriverEvents)
    ev.free, ev._device, ev._query = [], 0, None
    ev._lib = types.SimpleNamespace(cuEventCreate=create, cuEventRecord=call("record"),
                                    cuEventQuery=call("query"))
    if queried_by == "c":
        monkeypatch.setenv("KVLINK_CACHE_DIR", str(tmp_path))  # (a module of its own)
        monkeypatch.setattr(native, "_loaded", {})
        helpers = native.load()
        assert helpers is not None, native.why_not()

        def c_query(e: int) -> int:
            calls.append(f"c_query {e:#x}")
            return rc.get("c_query", rc["query"])

        fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(c_query)
        helpers.bind_event_query(int(ctypes.cast(fn, ctypes.c_void_p).value or 0))
        ev._query = helpers.event_query
    e = ev.record(5)
    assert e == 0x77 and calls == ["create", "record"]
    calls.clear()
    assert ev.query(e) is True
    assert calls == (["c_query 0x77"] if queried_by == "c" else ["query"])
    rc["query"] = 600
    assert ev.query(e) is False
    rc["query"] = 700
    with pytest.raises(RuntimeError, match="700"):
        ev.query(e)
    if queried_by == "c":  # no context on this thread: asked again through ctypes' call
        rc["c_query"], rc["query"] = 201, 0  # (which makes one current where it gets 201)
        calls.clear()
        assert ev.query(e) is True and calls == ["c_query 0x77", "query"]
    ev.recycle(e)
    calls.clear()
    rc["record"] = 400
    with pytest.raises(RuntimeError, match="400"):
        ev.record(5)
    assert calls == ["record"] and ev.free == [0x77]  # not created again, kept


def test_stream_order_waits_only_for_pending_work() -> None:
    """kvlink.gpu.move.StreamOrder through a fake driver: an idle stream (query 0) enqueues nothing;
    a busy one (CUDA_ERROR_NOT_READY) gets one event, recorded on it and waited on by the copy's
    stream, reused afterwards; driver errors raise (the post then fails, nothing enqueued)."""
    import types

    from kvlink.gpu import move

    calls: list[tuple[object, ...]] = []
    query = {"rc": 0}

    def fn(name: str, rc: Any = 0) -> Any:
        def call(*args: Any) -> int:
            calls.append((name, *[getattr(a, "value", a) for a in args[:2]]))
            return int(rc() if callable(rc) else rc)
        return call

    so: Any = object.__new__(move.StreamOrder)
    so._event = None
    so._lib = types.SimpleNamespace(cuStreamQuery=fn("query", lambda: query["rc"]),
                                    cuEventCreate=fn("create"), cuEventRecord=fn("record"),
                                    cuStreamWaitEvent=fn("wait"))
    assert so.wait(7, 9) is False and [c[0] for c in calls] == ["query"]
    query["rc"] = 600
    calls.clear()
    assert so.wait(7, 9) is True and [c[0] for c in calls] == ["query", "create", "record",
                                                                "wait"]
    assert calls[3][1] == 7  # the copy's stream waits
    calls.clear()
    assert so.wait(7, 0) is True and [c[0] for c in calls] == ["query", "record", "wait"]
    query["rc"] = 700
    with pytest.raises(RuntimeError, match="700"):
        so.wait(7, 9)


def test_mapper_shares_a_mapping_per_exporter_and_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mapping per (exporting process, handle), referenced per open, unmapped with the last
    close; the same handle bytes from another process get their own mapping."""
    import ctypes
    import types

    from kvlink.gpu import ipc

    opened: list[bytes] = []
    closed: list[int] = []

    def open_handle(ptr: Any, raw: Any, flags: int) -> int:
        opened.append(bytes(raw))
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint64))[0] = 0x5000 * len(opened)
        return 0

    drv = types.SimpleNamespace(cuIpcOpenMemHandle=open_handle, check=lambda rc, what: None)
    monkeypatch.setattr(ipc, "driver", lambda: drv)
    monkeypatch.setattr(ipc, "ensure_context", lambda device: None)
    monkeypatch.setattr(ipc, "_close_base", lambda base, device: closed.append(base))
    m = ipc.IpcMapper(0)
    a1 = ipc.IpcHandle(b"x" * 64, 16, 64, 100, 0)
    a2 = ipc.IpcHandle(b"x" * 64, 32, 64, 100, 0)  # same allocation, another pointer
    b = ipc.IpcHandle(b"x" * 64, 16, 64, 200, 0)  # another exporter
    assert m.open(a1) == 0x5000 + 16 and m.open(a2) == 0x5000 + 32
    assert m.open(b) == 0xA000 + 16
    assert len(opened) == 2 and m.refs(a1) == 2 and m.refs(b) == 1
    m.close(a1)
    assert closed == []
    m.close(a2)
    assert closed == [0x5000] and m.refs(a1) == 0 and m.refs(b) == 1


def test_fused_alignment_is_judged_on_the_addresses_not_the_array() -> None:
    """The fused READ moves 16-byte vectors: its segment bases must be 16-byte aligned. Judged
    once per pair of base arrays — by what they hold: a caller that refills an array with
    addresses off 16 bytes must be told so (a cache by the array object said "aligned")."""
    import numpy as np

    from kvlink_transports.cuda_ipc import _aligned

    local = np.arange(4, dtype=np.uint64) * np.uint64(4096) + np.uint64(1 << 20)
    remote = local + np.uint64(1 << 24)
    assert _aligned(local, remote)
    remote[2] += np.uint64(8)  # refilled in place: the same object
    assert not _aligned(local, remote)


class _FakeLane:
    """What kvlink.gpu.lane.Lane offers the transport: the maps it was bound to, and rebound."""

    def __init__(self, src: Any, dst: Any, unit: int, maps: tuple[Any, Any],
                 digest: Any) -> None:
        self.src, self.dst, self.unit, self.digest = src, dst, unit, digest
        self.segments = int(src.shape[0])
        self.maps = [maps]
        self.launches: dict[int, Any] = {}  # (none bound ahead: every post asks fits())

    def fits(self, blocks: int) -> bool:
        return 0 < blocks <= 100

    def rebind(self, maps: tuple[Any, Any]) -> None:
        self.maps.append(maps)


class _FakeLaneCopier(_FakeCopier):
    """The copier's lane side, for the transport's logic on a machine without a GPU (a stand-in,
    as the other fakes here; scripts/gpu_runs_check.py runs the real lane)."""

    computes_addresses = True

    def lane(self, src: Any, dst: Any, unit: int, limits: tuple[int, int], smap: Any,
             dmap: Any, digest: Any = None) -> _FakeLane:
        return _FakeLane(src, dst, unit, (smap, dmap), digest)

    def copy_lane(self, lane: _FakeLane, src: Any, dst: Any, stream: object, after: object,
                  generation: int = 0, sample: bool = False, signal: Any = None) -> _FakeCopy:
        c = _FakeCopy((lane, src, dst, stream, generation, sample), after)
        c.signal = signal
        c.ids = np.concatenate([src, dst]).astype(np.int64)  # what the launch took
        self.copies.append(c)
        return c


def _read_lane(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A transport with the lane copier (GPU parts faked), connected to peer "p", and its READ
    lane over two segments of 64 blocks of 4 KiB a side."""
    t = _fake_transport(monkeypatch)
    t._copier = _FakeLaneCopier()
    t.connect("p", _desc(4242, b"a" * 64))
    local_base = np.array([0x1000, 0x1000 + (64 << 12)], dtype=np.uint64)
    remote_base = np.array([0x9000, 0x9000 + (64 << 12)], dtype=np.uint64)
    return t, t.lane(Op.READ, "p", local_base, remote_base, 4096, (64, 64))


def test_a_lane_posts_block_ids_under_the_transports_contract(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ipc's lane (kvlink.gpu.lane bound once per peer pair): a post hands the copier
    the two id arrays (READ: theirs to ours) after the caller's stream; a peer connected anew
    rebinds the lane to its new mappings; a disconnected one fails the post with no copy; a
    refused copy is explained from its blocks (an id past its side's count, which the device
    checks, named); what the lane cannot take is left to the general post (None)."""
    from kvlink.transport import XferStatus

    t, lane = _read_lane(monkeypatch)
    remote_base = lane.remote_base
    lids, rids = np.array([3, 1, 2], dtype=np.int64), np.array([0, 5, 6], dtype=np.int64)
    h = lane.post(lids, rids)
    c = t._copier.copies[-1]
    bound = c.args[0]
    assert c.args[1] is rids and c.args[2] is lids and c.after == 111
    assert bound.src is remote_base and bound.maps[0][1] == "local-map"
    got = lane.posted_ids(h)  # (local, remote) as the launch took them: the worker's records
    assert got is not None and got[0].tolist() == [3, 1, 2] and got[1].tolist() == [0, 5, 6]
    c.event.done = True
    assert t.poll(h).status is XferStatus.DONE
    t.release(h)
    first_map = bound.maps[0][0]
    t.connect("p", _desc(4343, b"b" * 64))
    h = lane.post(lids, rids)
    assert len(bound.maps) == 2 and bound.maps[1][0] is not first_map
    assert bound.maps[1][0] is t._peers["p"].map
    t._copier.copies[-1].event.done = True
    assert t.poll(h).status is XferStatus.DONE
    assert lane.post(np.arange(101), np.arange(101)) is None  # past its launch: general post
    far = np.array([0, 5, 1000], dtype=np.int64)  # block 1000 of 64: refused on the device
    h = lane.post(lids, far)
    far[2] = 3  # the caller reuses its array: the refusal names what was posted
    refused = t._copier.copies[-1]
    refused.refused, refused.event.done = True, True
    st = t.poll(h)
    assert st.status is XferStatus.FAILED and "remote block id 1000 (position 2)" in st.reason
    t.disconnect("p")
    n = len(t._copier.copies)
    st = t.poll(lane.post(lids, rids))
    assert st.status is XferStatus.FAILED and "not connected" in st.reason
    assert len(t._copier.copies) == n


def test_a_lane_posts_end_probe_says_how_it_ended_and_release_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ipc's ``end_probe`` (kvlink.transport, rule 7), which the worker's poll reads a
    routed READ's end through: None while the copy runs; once it ended, 0 for a plain lane's
    DONE copy, a digest lane's rows where its kernel found every digest equal, -1 where poll()
    must say (refused, cut by a disconnect, a digest that differed or was not compared) —
    and none of the transport's bookkeeping of the end, which release() then takes as poll()
    would (the transfer counted once). A post that is no lane's copy has no probe."""
    from kvlink.gpu.copy import NO_MISMATCH
    from kvlink.transport import XferStatus, make_extents

    t, lane = _read_lane(monkeypatch)
    lids, rids = np.array([3, 1], dtype=np.int64), np.array([0, 5], dtype=np.int64)

    def posted(checks: bool = False) -> tuple[int, Any, Any]:
        h = lane.post(lids, rids)
        c = t._copier.copies[-1]
        c.end, c.checks_lane = object(), checks  # (a lane's copy, as the copier makes it)
        probe = t.end_probe(h)
        assert probe is not None and probe() is None  # moving
        return h, c, probe

    h, c, probe = posted()
    c.event.done = True
    counted, seconds = t.stats.transfers, t.stats.xfer_seconds
    assert probe() == 0 and t.stats.transfers == counted  # ended DONE; nothing counted yet
    x = t._xfers[h]
    t.release(h)
    assert t.stats.transfers == counted + 1 and h not in t._xfers
    # its time is to when the probe saw it end, not to the release
    assert t.stats.xfer_seconds - seconds == pytest.approx(x.ended_at - x.t_post, abs=1e-12)
    h, c, probe = posted()
    c.refused, c.event.done = True, True
    assert probe() == -1 and t.poll(h).status is XferStatus.FAILED
    for mismatch, compared, says in ((NO_MISMATCH, 7, 7), (3, 7, -1), (None, 0, -1)):
        h, c, probe = posted(checks=True)
        c.mismatch, c.compared, c.event.done = mismatch, compared, True
        assert probe() == says, (mismatch, compared)
    h, c, probe = posted()
    t.disconnect("p")  # cut while in flight: FAILED once it ends, whatever it did
    c.event.done = True
    assert probe() == -1 and t.poll(h).status is XferStatus.FAILED
    t.connect("p", _desc(4242, b"a" * 64))
    general = t.post(Op.READ, "p", make_extents([0x1000], [4096]),
                     make_extents([0x9000], [4096]), None)
    assert t.end_probe(general) is None and t.end_probe(10**9) is None


def _mapping_transport(monkeypatch: pytest.MonkeyPatch, peer: str, device_address: int
                       ) -> tuple[Any, list[tuple[int, int]], tuple[Any, Any]]:
    """A transport with the lane copier, connected to ``peer``, whose host mappings (a hold
    board, a landing board) are recorded and given ``device_address``: a stand-in for CUDA's
    host registration (no GPU here), not a fault — the fake copier never dereferences it.
    Returns it, the regions it mapped, and two segments' (local, remote) bases."""
    t = _fake_transport(monkeypatch)
    t._copier = _FakeLaneCopier()
    mapped: list[tuple[int, int]] = []
    monkeypatch.setattr(t, "_host_map",
                        lambda region, ro, why: mapped.append(region) or device_address)
    t.connect(peer, _desc(4242, b"a" * 64))
    return t, mapped, (np.array([0x1000, 0x1000 + (64 << 12)], dtype=np.uint64),
                       np.array([0x9000, 0x9000 + (64 << 12)], dtype=np.uint64))


def test_a_digest_lane_binds_the_board_once_and_posts_only_the_generation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ lane with integrity on (kvlink.transport.LaneDigests): the producer's hold board
    is mapped for the device once, at the lane, and its kernel is bound to it and to our views
    (kvlink.gpu.lane.BoardDigest), so a post hands the copier the ids and the hold's
    generation, nothing read off the board; a post without a generation is left to the
    general path, as is a lane whose views do not match its segments or a board CUDA cannot
    map."""
    from kvlink.gpu.lane import BoardDigest
    from kvlink.holdboard import LAYOUT
    from kvlink.transport import LaneDigests, XferStatus

    t, mapped, (local_base, remote_base) = _mapping_transport(monkeypatch, "p", 0xB0A4D)
    digests = LaneDigests(4096, 0x6E0, 0x3E1, 2, 1, (0x7000_0000, 1 << 20), LAYOUT)
    lane = t.lane(Op.READ, "p", local_base, remote_base, 4096, (64, 64), digests)
    assert lane is not None and mapped == [(0x7000_0000, 1 << 20)]
    # (the board as the device sees it, and as we do: where a post reads its hold's slot)
    assert lane.moves.digest == BoardDigest(1, 4096, 0x6E0, 0x3E1, 0xB0A4D, LAYOUT, 0x7000_0000)
    lids, rids = np.array([3, 1, 2], dtype=np.int64), np.array([0, 5, 6], dtype=np.int64)
    assert lane.post(lids, rids) is None  # no hold to compare with: the general path
    h = lane.post(lids, rids, 77, True)
    c = t._copier.copies[-1]
    assert c.args[1] is rids and c.args[2] is lids and c.args[4:] == (77, True)
    c.event.done = True
    assert t.poll(h).status is XferStatus.DONE
    assert len(mapped) == 1  # bound once, not per post
    wrong = digests._replace(planes=4)  # views of other planes than the segments
    assert t.lane(Op.READ, "p", local_base, remote_base, 4096, (64, 64), wrong) is None
    assert t.lane(Op.WRITE, "p", local_base, remote_base, 4096, (64, 64), digests) is None
    # an injected fault: CUDA refuses to map the board (the transport then says 0)
    monkeypatch.setattr(t, "_host_map", lambda region, ro, why: 0)
    assert t.lane(Op.READ, "p", local_base, remote_base, 4096, (64, 64), digests) is None


def test_a_push_through_a_lane_moves_its_landing_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push's WRITE into a landing board takes the peer's WRITE lane with its signal: the
    copier gets the ids (ours to theirs) and the flag as the device sees it (the board mapped
    once); a board CUDA cannot map leaves the post to the general path (None), which ends the
    push by its note. Until this stop a push never took a lane (bench/results/gpu_push_lane/)."""
    from kvlink.landing import Signal
    from kvlink.transport import XferStatus

    t, mapped, (local_base, remote_base) = _mapping_transport(monkeypatch, "d", 0xB0A0)
    lane = t.lane(Op.WRITE, "d", local_base, remote_base, 4096, (64, 64))
    lids, rids = np.array([3, 1, 2], dtype=np.int64), np.array([0, 5, 6], dtype=np.int64)
    board = (0x7000_0000, 1 << 20)
    view = types.SimpleNamespace(base=board[0], nbytes=board[1])  # (a landing board's mapping)
    h = lane.post(lids, rids, signal=Signal(view, 0x48, 11, 99))  # type: ignore[arg-type]
    c = t._copier.copies[-1]
    assert c.args[1] is lids and c.args[2] is rids  # a WRITE: ours to theirs
    assert c.signal == (0xB0A0 + 0x48, 11, 99) and mapped == [board]
    c.event.done = True
    assert t.poll(h).status is XferStatus.DONE
    # an injected fault: CUDA refuses to map the board (the transport then says 0)
    monkeypatch.setattr(t, "_host_map", lambda region, ro, why: 0)
    n = len(t._copier.copies)
    assert lane.post(lids, rids, signal=Signal(view, 0x48, 11, 99)) is None  # type: ignore[arg-type]
    assert len(t._copier.copies) == n  # nothing posted: the general path takes it


class _MarkingCopier(_FakeLaneCopier):
    """The copier's marks (kvlink.gpu.copy.BatchCopier.mark/passed): an event after every copy
    enqueued so far, passed once all of those copies ended (a stand-in, as the other fakes
    here: no GPU; scripts/gpu_runs_check.py runs the real events)."""

    def mark(self, stream: object) -> int:
        self.marks = getattr(self, "marks", [])
        self.marks.append(list(self.copies))
        return len(self.marks) - 1

    def passed(self, event: int) -> bool:
        return all(c.event.done for c in self.marks[event])


def test_a_let_go_hold_board_is_unregistered_once_no_copy_can_read_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped peer's hold board (kvlink.peers hands it to forget_host_region) was
    registered with CUDA for its digest lane: 66 MiB pinned, left behind at every producer
    restart before. It is unregistered once the copies posted before the drop ended — not
    under one still running, which may read it — at the poll that sees them end, once; and
    a board mapped anew at the same address waits for that."""
    from kvlink.gpu import ipc
    from kvlink.holdboard import LAYOUT
    from kvlink.transport import LaneDigests, XferStatus

    t = _fake_transport(monkeypatch)
    t._copier = _MarkingCopier()
    # stand-ins for CUDA's host registration (no GPU here): they record what is (un)mapped
    registered: list[int] = []
    unregistered: list[int] = []
    monkeypatch.setattr(ipc, "host_register",
                        lambda base, n, ro=False: registered.append(base) or base + 0xD000)
    monkeypatch.setattr(ipc, "host_unregister", unregistered.append)
    t.connect("p", _desc(4242, b"a" * 64))
    local_base = np.array([0x1000, 0x1000 + (64 << 12)], dtype=np.uint64)
    remote_base = np.array([0x9000, 0x9000 + (64 << 12)], dtype=np.uint64)
    board = (0x7000_0000, 1 << 20)
    digests = LaneDigests(4096, 0x6E0, 0x3E1, 2, 1, board, LAYOUT)
    lane = t.lane(Op.READ, "p", local_base, remote_base, 4096, (64, 64), digests)
    assert lane is not None and registered == [board[0]]
    h = lane.post(np.array([3, 1], dtype=np.int64), np.array([0, 5], dtype=np.int64), 77)
    t.disconnect("p")  # the producer restarted: dropped, with its board
    t.forget_host_region(board)
    assert unregistered == []  # its copy still runs and may read the board
    assert t._host_map(board, True, "%s") == 0  # nor is it mapped anew meanwhile
    t._copier.copies[-1].event.done = True
    assert t.poll(h).status is XferStatus.FAILED  # (its peer was dropped under it)
    assert unregistered == [board[0]]
    assert t._host_map(board, True, "%s") == board[0] + 0xD000  # a new board there: mapped
    assert registered == [board[0], board[0]]
    t.forget_host_region((0x5000_0000, 4096))  # never registered: nothing to do
    t.close()
    assert unregistered == [board[0], board[0]]  # the new one at close, the old not again
