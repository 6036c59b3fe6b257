"""GPU check: cuda_ipc copies run after the caller's current stream (two processes, one GPU).

    python scripts/gpu_stream_order_check.py [--out DIR] [--modes order no-order]

A prefill process holds its blocks for readers with block leases (as ``kvlink demo``'s serve
rank does) and answers handshakes; a decode process moves them through the public API
(``KVWorker`` with transports ``["cuda_ipc"]``). Every case first queues a long kernel
(``torch.cuda._sleep``) and then a write of the blocks involved on the caller's current stream,
then asks for the transfer; the copy must wait for both. After poll() says finished, the
elements that are not what the transfer must leave are counted (must be 0):

- ``read_default_stream``: the decode's default stream fills its destination blocks with a
  sentinel, then ``KVWorker.read``. Right: every destination element holds the prefill's value
  (the copy ran after the fill). Wrong: the sentinel (the copy ran first, the fill landed on it).
- ``read_side_stream``: the same with a user stream as the current stream.
- ``write_source``: the decode's current stream is still writing the source blocks when
  ``KVWorker.write`` posts; the prefill's blocks are read back (after a device sync) and must
  hold the new value.
- ``completion_event``: a READ posted on the transport, then a consumer stream waits on
  ``completion_event(handle)`` and counts wrong elements on the device, with no host sync in
  between (the event was still pending when the consumer queued its wait); a second consumer
  that does not wait shows what the count looks like without it.

Mode ``no-order`` runs the same cases with the transport option ``stream_order=False``: the
behaviour before the wait existed, to show the race (wrong counts > 0). ``post_us`` compares the
host time of a small post with and without the wait (caller's stream idle); ``timing_*`` the end
to end READ of 20480 x 8 KiB blocks with and without it, the caller's stream idle or with a
kernel pending. Results: bench/results/gpu_stream_order.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_common

LAYERS, HEADS, DIM, BS = 8, 8, 128, 16
N = 256  # blocks a transfer moves: 8 layers x K/V x 256 x 16 x 8 x 128 = 67,108,864 bf16
PREFILL_BLOCKS = 2 * N  # [0, N) are read, [N, 2N) are written
DECODE_BLOCKS = 2 * N  # the cases use [0, N); the timing uses all 256 MiB
SENTINEL = -1  # as int16: the prefill's values are never negative
MODES = ("order", "no-order")


def _cache(nblocks: int) -> Any:
    """One bf16 tensor (layers, K/V, blocks, tokens, heads, dim) and its per-layer views."""
    import torch

    t = torch.zeros((LAYERS, 2, nblocks, BS, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
    return t, [t[i] for i in range(LAYERS)]


def _pattern(numel: int) -> Any:
    """The prefill's contents as int16, from the element index alone (nonnegative)."""
    import torch

    i = torch.arange(numel, dtype=torch.int64, device="cuda")
    return ((i * 2654435761) >> 7).bitwise_and(0x7FFF).to(torch.int16)


def _spec(layers: list[Any]) -> Any:
    from kvlink.layout import KVCacheSpec

    return KVCacheSpec.from_tensors(layers, total_kv_heads=HEADS, dtype="bfloat16")


def _requests(modes: list[str]) -> dict[str, list[int]]:
    reads = list(range(N))
    writes = list(range(N, 2 * N))
    out = {}
    for m in modes:
        out[f"{m}-warmup"] = reads
        out[f"{m}-read_default_stream"] = reads
        out[f"{m}-read_side_stream"] = reads
        out[f"{m}-write_check"] = writes
    return out


def _hold(worker: Any, reqs: dict[str, list[int]]) -> Any:
    """Hold the requests' blocks for readers; returns the step that serves their leases."""
    for req_id, ids in reqs.items():
        worker.hold(req_id, np.asarray(ids, dtype=np.int64))
    return lambda: worker.released()


