"""The worker's lanes (``kvlink.worker.parts._post_lane``) on CPU.

The only transport with a lane, cuda_ipc, needs a GPU (its lane runs in
``scripts/gpu_runs_check.py``, ``scripts/gpu_stream_order_check.py`` and the GPU benches). Here
real tcp moves the bytes, under a lane hook of this test's own: it expands a lane's post into
extents and posts them on tcp, and counts what each lane was asked — so what is checked is the
worker's side (which lane a request takes, when it posts the general way, what a finished
receive still means) with real bytes and a real producer behind it. The hook is a stand-in for a
component this machine cannot run (no GPU), not a fault injection; the GPU scripts run the real
one.
"""

from __future__ import annotations

import gc
import operator
import threading
import time
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from test_lifecycle import blocks, make, outcome, remote, sleep_until, until

from kvlink.errors import BlockIdOutOfRange, KVLinkError
from kvlink.integrity import Level
from kvlink.layout import check_in_range
from kvlink.transport import (
    PENDING,
    Capabilities,
    Op,
    XferState,
    XferStatus,
    make_extents,
    register_transport,
)
from kvlink_transports.tcp import TcpTransport
from kvlink_transports.tcp.client import _Xfer


class _Lane:
    """One lane: whole ``unit``-byte blocks over the bases, as cuda_ipc's kernel computes them."""

    def __init__(self, owner: LaneTcp, op: Op, peer: str, local_base: Any, remote_base: Any,
                 unit: int, blocks: tuple[int, int], digests: Any) -> None:
        self.owner, self.op, self.peer, self.unit, self.blocks = owner, op, peer, unit, blocks
        self.local_base, self.remote_base = local_base, remote_base
        self.digests = digests  # a digest lane: it takes only posts with a generation
        self.posts = self.declined = 0
        self.generations: list[int] = []  # what each post was told
        self.samples: list[bool] = []

    def post(self, local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64],
             generation: int = 0, sample: bool = False) -> int | None:
        if (bool(generation) != (self.digests is not None)
                or len(local_ids) > self.owner.lane_limit):
            self.declined += 1
            return None
        self.posts += 1
        self.generations.append(generation)
        self.samples.append(sample)
        self.owner.posted.append(self.owner.in_flight())
        try:  # as cuda_ipc's kernel: an id out of its side's range is refused, and named
            check_in_range(local_ids, self.blocks[0], "local")
            check_in_range(remote_ids, self.blocks[1], "remote")
        except BlockIdOutOfRange as exc:
            return self.owner.refused(str(exc))
        u = np.uint64(self.unit)

        def ext(base: Any, ids: npt.NDArray[np.int64]) -> Any:
            return make_extents((base[:, None] + ids.astype(np.uint64)[None, :] * u).ravel(),
                                self.unit)

        return self.owner.post(self.op, self.peer, ext(self.local_base, local_ids),
                               ext(self.remote_base, remote_ids))


class LaneTcp(TcpTransport):
    """tcp with a lane hook, and as cuda_ipc: no ticket checks (a lane's post carries none), no
    native notifications (a WRITE's "written" note goes over the side channel, so the WRITE
    itself may take a lane)."""

    name = "lane_tcp"
    capabilities = Capabilities(ops=frozenset({Op.READ, Op.WRITE}),
                                memory_kinds=frozenset({"cpu"}), python_threads=True,
                                native_notifications=False)
    coalesce_runs = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: notified as each transfer ends (after its state is set): what a test waits on
        self.ended = threading.Condition()
        self.lanes: list[_Lane] = []
        self.lane_limit = 1 << 20
        #: at each lane post, the worker's requests in flight then (in_flight: set by a test)
        self.posted: list[set[str]] = []
        self.in_flight: Any = set
        self.forgotten: list[tuple[int, int]] = []  # forget_host_region's regions

    def lane(self, op: Op, peer: str, local_base: Any, remote_base: Any, unit: int,
             blocks: tuple[int, int], digests: Any = None) -> _Lane:
        made = _Lane(self, op, peer, local_base, remote_base, unit, blocks, digests)
        self.lanes.append(made)
        return made

    def forget_host_region(self, region: tuple[int, int]) -> None:
        """The hook cuda_ipc unregisters a dropped peer's hold board with: recorded."""
        self.forgotten.append(region)

    def _finish(self, xfer: _Xfer, state: XferState) -> None:
        super()._finish(xfer, state)
        with self.ended:
            self.ended.notify_all()

    def refused(self, why: str) -> int:
        """A handle that polls FAILED with ``why`` (as a post the device refused)."""
        handle = next(self._handles)
        empty = make_extents(np.zeros(0, np.uint64), 0)
        xfer = _Xfer(Op.READ, empty, empty, None, 0, time.perf_counter())
        with self._lock:
            self._xfers[handle] = xfer
        self._finish(xfer, XferState(XferStatus.FAILED, why))
        return handle


register_transport("lane_tcp", LaneTcp)


class FusingLaneTcp(LaneTcp):
    """LaneTcp whose lanes are made digesting, as cuda_ipc's are with integrity on, and whose
    "kernel" compared nothing (``landed_check`` None: a unit found no rows on the board) — the
    case the worker must send through its host check. The worker's side of a digest lane, with
    real bytes behind it; the GPU scripts run the kernel."""

    name = "fusing_lane_tcp"
    fuses_digests = True

    def landed_check(self, handle: int) -> tuple[int, int] | None:
        return None


register_transport("fusing_lane_tcp", FusingLaneTcp)