def prefill(q: Any, stop: Any, modes: list[str], transport: str = "cuda_ipc",
            options: dict[str, Any] | None = None) -> None:
    """The prefill process: fills its cache with the pattern, holds every case's blocks."""
    import torch

    from kvlink.worker import KVWorker, WorkerConfig

    torch.cuda.set_device(0)
    cache, layers = _cache(PREFILL_BLOCKS)
    cache.view(torch.int16).view(-1).copy_(_pattern(cache.numel()))
    torch.cuda.synchronize()  # the blocks are offered only once their contents are final
    # grants=False: the write_source case WRITEs into this worker with a raw write(), which a
    # least-privilege owner refuses (no push reserved those blocks); this checks stream order
    worker = KVWorker(WorkerConfig(engine_id="prefill", transports=[transport], grants=False,
                                   transport_options={transport: dict(options or {})}))
    worker.register(_spec(layers))
    step = _hold(worker, _requests(modes))
    q.put((worker.side_port, cache.data_ptr()))
    try:
        while not stop.is_set():
            step()
            time.sleep(0.002)
    finally:
        worker.close()


def sleep_seconds(torch: Any, cycles: int) -> float:
    """How long the queued ``torch.cuda._sleep(cycles)`` kernel runs, on the device's clock."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    e1.synchronize()
    return float(e0.elapsed_time(e1)) / 1e3


def post_host_us(torch: Any, t: Any, peer: str, lx: Any, rx: Any, reps: int,
                 timeout: float) -> dict[str, float]:
    """Host time (median, us) of transport ``t``'s READ post of ``lx <- rx`` with and without
    its stream order (option ``stream_order``), the caller's stream idle or a tiny kernel
    pending; each post is waited for before the next."""
    from kvlink.transport import Op

    tiny = torch.zeros(1, device="cuda")
    variants = (("no_order_idle", False, False), ("order_idle", True, False),
                ("no_order_pending", False, True), ("order_pending", True, True))
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    keep = t.stream_order
    for _ in range(reps):
        for name, flag, pending in variants:
            t.stream_order = flag
            torch.cuda.synchronize()
            if pending:
                tiny.add_(1)
            a = time.perf_counter()
            h = t.post(Op.READ, peer, lx, rx)
            times[name].append(time.perf_counter() - a)
            t.wait(h, timeout)
            t.release(h)
    t.stream_order = keep
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


class Decode:
    """One decode worker (one mode) against the prefill."""

    def __init__(self, mode: str, port: int, remote_base: int, cycles: int, timeout: float,
                 transport: str = "cuda_ipc") -> None:
        import torch

        from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

        self.torch, self.mode, self.cycles, self.timeout = torch, mode, cycles, timeout
        self.cache, layers = _cache(DECODE_BLOCKS)
        self.i16 = self.cache.view(torch.int16)
        opts = {transport: {"stream_order": mode == "order", **_EXTRA.get(transport, {})}}
        self.worker = KVWorker(WorkerConfig(engine_id=f"decode-{mode}", transports=[transport],
                                            transport_options=opts, serve=False))
        self.worker.register(_spec(layers))
        self.remote = RemoteEngine("prefill", "127.0.0.1", port)
        self.remote_base = remote_base
        rng = np.random.default_rng(7)
        self.lids = rng.permutation(N).astype(np.int64)
        self.rids = rng.permutation(N).astype(np.int64)
        pat = _pattern(LAYERS * 2 * PREFILL_BLOCKS * BS * HEADS * DIM)
        self.prefill_i16 = pat.view(LAYERS, 2, PREFILL_BLOCKS, BS, HEADS, DIM)
        dev = self.cache.device
        self.lidx = torch.from_numpy(self.lids).to(dev)
        self.ridx = torch.from_numpy(self.rids).to(dev)
        self.expected = self.prefill_i16[:, :, self.ridx]  # what the READs must leave
        torch.cuda.synchronize()
        # handshake, mappings and first launch before any timed case
        self.worker.read(f"{mode}-warmup", self.remote, self.lids, self.rids)
        self.warmup = self.wait(f"{mode}-warmup")
        torch.cuda.synchronize()
        if not self.warmup["finished"]:
            raise RuntimeError(f"warm-up READ failed: {self.warmup}")

    def busy_then(self, fill: int) -> None:
        """On the current stream: a long kernel, then a write of the whole cache."""
        self.torch.cuda._sleep(self.cycles)
        self.i16.fill_(fill)

    def wait(self, req_id: str) -> dict[str, Any]:
        """Poll the worker until ``req_id`` is reported; how long, and the longest poll()."""
        t0, longest = time.perf_counter(), 0.0
        while True:
            a = time.perf_counter()
            done, failed = self.worker.poll()
            longest = max(longest, time.perf_counter() - a)
            if req_id in done or req_id in failed:
                return {"finished": req_id in done, "error": failed.get(req_id),
                        "seconds": time.perf_counter() - t0, "longest_poll_s": longest}
            if time.perf_counter() - t0 > self.timeout:
                return {"finished": False, "error": "timeout", "seconds": self.timeout,
                        "longest_poll_s": longest}
            time.sleep(0.0002)

    def wrong_read(self) -> int:
        """Destination elements that do not hold the prefill's (on the current stream)."""
        got = self.i16[:, :, self.lidx]
        return int((got != self.expected).sum().item())

    def read(self, case: str, stream: Any = None) -> dict[str, Any]:
        torch = self.torch
        req = f"{self.mode}-{case}"
        torch.cuda.synchronize()
        self.i16.zero_()
        torch.cuda.synchronize()
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            self.busy_then(SENTINEL)
            self.worker.read(req, self.remote, self.lids, self.rids)
            row = self.wait(req)
            row["wrong"] = self.wrong_read()  # after finished, in the caller's stream order
        row["elements"] = int(self.expected.numel())
        torch.cuda.synchronize()
        row["wrong_after_device_sync"] = self.wrong_read()
        return row

    def write(self) -> dict[str, Any]:
        """The current stream writes the source while WRITE posts; read back and count."""
        torch = self.torch
        value = 0x1234
        targets = self.rids + N
        torch.cuda.synchronize()
        self.i16.zero_()
        torch.cuda.synchronize()
        req = f"{self.mode}-write_source"
        self.busy_then(value)
        self.worker.write(req, self.remote, self.lids, targets)
        row = self.wait(req)
        torch.cuda.synchronize()  # now read the prefill's blocks back, fully ordered
        self.i16.zero_()
        torch.cuda.synchronize()
        check = f"{self.mode}-write_check"
        self.worker.read(check, self.remote, self.lids, targets)
        back = self.wait(check)
        torch.cuda.synchronize()
        got = self.i16[:, :, self.lidx]
        row["wrong"] = int((got != value).sum().item())
        row["elements"] = int(got.numel())
        row["read_back"] = back
        return row

    def _extents(self, t: Any) -> tuple[Any, Any]:
        """The READ's pages as transport extents, in the transport's own (pinned) arrays."""
        page = BS * HEADS * DIM * 2
        planes = np.arange(LAYERS * 2, dtype=np.uint64)[:, None]
        lo = (planes * np.uint64(DECODE_BLOCKS) + self.lids.astype(np.uint64)[None, :]) \
            * np.uint64(page)
        ro = (planes * np.uint64(PREFILL_BLOCKS) + self.rids.astype(np.uint64)[None, :]) \
            * np.uint64(page)
        n = lo.size
        lx, rx = t.extents(n), t.extents(n)
        lx["addr"], lx["len"] = np.uint64(self.cache.data_ptr()) + lo.reshape(-1), page
        rx["addr"], rx["len"] = np.uint64(self.remote_base) + ro.reshape(-1), page
        return lx, rx

    def completion_event(self) -> dict[str, Any]:
        """A consumer stream waits on the copy's completion event: no host sync before it."""
        from kvlink.transport import Op, XferStatus

        torch = self.torch
        t = self.worker.transports["cuda_ipc"]
        peer = self.worker.connected_peers()[0]
        lx, rx = self._extents(t)
        torch.cuda.synchronize()
        self.i16.zero_()
        torch.cuda.synchronize()
        self.busy_then(SENTINEL)
        t0 = time.perf_counter()
        h = t.post(Op.READ, peer, lx, rx)
        post_s = time.perf_counter() - t0
        ev = t.completion_event(h)
        pending_at_wait = not ev.query()
        waiter, control = torch.cuda.Stream(), torch.cuda.Stream()
        waiter.wait_event(ev)  # the consumer's stream waits on the device
        with torch.cuda.stream(waiter):
            wrong = (self.i16[:, :, self.lidx] != self.expected).sum()
        with torch.cuda.stream(control):  # no wait: runs while the copy is still waiting
            wrong_nowait = (self.i16[:, :, self.lidx] != self.expected).sum()
        queued_s = time.perf_counter() - t0
        deadline = time.perf_counter() + self.timeout
        while (st := t.poll(h)).status is XferStatus.PENDING and time.perf_counter() < deadline:
            time.sleep(0.0002)
        t.release(h)
        torch.cuda.synchronize()
        return {"status": st.status.value, "reason": st.reason, "post_s": post_s,
                "consumer_queued_s": queued_s, "event_pending_when_consumer_waited":
                pending_at_wait, "wrong": int(wrong.item()),
                "wrong_consumer_without_wait": int(wrong_nowait.item()),
                "elements": int(self.expected.numel())}

    def post_us(self, reps: int = 200) -> dict[str, float]:
        """Host time (median, us) of a one-page READ post with and without the stream wait,
        the caller's stream idle (the wait is skipped after a stream query) or with a tiny
        kernel pending (event record + stream wait)."""

        t = self.worker.transports["cuda_ipc"]
        lx, rx = self._extents(t)
        return post_host_us(self.torch, t, self.worker.connected_peers()[0], lx[:1], rx[:1],
                            reps, self.timeout)

    def timing(self, reps: int) -> dict[str, Any]:
        """End to end (post -> DONE polled, after a device sync, as gpu_cuda_ipc_check.py times
        it) of a Llama-70B-shaped READ, 20480 x 8 KiB at random places, with and without the
        stream wait, interleaved; the caller's stream idle (the wait is skipped: nothing is
        pending) or with one tiny kernel pending (the wait is enqueued). Ratios to a device
        copy of the same bytes in the same run."""
        from kvlink.transport import Op, XferStatus

        torch = self.torch
        t = self.worker.transports["cuda_ipc"]
        peer = self.worker.connected_peers()[0]
        ext, count = 8 << 10, 20480
        rng = np.random.default_rng(11)
        lslot = rng.choice(self.cache.numel() * 2 // ext, count, replace=False)
        rslot = rng.choice(self.prefill_i16.numel() * 2 // ext, count, replace=False)
        lx, rx = t.extents(count), t.extents(count)
        lx["addr"] = np.uint64(self.cache.data_ptr()) + lslot.astype(np.uint64) * np.uint64(ext)
        rx["addr"] = np.uint64(self.remote_base) + rslot.astype(np.uint64) * np.uint64(ext)
        lx["len"], rx["len"] = ext, ext
        src = torch.empty(count * ext // 8, dtype=torch.int64, device="cuda").random_()
        dst = torch.empty_like(src)
        tiny = torch.zeros(1, device="cuda")
        variants = (("no_order_idle", False, False), ("order_idle", True, False),
                    ("no_order_pending", False, True), ("order_pending", True, True))
        times: dict[str, list[float]] = {v[0]: [] for v in (*variants, ("device_copy",))}
        keep = t.stream_order
        for rep in range(reps + 1):
            torch.cuda.synchronize()
            a = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            if rep:
                times["device_copy"].append(time.perf_counter() - a)
            for name, flag, pending in variants:
                t.stream_order = flag
                torch.cuda.synchronize()
                if pending:
                    tiny.add_(1)  # a kernel still pending on the caller's stream at post
                a = time.perf_counter()
                h = t.post(Op.READ, peer, lx, rx)
                while (st := t.poll(h)).status is XferStatus.PENDING:
                    pass
                b = time.perf_counter()
                t.release(h)
                if st.status is not XferStatus.DONE:
                    raise RuntimeError(f"timing READ {name}: {st.reason}")
                if rep:
                    times[name].append(b - a)
        t.stream_order = keep
        base = statistics.median(times["device_copy"])
        out: dict[str, Any] = {"bytes": count * ext, "extents": count, "reps": reps,
                               "device_copy_s": base}
        for name, ts in times.items():
            if name != "device_copy":
                out[f"{name}_s"] = statistics.median(ts)
                out[f"{name}_ratio_to_device_copy"] = base / statistics.median(ts)
        return out

    def close(self) -> None:
        self.worker.close()


#: per transport, options both processes take besides stream_order (nixl: no ucx_info probe
#: on a background thread in the timed window)
_EXTRA: dict[str, dict[str, Any]] = {"nixl": {"ucx_probe": False}}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--sleep-cycles", type=int, default=1_000_000_000,
                    help="torch.cuda._sleep length queued before each case's write (~0.5 s)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--transport", choices=("cuda_ipc", "nixl"), default="cuda_ipc",
                    help="nixl: the public-API cases (READ destination, WRITE source) over "
                         "NIXL; its copies run on UCX's streams, ordered by the transport's "
                         "deferred post (results: gpu_stream_order_nixl.json)")
    ap.add_argument("--timing-reps", type=int, default=15,
                    help="end-to-end READ timings with and without the wait (0: none)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    tr = args.transport
    p = ctx.Process(target=prefill, args=(q, stop, args.modes, tr, _EXTRA.get(tr)))
    p.start()
    results: dict[str, Any] = {"elements_per_transfer": LAYERS * 2 * N * BS * HEADS * DIM,
                               "sleep_cycles": args.sleep_cycles, "modes": {}}
    try:
        port, remote_base = q.get(timeout=300)
        torch.cuda.set_device(0)
        results["sleep_s"] = sleep_seconds(torch, args.sleep_cycles)
        for mode in args.modes:
            d = Decode(mode, port, remote_base, args.sleep_cycles, args.timeout, tr)
            row: dict[str, Any] = {"transport": tr, "stream_order": mode == "order",
                                   "warmup": d.warmup}
            if tr == "cuda_ipc":
                copier = d.worker.transports["cuda_ipc"]._copier
                row["kernel"] = copier.kernel
                # whole blocks go through a lane: its launcher orders the copy itself
                from kvlink import native

                row["lane_launcher"] = ("native" if getattr(copier._cuda, "launcher", None)
                                        is not None else f"ctypes ({native.why_not()})")
            try:
                row["read_default_stream"] = d.read("read_default_stream")
                row["read_side_stream"] = d.read("read_side_stream", torch.cuda.Stream())
                if tr == "cuda_ipc":  # its hook (and the timings below) are cuda_ipc's own
                    row["completion_event"] = d.completion_event()
                row["write_source"] = d.write()
                if mode == "order" and tr == "cuda_ipc":
                    row["post_us"] = d.post_us()
                    if args.timing_reps:
                        row["timing_b_llama70b_4096tok_8KiB"] = d.timing(args.timing_reps)
            finally:
                d.close()
            results["modes"][mode] = row
            for case in ("read_default_stream", "read_side_stream", "completion_event",
                         "write_source"):
                if case not in row:
                    continue
                r = row[case]
                print(f"{mode:9s} {case:20s} wrong {r['wrong']:>11,} of {r['elements']:,}",
                      {k: v for k, v in r.items() if k not in ("wrong", "elements")},
                      flush=True)
            for key in ("post_us", "timing_b_llama70b_4096tok_8KiB"):
                if key in row:
                    print(f"{mode:9s} {key}", row[key], flush=True)
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()
    order = results["modes"].get("order")
    if order is not None:
        results["ordered_all_zero"] = all(
            order[c]["wrong"] == 0 for c in ("read_default_stream", "read_side_stream",
                                              "completion_event", "write_source") if c in order)
    name = "gpu_stream_order.json" if tr == "cuda_ipc" else f"gpu_stream_order_{tr}.json"
    _gpu_common.write(args.out, name, results)
    if order is not None and not results["ordered_all_zero"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