class _ListLane(_Lane):
    """A lane that takes the caller's ids as they come, as cuda_ipc's C launcher does
    (kvlink/_native.c: a list of ints, each through __index__, or a 1-D int64 array;
    anything else raises before anything is posted), and records what it was handed."""

    takes_lists = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.handed: list[tuple[Any, Any]] = []
        self.launched: dict[int, tuple[Any, Any]] = {}

    def post(self, local_ids: Any, remote_ids: Any, generation: int = 0,
             sample: bool = False) -> int | None:
        self.handed.append((local_ids, remote_ids))
        n = len(local_ids)
        if n > self.owner.lane_limit:  # as cuda_ipc: past its launch, declined unread
            self.declined += 1
            return None
        ids = [self._taken(x, n) for x in (remote_ids, local_ids)]  # (source first, as C)
        handle = super().post(ids[1], ids[0], generation, sample)
        if handle is not None:
            self.launched[handle] = (ids[1], ids[0])
        return handle

    def posted_ids(self, handle: int) -> tuple[Any, Any] | None:
        """As cuda_ipc's: the ids the post launched with, int64, the lane's own."""
        return self.launched.get(handle)

    @staticmethod
    def _taken(ids: Any, n: int) -> npt.NDArray[np.int64]:
        if type(ids) is list:
            if len(ids) != n:
                raise ValueError(f"expected {n}, got a list of {len(ids)}")
            out = np.array([operator.index(v) for v in ids], dtype=object)
            if any(not -2**63 <= v < 2**63 for v in out):
                raise OverflowError("an id past 64 bits")
            return out.astype(np.int64)
        if (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1
                and len(ids) == n):
            return ids.copy()
        raise ValueError(f"not a list of ints or an int64 array: {type(ids).__name__}")


class ListLaneTcp(LaneTcp):
    """LaneTcp whose lanes take the caller's ids as they come (:class:`_ListLane`)."""

    name = "list_lane_tcp"

    def lane(self, op: Op, peer: str, local_base: Any, remote_base: Any, unit: int,
             blocks: tuple[int, int], digests: Any = None) -> _Lane:
        made = _ListLane(self, op, peer, local_base, remote_base, unit, blocks, digests)
        self.lanes.append(made)
        return made


register_transport("list_lane_tcp", ListLaneTcp)


class ProbeLaneTcp(LaneTcp):
    """LaneTcp whose lane posts offer ``end_probe`` as cuda_ipc's do (kvlink.transport, rule
    7): a call that says how a copy ended without the transport's poll — here the tcp
    transfer's own state, read as it is — and a poll that records what it was asked. A copy
    in ``stuck`` reads as moving both ways (an injected fault: tcp cannot be held
    mid-transfer on demand). The worker's side, with real bytes behind it; the GPU scripts
    and benches run cuda_ipc's probe."""

    name = "probe_lane_tcp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.polled: list[int] = []
        self.stuck: set[int] = set()

    def poll(self, handle: int) -> XferState:
        self.polled.append(handle)
        return PENDING if handle in self.stuck else super().poll(handle)

    def end_probe(self, handle: int) -> Any:
        x = self._xfers.get(handle)
        if x is None:
            return None

        def probe() -> int | None:
            status = x.state.status
            if handle in self.stuck or (status is XferStatus.PENDING and not x.has_landed):
                return None
            return -1 if status is XferStatus.FAILED else 0

        return probe

    def release(self, handle: int) -> None:
        """As cuda_ipc's: a transfer that ended unpolled is taken as poll() takes it first."""
        x = self._xfers.get(handle)
        if x is not None and x.state.status is XferStatus.PENDING:
            self.poll(handle)
        super().release(handle)


class FusingProbeLaneTcp(ProbeLaneTcp):
    """ProbeLaneTcp whose lanes are made digesting (as FusingLaneTcp's), and whose "kernel"
    found every digest of a post equal — two rows, the posts' two blocks — except for the
    handles in ``differs``: there it found the first one different. Its probe and
    ``landed_check`` say so as cuda_ipc's read the kernel's check words. A stand-in for the
    copy kernel (no GPU here; scripts/gpu_fused_digest_check.py runs the real one)."""

    name = "fusing_probe_lane_tcp"
    fuses_digests = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.differs: set[int] = set()

    def end_probe(self, handle: int) -> Any:
        ended = super().end_probe(handle)
        if ended is None:
            return None

        def probe() -> int | None:
            got = ended()
            if got is None or got < 0:
                return got
            return -1 if handle in self.differs else 2

        return probe

    def landed_check(self, handle: int) -> tuple[int, int] | None:
        return (0, 2) if handle in self.differs else (-1, 2)


register_transport("probe_lane_tcp", ProbeLaneTcp)
register_transport("fusing_probe_lane_tcp", FusingProbeLaneTcp)


def _pair(transport: str = "lane_tcp", **cfg: Any) -> tuple[Any, Any]:
    prefill, _ = make("p", seed=1, transports=[transport], grants=False, **cfg)
    decode, _ = make("d", transports=[transport], grants=False, **cfg)
    return prefill, decode


def _read(decode: Any, prefill: Any, rid: str, ours: list[int], theirs: list[int]) -> None:
    gen = prefill.hold(rid, theirs)
    decode.read(rid, remote(prefill), ours, theirs, generation=gen)
    ok, reason = outcome(decode, rid)
    assert ok, reason
    assert np.array_equal(blocks(decode, ours), blocks(prefill, theirs))


def _digest_pair(transport: str) -> tuple[Any, Any]:
    """A producer and a consumer at integrity ``full`` over a digest lane's stand-in
    ``transport``, the consumer's views given as the copy kernel would take them (a stand-in,
    not a fault: CPU planes have none, no GPU here — device pointers the stand-in lane never
    dereferences)."""
    prefill, _ = make("p", seed=1, transports=[transport], grants=False, integrity="full")
    decode, _ = make("d", transports=[transport], grants=False, integrity="full")
    decode.integrity.fused_views = lambda: (  # type: ignore[method-assign]
        0x6E0, 0x3E1, 2 * decode.spec.num_layers, decode.spec.num_kv_heads)
    return prefill, decode


def _routed(decode: Any, prefill: Any) -> None:
    """Two READs: the second binds the route the next ones launch through."""
    _read(decode, prefill, "warm0", [4, 5], [2, 3])
    _read(decode, prefill, "warm1", [6], [7])


def test_reads_take_the_peers_lane_bound_once() -> None:
    """Every READ of a peer goes through one lane, made at the first: same bytes, and the
    request's accounting (bytes, extents) read back as on the general path."""
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _read(decode, prefill, "r0", [4, 5, 6], [2, 3, 9])
        _read(decode, prefill, "r1", [1, 7], [8, 0])
        assert len(t.lanes) == 1 and t.lanes[0].posts == 2 and t.lanes[0].op is Op.READ
        assert decode.finished_bytes == 5 * decode.spec.num_layers * 2 * decode.spec.page_bytes
        assert decode.descriptor_counts()[1] == 5 * decode.spec.num_layers * 2
    finally:
        decode.close()
        prefill.close()


def test_a_request_the_lane_declines_is_posted_the_general_way() -> None:
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        t.lane_limit = 2
        _read(decode, prefill, "big", [4, 5, 6], [2, 3, 9])
        _read(decode, prefill, "small", [1, 7], [8, 0])
        assert t.lanes[0].declined == 1 and t.lanes[0].posts == 1
    finally:
        decode.close()
        prefill.close()


def test_each_integrity_setting_keeps_its_own_lane() -> None:
    """A level switched at run time (bench/integrity_overhead.py does) must not leave ``off``
    requests on the lane made for a digesting level, which declines them: they took the
    general path (fbc345c kept one lane per peer, made for whichever level came first)."""
    prefill, decode = _pair(integrity="full")
    try:
        t = decode.transports["lane_tcp"]
        _read(decode, prefill, "checked", [4, 5], [2, 3])  # tcp digests on the host: general
        decode.integrity.level = Level("off")
        _read(decode, prefill, "off1", [6, 7], [9, 1])
        _read(decode, prefill, "off2", [8], [0])
        plain = [ln for ln in t.lanes if ln.digests is None]
        assert len(plain) == 1 and plain[0].posts == 2 and plain[0].declined == 0
        assert all(ln.posts == 0 and ln.declined == 0 for ln in t.lanes if ln.digests)
    finally:
        decode.close()
        prefill.close()


def test_a_write_takes_its_own_lane() -> None:
    """WRITE (the decode pushing its blocks into the producer's) goes through a lane of its
    own op: the producer's blocks hold the decode's bytes after."""
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _read(decode, prefill, "r0", [4, 5], [2, 3])
        decode.write("w0", remote(prefill), [1, 6], [10, 11])
        ok, reason = outcome(decode, "w0")
        assert ok, reason
        assert np.array_equal(blocks(prefill, [10, 11]), blocks(decode, [1, 6]))
        assert sorted((ln.op.value, ln.posts) for ln in t.lanes) == [("read", 1), ("write", 1)]
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("routed", [False, True], ids=["posted", "launched_first"])
def test_a_lane_read_whose_hold_ends_under_it_is_not_trusted(routed: bool) -> None:
    """A READ posted through a lane is validated like any other: the hold is withdrawn (its
    lease expires) before the READ's end is seen, so the board's after-check fails, the round
    trip says why and the request fails, though every byte arrived. ``launched_first``: the
    READ is the route's (the lane saw it before its records); a route that skipped the
    after-check would finish it."""
    prefill, _ = make("p", seed=1, transports=["lane_tcp"], grants=False, lease_seconds=0.5,
                      read_seconds=0.1)
    decode, _ = make("d", serve=False, transports=["lane_tcp"], grants=False)
    try:
        t = decode.transports["lane_tcp"]
        t.in_flight = lambda: set(decode._requests)
        if routed:
            _routed(decode, prefill)
        else:
            _read(decode, prefill, "warm", [1], [0])
        gen = prefill.hold("r0", [2, 3])
        decode.read("r0", remote(prefill), [7, 8], [2, 3], generation=gen)
        assert ("r0" in t.posted[-1]) is not routed  # records first, or launched first
        req = decode._requests["r0"]
        part = req.parts[0]
        assert part.handle is not None  # posted; on the board: its after-check bound at the
        # post, or (launched first) by the first look at it, its records owed till then
        assert (part.check is not None) is not routed and (req.route is not None) is routed
        assert t.lanes[0].posts == (3 if routed else 2)  # through the lane
        sleep_until(time.monotonic() + 0.6)  # the decode's step stalls past the lease
        assert "r0" in [r.req_id for r in prefill.released()]
        ok, reason = outcome(decode, "r0", 10)
        assert not ok and "not confirmed" in reason
    finally:
        prefill.close()
        decode.close()


def _held_on_route(decode: Any, prefill: Any, rid: str, transport: str = "probe_lane_tcp"
                   ) -> tuple[Any, int]:
    """READ ``rid`` (prefill blocks 8, 9 into decode blocks 1, 2) on its route with its copy
    held (ProbeLaneTcp.stuck), and the poll that makes its records: (transport, handle)."""
    t = decode.transports[transport]
    gen = prefill.hold(rid, [8, 9])
    decode.read(rid, remote(prefill), [1, 2], [8, 9], generation=gen)
    handle = decode._requests[rid].parts[0].handle
    t.stuck.add(handle)
    assert decode.poll() == (set(), {})
    assert decode._requests[rid].early  # its records made, its probe and after-check bound
    until(lambda: t._xfers[handle].has_landed, 10, "the bytes moved")
    return t, handle


def test_a_routed_read_is_reported_on_its_probe_and_after_check_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ on its route whose copy ended DONE, its hold still shown on the producer's board
    after it, is reported by the poll that sees the end without asking its transport's poll
    (``end_probe`` read instead) — that poll's bookkeeping, the transfer's record, the
    board count and the producer's report follow off the request's path, and nothing of them
    is lost: the transfer is recorded, the producer is told and releases the hold. Until
    this stop the reporting poll took the transport's poll and every record on its way."""
    _threadless(monkeypatch)
    prefill, decode = _pair("probe_lane_tcp")
    try:
        _routed(decode, prefill)
        decode.poll()  # (what the warm-up READs owe leaves)
        decode.take_transfers()
        validated, moved = decode.board_validated, decode.finished_bytes
        t, handle = _held_on_route(decode, prefill, "r")
        t.stuck.clear()
        t.polled.clear()
        done, failed = decode.poll()
        assert (done, failed) == ({"r"}, {})
        assert handle not in t.polled, "the reporting poll asked the transport's poll"
        assert np.array_equal(blocks(decode, [1, 2]), blocks(prefill, [8, 9]))
        assert decode.reports_owed and decode.pending()  # the producer is still owed its report
        got = decode.take_transfers()  # (settles what is owed)
        assert [(x.transport, x.ok) for x in got] == [("probe_lane_tcp", True)]
        assert got[0].nbytes > 0 and decode.finished_bytes == moved + got[0].nbytes
        assert "r" in decode.phases and "r" in decode.xfer_seconds
        assert decode.board_validated == validated + 1
        assert handle in t.polled  # the transport took the end as it would have (release)
        until(lambda: decode.poll() is not None and "r" in [
            x.req_id for x in prefill.released()], 10, "the producer released the hold")
        assert decode.pending() == 0
    finally:
        decode.close()
        prefill.close()


def test_a_routed_read_whose_hold_ended_under_it_is_not_reported_on_its_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the hold ends (its lease expires) before the copy's end is seen: the
    probe says DONE, the after-check does not show the hold, and the READ fails as any
    other would ("not confirmed"), though every byte arrived."""
    _threadless(monkeypatch)
    prefill, _ = make("p", seed=1, transports=["probe_lane_tcp"], grants=False,
                      lease_seconds=0.5, read_seconds=0.1)
    decode, _ = make("d", transports=["probe_lane_tcp"], grants=False)
    try:
        _routed(decode, prefill)
        decode.poll()
        t, _ = _held_on_route(decode, prefill, "r")
        sleep_until(time.monotonic() + 0.6)  # the decode's step stalls past the lease
        assert "r" in [x.req_id for x in prefill.released()]
        t.stuck.clear()
        ok, reason = outcome(decode, "r", 10)
        assert not ok and "not confirmed" in reason
    finally:
        prefill.close()
        decode.close()


def test_a_routed_read_whose_copy_failed_is_reported_by_its_transports_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that says the copy did not end DONE sends the READ through the step: the
    transport's poll says why, and the request fails naming it."""
    _threadless(monkeypatch)
    prefill, decode = _pair("probe_lane_tcp")
    try:
        _routed(decode, prefill)
        decode.poll()
        t, handle = _held_on_route(decode, prefill, "r")
        x = t._xfers[handle]
        x.state = XferState(XferStatus.FAILED, "an injected failure")  # (a fault: injected)
        t.stuck.clear()
        ok, reason = outcome(decode, "r", 10)
        assert not ok and "an injected failure" in reason, reason
    finally:
        decode.close()
        prefill.close()


def test_a_digest_lanes_read_ends_early_only_where_its_kernel_found_every_digest_equal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Integrity on, a routed READ through a digest lane: where its kernel found every
    digest equal to the producer's (the stand-in's word, read as cuda_ipc's probe reads the
    kernel's check words), the READ ends early and its rows count as checked on the device;
    where the kernel found one different, the READ takes the general step and fails closed —
    though the bytes landed intact and the host's own check of them passes: the kernel's
    word is not overruled."""
    _threadless(monkeypatch)
    prefill, decode = _digest_pair("fusing_probe_lane_tcp")
    try:
        _routed(decode, prefill)
        decode.poll()
        checked, fused = decode.integrity.checked_blocks, decode.integrity.fused_blocks
        t, handle = _held_on_route(decode, prefill, "equal", "fusing_probe_lane_tcp")
        t.stuck.clear()
        t.polled.clear()
        assert decode.poll()[0] == {"equal"} and handle not in t.polled  # ended early
        decode.take_transfers()  # (settles what it owes)
        assert decode.integrity.checked_blocks == checked + 2
        assert decode.integrity.fused_blocks == fused + 2
        t, handle = _held_on_route(decode, prefill, "differs", "fusing_probe_lane_tcp")
        t.differs.add(handle)
        t.stuck.clear()
        ok, reason = outcome(decode, "differs", 10)
        assert not ok and "copy kernel's digest" in reason, reason
        assert np.array_equal(blocks(decode, [1, 2]), blocks(prefill, [8, 9]))  # intact
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("transport", ["lane_tcp", "list_lane_tcp"])
def test_a_read_told_its_generation_launches_before_its_records(transport: str) -> None:
    """Once a remote's READs took lanes, the next READ told its generation is launched
    before the worker makes any record of it (its latency is the host time before the
    launch): the lane sees it posted while the request is not in flight yet. At 9e53c8e the
    records came first, so every post saw its own request."""
    prefill, decode = _pair(transport)
    try:
        t = decode.transports[transport]
        t.in_flight = lambda: set(decode._requests)
        # the first waits for the handshake; the second is posted at read() and binds the
        # route; the rest are launched first
        _read(decode, prefill, "r0", [4, 5, 6], [2, 3, 9])
        _read(decode, prefill, "r1", [1, 7], [8, 0])
        _read(decode, prefill, "r2", np.array([3, 2], dtype=np.int32), [5, 6])
        _read(decode, prefill, "r3", [0], [1])
        assert [f"r{i}" in seen for i, seen in enumerate(t.posted)] == [True, True, False,
                                                                        False]
        assert t.lanes[0].posts == 4 and len(t.lanes) == 1
        assert decode.phases["r2"].post > 0 and decode.xfer_seconds["r2"] > 0
        planes = decode.spec.num_layers * 2  # what the launched ones moved, counted as posted
        assert decode.finished_bytes == 8 * planes * decode.spec.page_bytes
        assert decode.descriptor_counts() == (8 * planes, 8 * planes)
    finally:
        decode.close()
        prefill.close()


def test_reads_launched_at_once_are_launched_back_to_back() -> None:
    """A caller reading several requests at once (vLLM's start_load_kv) gets them launched one
    after the other: read() makes no record of a route's READ after its launch (what it
    moves, its after-check's binding) — the first look at it does, a poll, while the bytes
    move. Before, each read() made them between two launches, the device idle meanwhile.
    Every request is still validated on the board and its bytes land."""
    prefill, decode = _pair()
    try:
        _routed(decode, prefill)
        rids = ["a", "b", "c"]
        ours, theirs = [[1, 2], [3, 4], [5, 6]], [[8, 9], [10, 11], [12, 13]]
        for rid, o, th in zip(rids, ours, theirs):
            decode.read(rid, remote(prefill), o, th, generation=prefill.hold(rid, th))
        reqs = [decode._requests[r] for r in rids]
        assert all(r.route is not None and r.nbytes == 0
                   and r.parts[0].check is None and r.parts[0].handle is not None
                   for r in reqs)  # launched, nothing recorded yet
        validated = decode.board_validated
        done: set[str] = set()
        until(lambda: not done.update(decode.poll()[0]) and done == set(rids), 20,
              "all three finished")
        for o, th in zip(ours, theirs):
            assert np.array_equal(blocks(decode, o), blocks(prefill, th))
        assert all(r.route is None and r.nbytes > 0 and r.parts[0].check is not None
                   for r in reqs)  # recorded by the polls
        assert decode.board_validated == validated + 3  # each after-checked on the board
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("side", ["local", "remote"])
def test_an_id_out_of_range_fails_a_launched_read_naming_it(side: str) -> None:
    """Launched first, a READ's ids are range-checked by the lane (cuda_ipc: its kernel), not
    before: an id out of range fails the request, and the reason names it."""
    prefill, decode = _pair()
    try:
        _routed(decode, prefill)
        ours, theirs = ([1, 10**6], [8, 0]) if side == "local" else ([1, 7], [8, 10**6])
        gen = prefill.hold("bad", [8, 0] if side == "local" else [8, 1])
        decode.read("bad", remote(prefill), ours, theirs, generation=gen)
        ok, reason = outcome(decode, "bad")
        assert not ok and f"{side} block id 1000000" in reason
        _read(decode, prefill, "after", [6], [7])  # the lane still takes the next
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("declines", [False, True])
@pytest.mark.parametrize("transport", ["lane_tcp", "list_lane_tcp"])
@pytest.mark.parametrize("bad", [[1.5, 2.0], ["1", "2"], [[1], [2]], [1, 2, 3], [1, 2**64]])
def test_ids_the_lane_cannot_take_are_refused_before_anything_moves(
        bad: Any, transport: str, declines: bool) -> None:
    """Floats, strings, nested lists, lengths that disagree, an id past 64 bits: raised at
    read(), as on the general path, and nothing was posted (numpy would have truncated 1.5
    to 1) — also where the lane is handed the caller's ids as they came, and where it
    declines the request without reading them (too many blocks for its launch)."""
    prefill, decode = _pair(transport)
    try:
        t = decode.transports[transport]
        _routed(decode, prefill)
        if declines:
            t.lane_limit = 1
        gen = prefill.hold("bad", [8, 9])
        with pytest.raises(KVLinkError):
            decode.read("bad", remote(prefill), bad, [8, 9], generation=gen)
        assert t.lanes[0].posts == 2 and "bad" not in decode._requests
    finally:
        decode.close()
        prefill.close()


def test_a_lane_that_takes_lists_is_handed_the_callers_ids_and_the_request_keeps_its_own(
        ) -> None:
    """A route whose lanes take the caller's ids as they come hands them over unconverted
    (their conversion before the launch was 31 us of a 70B READ's latency on one H200 host),
    and the request's records are copies of its own: the caller may reuse its lists once
    read() returned. Ids the lane does not take (a tuple, int32) are converted and posted
    again; the bytes are right either way."""
    prefill, decode = _pair("list_lane_tcp")
    try:
        t = decode.transports["list_lane_tcp"]
        _routed(decode, prefill)
        lane = t.lanes[0]
        ours, theirs = [9, 2, 5], [1, 8, 4]
        gen = prefill.hold("as-given", theirs)
        decode.read("as-given", remote(prefill), ours, theirs, generation=gen)
        assert lane.handed[-1][0] is ours and lane.handed[-1][1] is theirs
        req = decode._requests["as-given"]
        kept = (req.local_ids, req.remote_ids)
        launched = lane.launched[req.parts[0].handle]  # the lane's: no copy of ours
        assert kept[0] is launched[0] and kept[1] is launched[1]
        ours[0], theirs[0] = 11, 12  # reused by the caller
        assert kept[0].tolist() == [9, 2, 5] and kept[1].tolist() == [1, 8, 4]
        ok, reason = outcome(decode, "as-given")
        assert ok, reason
        assert np.array_equal(blocks(decode, [9, 2, 5]), blocks(prefill, [1, 8, 4]))
        posts = lane.posts
        for i, (mine, yours) in enumerate((((3, 6), [7, 0]),
                                           (np.array([3, 6], np.int32), [0, 7]))):
            _read(decode, prefill, f"converted{i}", mine, yours)  # type: ignore[arg-type]
            assert type(lane.handed[-1][0]) is np.ndarray  # converted, then posted again
        assert lane.posts == posts + 2 and len(t.lanes) == 1
    finally:
        decode.close()
        prefill.close()


def test_a_peer_handshaken_anew_is_read_through_its_new_lane() -> None:
    """A route is bound to the handshakes it was made from: after the peer is forgotten,
    the next READ handshakes again and takes a new lane (the old one's peer is gone)."""
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _read(decode, prefill, "r0", [4, 5], [2, 3])
        _read(decode, prefill, "r1", [6], [7])
        decode.forget_peer(prefill.config.engine_id, 0)
        t.in_flight = lambda: set(decode._requests)
        _read(decode, prefill, "r2", [1, 7], [8, 0])  # waits for the new handshake
        _read(decode, prefill, "r3", [9], [1])  # posted at read(): binds the new route
        _read(decode, prefill, "r4", [3], [5])
        assert [ln.posts for ln in t.lanes] == [2, 3]
        assert ["r3" in t.posted[-2], "r4" in t.posted[-1]] == [True, False]  # r4: first
    finally:
        decode.close()
        prefill.close()


def test_a_dropped_peers_board_is_let_go_with_its_lanes() -> None:
    """A peer dropped (forgotten here; a producer that restarted alike) hands its hold
    board's mapping to its transport to let go (cuda_ipc unregisters it from the device:
    66 MiB pinned a producer restart, kept for good before), and once the next lane is made
    nothing of ours holds the dropped peer or its board: its lanes and routes go too (at
    ec598d2 they kept it, and its mapping, alive)."""
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        (old,) = decode.peers.live()
        assert old.board is not None
        board, region = weakref.ref(old.board), old.board.region
        del old
        decode.forget_peer(prefill.config.engine_id, 0)
        assert t.forgotten == [region]
        _read(decode, prefill, "r2", [1, 7], [8, 0])  # a new handshake, a new lane
        _read(decode, prefill, "r3", [9], [1])  # and its route
        decode.poll()  # (what the READs owed the producer leaves: it held the old peer too)
        gc.collect()
        assert board() is None and len(t.lanes) == 2
    finally:
        decode.close()
        prefill.close()


def _landed(decode: Any, prefill: Any, rid: str, ours: list[int], theirs: list[int],
            poll: Any) -> None:
    """A READ told its generation, posted, and waited for until ``poll`` (the transport's, not
    the worker's) says its bytes landed: the worker's next poll then finds it DONE."""
    gen = prefill.hold(rid, theirs)
    decode.read(rid, remote(prefill), ours, theirs, generation=gen)
    handle = decode._requests[rid].parts[0].handle
    t = decode.transports[decode._requests[rid].parts[0].go.peer.transport.name]
    assert _ended(t, lambda: poll(handle).status is not XferStatus.PENDING), \
        f"{rid}'s transfer never ended"


def _ended(t: Any, cond: Any, timeout: float = 10.0) -> bool:
    """Wait until ``cond`` (a transfer's state, asked of the transport) holds: its bytes, not
    the worker's poll. Woken by the transport as its thread finishes a transfer, and each
    millisecond for a READ its C inbox took (that lands with no Python run, so nothing is
    notified; asking its state finishes it)."""
    deadline = time.monotonic() + timeout
    with t.ended:
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            t.ended.wait(min(left, 1e-3))
    return True


def test_a_poll_that_finishes_a_request_returns_before_the_rest_of_its_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One request at a time, each DONE by the poll that looks at it: every such poll reports
    it and returns, without serving the inbox first, while a whole poll ran within the window
    (kvlink.worker.engine._FULL_EVERY, widened here so the VM's pace does not decide). At
    9f1d728 every other one ran whole first (a flag flipped per poll): on one H200 that was
    every other request 0.14 ms later."""
    from kvlink.worker import engine

    monkeypatch.setattr(engine, "_FULL_EVERY", 60.0, raising=False)  # a knob, widened
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        served = []  # a spy, not a stand-in: the real serve_ready runs, counted
        serve = decode._server.serve_ready
        monkeypatch.setattr(decode._server, "serve_ready", lambda: served.append(1) or serve())
        whole = []
        for i in range(6):
            rid = f"r{i}"
            _landed(decode, prefill, rid, [1 + i, 7], [8, 9], t.poll)
            served.clear()
            done, failed = decode.poll()
            assert rid in done, failed
            whole.append(bool(served))
        assert whole == [False] * 6
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("other", [None, "threaded_in_flight"])
def test_a_poll_past_the_window_reports_at_once_when_nothing_else_waits(
        monkeypatch: pytest.MonkeyPatch, other: str | None) -> None:
    """One request at a time, each polled once its copy has ended and 0.1 s on, every poll past
    the 2 ms window (a serving loop polls once a step): with nothing else to do, the poll that
    reports the request returns without the rest of a poll (at 287154d it ran whole first:
    ~0.13 ms of a 70B request's window on one H200). With another request in flight whose
    bytes a transport's Python threads move (tcp's: held PENDING by the test, an injected
    fault), that poll is whole, as before: it hands those threads the GIL."""
    from kvlink.transport import PENDING
    from kvlink.worker import engine

    monkeypatch.setattr(engine, "_FULL_EVERY", 0.0, raising=False)  # every poll past it
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        decode.poll()  # idle, so whole: the routing READ's report to the producer leaves
        stuck: set[int] = set()
        real = t.poll
        monkeypatch.setattr(t, "poll", lambda h: PENDING if h in stuck else real(h))
        if other is not None:
            gen = prefill.hold("other", [10])
            decode.read("other", remote(prefill), [12], [10], generation=gen)
            stuck.add(decode._requests["other"].parts[0].handle)
        served = []  # a spy, not a stand-in: the real pump (a whole poll's) runs, counted
        pump = decode._chan.pump
        monkeypatch.setattr(decode._chan, "pump", lambda: served.append(1) or pump())
        whole = []
        for i in range(4):
            rid = f"q{i}"
            _landed(decode, prefill, rid, [1 + i, 7], [8, 9], real)
            sleep_until(time.monotonic() + 0.1)  # a request every 0.1 s: as a busy server's
            served.clear()  # (at ae970dc, 0.05 s after a whole poll, the next was whole again)
            done, failed = decode.poll()
            assert rid in done, failed
            whole.append(bool(served))
            if other is None:  # the loop's next step: an idle poll, which is whole (it sends
                decode.poll()  # the producer the report that lets it release, kept for it)
        assert whole == [other is not None] * 4
        stuck.clear()
        if other is not None:
            ok, reason = outcome(decode, "other")
            assert ok, reason
    finally:
        decode.close()
        prefill.close()


def test_the_poll_that_sees_a_copy_land_does_not_ask_again_what_a_poll_just_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller polling in a loop: one poll finds the READ still moving and nothing else to do
    (KVWorker._quiet), the next finds it DONE. That one reports it at once without asking
    again — a quiet answer counts like a whole poll for _FULL_EVERY — and without serving the
    inbox. At 959a4b7 it asked again past the whole poll's window: ~10 us of a 70B request's
    window, cold, on one H200 host (bench/results/gpu_stamps_e98e4fa/). Past that time, it
    asks again."""
    from kvlink.transport import PENDING
    from kvlink.worker import engine

    monkeypatch.setattr(engine, "_FULL_EVERY", 0.3, raising=False)  # a knob, widened
    _threadless(monkeypatch)
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        real = t.poll
        asked: list[bool] = []  # a spy, not a stand-in: the real _quiet runs, its answers kept
        quiet = decode._quiet
        monkeypatch.setattr(decode, "_quiet", lambda *a: asked.append(quiet(*a)) or asked[-1])
        served = []  # a spy: the real pump (a whole poll's) runs, counted
        pump = decode._chan.pump
        monkeypatch.setattr(decode._chan, "pump", lambda: served.append(1) or pump())
        for rid, wait in (("near", 0.0), ("far", 0.35)):
            decode.poll()  # idle, so whole (the report the last READ owes leaves)
            sleep_until(time.monotonic() + 0.35)  # past the whole poll's window
            gen = prefill.hold(rid, [8, 9])
            decode.read(rid, remote(prefill), [1, 2], [8, 9], generation=gen)
            # an injected fault: a copy that has not ended (tcp cannot be held mid-transfer
            # on demand), until the test lets it; everything else is the real transport
            stuck = {decode._requests[rid].parts[0].handle}
            monkeypatch.setattr(t, "poll", lambda h, s=stuck: PENDING if h in s else real(h))
            asked.clear()
            served.clear()
            assert decode.poll() == (set(), {})  # still moving, nothing else: quiet
            assert asked == [True] and not served
            stuck.clear()
            h = decode._requests[rid].parts[0].handle
            assert _ended(t, lambda h=h: real(h).status is not XferStatus.PENDING), \
                f"{rid}'s transfer never ended"
            sleep_until(time.monotonic() + wait)
            done, failed = decode.poll()
            assert rid in done, failed
            assert not served  # reported at once either way (nothing else waits)
            assert asked == ([True] if rid == "near" else [True, True]), (rid, asked)
            monkeypatch.setattr(t, "poll", real)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("whole", [False, True], ids=["quiet", "whole"])
def test_a_copy_that_lands_during_the_poll_that_made_its_records_is_reported_by_that_poll(
        monkeypatch: pytest.MonkeyPatch, whole: bool) -> None:
    """The first poll after a route's launch makes the READ's records while its copy runs,
    then the rest of its work (the quiet check; or, whole, the inbox and the rest). A copy that
    lands meanwhile is reported by that poll, which looks again as it ends — for a caller that
    sleeps between polls, a sleep sooner. At 6594195 the poll looked once, first, and left it
    to the next. The copy's end is placed inside the poll: held PENDING (an injected fault:
    tcp cannot be held mid-transfer on demand) until the poll's later step lets it end."""
    from kvlink.worker import engine

    monkeypatch.setattr(engine, "_FULL_EVERY", 0.3, raising=False)  # knobs, widened
    monkeypatch.setattr(engine, "_QUIET_FOR", 0.05, raising=False)
    _threadless(monkeypatch)
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        decode.poll()  # (what the warm-up READs owe leaves)
        if whole:
            sleep_until(time.monotonic() + 0.4)  # past the window and the quiet time
        handle, stuck, real = _read_held(monkeypatch, decode, prefill, "landing")
        landed: list[bool] = []

        def land() -> None:  # after the poll's first look: the copy ends now
            if stuck:
                stuck.clear()
                landed.append(_ended(t, lambda: real(handle).status is not XferStatus.PENDING))

        if whole:  # spies: the real steps run, after the copy is let end
            serve = decode._server.serve_ready
            monkeypatch.setattr(decode._server, "serve_ready", lambda: land() or serve())
        else:
            quiet = decode._quiet
            monkeypatch.setattr(decode, "_quiet", lambda *a: land() or quiet(*a))
        done, failed = decode.poll()
        assert landed == [True], "the poll did not take the step that lets the copy end"
        assert "landing" in done, (done, failed)
        assert np.array_equal(blocks(decode, [1, 2]), blocks(prefill, [8, 9]))
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize(("grace_us", "ends_in", "this_poll", "waits"), [
    (1e6, 0.001, True, True),  # expected to end within the grace: waited for, reported
    (1e6, 5.0, True, False),  # expected later than the grace allows: not waited for
    (0.0, 0.001, True, False),  # grace 0: no poll waits
    (1e6, 0.001, False, False),  # poll(grace=False): a poll before the caller's own work
])
def test_a_poll_waits_for_a_copy_its_transport_expects_to_end_within_its_grace(
        monkeypatch: pytest.MonkeyPatch, grace_us: float, ends_in: float, this_poll: bool,
        waits: bool) -> None:
    """A copy its transport expects to end within ``poll_grace_us`` (its ``ends_in`` hook,
    cuda_ipc's estimate) is waited for by the poll that finds it moving, and that poll
    reports it: a caller that sleeps between polls would see it a sleep later (a scheduler, a
    step later). One expected later, with a grace of 0, or asked of a poll told not to wait
    (vLLM's connector before a forward), is not waited for: the poll returns. The copy is
    held PENDING (an injected fault: tcp cannot be held mid-transfer on demand) until the
    worker asks when it ends; it then ends while the poll waits. The answer to that ask is a
    stand-in too: the real estimate is cuda_ipc's (kvlink.gpu.ends, tested by
    tests/test_copy_ends.py), which needs a GPU, and tcp has none. Until this stop no poll
    waited, and none reported it."""

    _threadless(monkeypatch)
    prefill, decode = _pair(poll_grace_us=grace_us)
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        decode.poll()  # (what the warm-up READs owe leaves)
        handle, stuck, _ = _read_held(monkeypatch, decode, prefill, "soon")
        asked: list[int] = []

        def when(h: int) -> float | None:  # asked: the copy ends now, expected in `ends_in`
            asked.append(h)
            stuck.discard(h)
            return ends_in if h == handle else None

        monkeypatch.setattr(t, "ends_in", when, raising=False)
        done, failed = decode.poll(grace=this_poll)
        assert ("soon" in done) == waits, (done, failed)
        assert asked == ([handle] if grace_us and this_poll else [])
        grace = decode.poll_grace  # what the waits did, read back
        assert (grace.waits, grace.reported, grace.timed_out) == ((1, 1, 0) if waits
                                                                  else (0, 0, 0))
        assert (grace.seconds > 0) == waits
        if not waits:  # it ended meanwhile (or is let end now): the next polls report it
            stuck.clear()
            ok, reason = outcome(decode, "soon")
            assert ok, reason
        assert np.array_equal(blocks(decode, [1, 2]), blocks(prefill, [8, 9]))
    finally:
        decode.close()
        prefill.close()


def _read_held(monkeypatch: pytest.MonkeyPatch, decode: Any, prefill: Any, rid: str
               ) -> tuple[int, set[int], Any]:
    """READ ``rid`` (prefill blocks 8, 9 into decode blocks 1, 2) on its route, its copy held
    PENDING while its handle is in the returned set (an injected fault: tcp cannot be held
    mid-transfer on demand). Returns (handle, that set, the transport's own poll)."""
    from kvlink.transport import PENDING

    t = decode.transports["lane_tcp"]
    gen = prefill.hold(rid, [8, 9])
    decode.read(rid, remote(prefill), [1, 2], [8, 9], generation=gen)
    handle = decode._requests[rid].parts[0].handle
    stuck = {handle}
    real = t.poll
    monkeypatch.setattr(t, "poll", lambda h: PENDING if h in stuck else real(h))
    return handle, stuck, real


def _threadless(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in says its transfers are moved by no Python thread, as cuda_ipc's are (tcp's
    threads move the bytes: the flag only decides whether a poll hands the GIL over)."""
    monkeypatch.setattr(LaneTcp, "capabilities", Capabilities(
        ops=frozenset({Op.READ, Op.WRITE}), memory_kinds=frozenset({"cpu"}),
        python_threads=False, native_notifications=False))


def test_a_poll_with_only_requests_in_flight_stays_short_and_a_whole_one_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request on its transport (here one whose copy is held PENDING by the test), nothing
    else to do: each poll looks at that request and returns, without serving the inbox —
    within the window and, quiet as it is, for _QUIET_FOR past it; then one poll is whole
    again. At 35002c4 every poll that finished nothing ran whole (a tight-loop caller saw a
    copy land only after the inbox's turn); at 287154d every poll past the window did."""
    from kvlink.transport import PENDING
    from kvlink.worker import engine

    # knobs, widened so the VM's pace does not decide: 0.2 s window, quiet 0.2 s past it
    monkeypatch.setattr(engine, "_FULL_EVERY", 0.2, raising=False)
    monkeypatch.setattr(engine, "_QUIET_FOR", 0.2, raising=False)
    _threadless(monkeypatch)
    prefill, decode = _pair()
    try:
        t = decode.transports["lane_tcp"]
        _routed(decode, prefill)
        gen = prefill.hold("held", [8, 9])
        decode.read("held", remote(prefill), [1, 2], [8, 9], generation=gen)
        # an injected fault: a copy that has not ended (tcp cannot be held mid-transfer on
        # demand), until the test lets it; everything else is the real transport
        stuck = {decode._requests["held"].parts[0].handle}
        real = t.poll
        monkeypatch.setattr(t, "poll", lambda h: PENDING if h in stuck else real(h))
        served: list[float] = []  # a spy: the real serve_ready runs, counted
        serve = decode._server.serve_ready
        monkeypatch.setattr(decode._server, "serve_ready",
                            lambda: served.append(time.monotonic()) or serve())
        sleep_until(time.monotonic() + 0.45)  # past any window and quiet time: whole
        decode.poll()
        assert served
        start, polls = time.monotonic(), 0
        while time.monotonic() - start < 0.35:  # the window, and most of the quiet time
            served.clear()
            assert decode.poll() == (set(), {})
            polls += 1
            assert not served, f"poll {polls} served the inbox {time.monotonic() - start:.3f} s in"
        sleep_until(start + 0.45)  # past both: the next poll is whole
        decode.poll()
        assert served
        stuck.clear()
        ok, reason = outcome(decode, "held")
        assert ok, reason
    finally:
        decode.close()
        prefill.close()


def test_a_launched_read_whose_records_fail_is_failed_not_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a route's launch nothing may raise to the caller (its blocks take bytes): a
    fault in the bookkeeping that follows — injected here, the board's after-check binding
    raising as it does when the view closes under it — fails the request, reported once
    its transfer has ended. Before, read() raised with the READ in flight."""
    prefill, decode = _pair()
    try:
        _routed(decode, prefill)
        route = decode._routes[(remote(prefill), False)]
        board = route.legs[0].peer.board
        assert board is not None

        def closed(*args: Any) -> Any:
            raise ValueError("mmap closed or invalid")  # the injected fault

        monkeypatch.setattr(board, "after_check", closed)
        gen = prefill.hold("r", [8, 9])
        decode.read("r", remote(prefill), [1, 2], [8, 9], generation=gen)
        ok, reason = outcome(decode, "r")
        assert not ok and "mmap closed" in reason
    finally:
        decode.close()
        prefill.close()



def test_a_digest_lane_is_bound_to_the_board_and_posts_only_the_generation() -> None:
    """Integrity on, through a transport whose copy kernel digests (cuda_ipc): the peer's lane
    is bound once to the producer's hold board and our views, and every READ through it (the
    general path's first, the route's after) hands it the hold's generation and nothing read
    off the board. Where the kernel compared nothing, the host checks what landed: a byte
    flipped in the producer's block after its hold fails the receive, naming the block."""
    prefill, decode = _digest_pair("fusing_lane_tcp")
    try:
        t = decode.transports["fusing_lane_tcp"]
        gens = []
        for rid, ours, theirs in (("r0", [4, 5], [2, 3]), ("r1", [6], [7]), ("r2", [1, 2], [8, 0])):
            gens.append(prefill.hold(rid, theirs))
            decode.read(rid, remote(prefill), ours, theirs, generation=gens[-1])
            ok, reason = outcome(decode, rid)
            assert ok, reason
            assert np.array_equal(blocks(decode, ours), blocks(prefill, theirs))
        (lane,) = t.lanes
        assert lane.digests is not None and lane.generations == gens
        assert lane.samples == [False] * 3  # full: every block
        board = decode.peers.get(remote(prefill), 0).result().board
        assert board is not None and lane.digests.board == board.region
        assert decode.integrity.checked_blocks == 5 and decode.integrity.fused_blocks == 0
        gen = prefill.hold("bad", [9, 3])
        _buf, layers = prefill._keep  # type: ignore[attr-defined]
        np.asarray(layers[1])[1, 3, 0, 0, 1] ^= 1  # injected: after the digest was fixed
        decode.read("bad", remote(prefill), [7, 8], [9, 3], generation=gen)
        ok, reason = outcome(decode, "bad")
        assert not ok and "remote 3" in reason and "layer 1" in reason, reason
        assert lane.generations[-1] == gen
    finally:
        decode.close()
        prefill.close()
