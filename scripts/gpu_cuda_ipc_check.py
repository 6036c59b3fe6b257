"""GPU check of the cuda_ipc transport (and NIXL beside it): two processes sharing one GPU.

    python scripts/gpu_cuda_ipc_check.py [--out DIR]

(a) 1 GiB in 4 MiB extents, (b) a Llama-3-70B-shaped 4096-token request: 20480 blocks of 8 KiB at
non-contiguous ids. Extents are posted from the transport's own arrays (``Transport.extents``,
where the worker's planner builds them; cuda_ipc: pinned memory), cuda_ipc also from ordinary
arrays (keys ``cuda_ipc_pageable_*``). READ and WRITE, every byte verified against the seeded
source regenerated independently, timed end to end (post -> completion polled), as a ratio of
a device copy of the same bytes measured in the same run. NIXL READ/WRITE on the same extents
when nixl imports.
"""

from __future__ import annotations

import argparse
import itertools
import json
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

GIB = 1 << 30
CASES = {
    "a_1GiB_4MiB": dict(cache=GIB, ext=4 << 20, count=256),
    "b_llama70b_4096tok_8KiB": dict(cache=640 << 20, ext=8 << 10, count=20480),
    "c_1GiB_64MiB": dict(cache=2 * GIB, ext=64 << 20, count=16),
}


def _source(nbytes: int, seed: int) -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda",
                         generator=g)


def _ctx(name: str) -> Any:
    from kvlink.hostid import host_id
    from kvlink.transport import TransportContext

    return TransportContext(agent_name=name, host_id=host_id())


def producer(q: Any, done: Any, transports: list[str]) -> None:
    import torch

    from kvlink.transport import Region, create_transport

    torch.cuda.set_device(0)
    bufs = {name: _source(c["cache"], seed=i + 1) for i, (name, c) in enumerate(CASES.items())}
    out = {}
    ts = []
    for tname in transports:
        try:
            t = create_transport(tname, _ctx(f"producer-{tname}"))
            t.register([Region(b.data_ptr(), b.numel() * 4, "cuda:0") for b in bufs.values()])
            out[tname] = t.descriptor()
            ts.append(t)
        except Exception as exc:
            out[tname] = f"unavailable: {type(exc).__name__}: {exc}".encode()
    q.put(({n: b.data_ptr() for n, b in bufs.items()}, out))
    done.wait(600)
    for t in ts:
        t.close()


def main() -> None:
    import torch

    from kvlink.transport import Op, Region, XferStatus, create_transport, make_extents

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nixl", action="store_true", help="also run NIXL on the same extents")
    ap.add_argument("--op-timeout", type=float, default=30.0)
    ap.add_argument("--profile", action="store_true", help="cProfile the posts of each case")
    ap.add_argument("--spans", action="store_true",
                    help="also time each cuda_ipc post on the GPU's clock (its event records "
                         "add host time to the end-to-end figure)")
    ap.add_argument("--cases", nargs="*", default=None, help="run only these cases")
    ap.add_argument("--wait", choices=["spin", "sync"], default="sync",
                    help="how the host waits for the GPU before each timed post and around "
                         "each device copy: spin on an event (a busy serving loop's hot thread) "
                         "or torch.cuda.synchronize() (the thread may sleep and wake cold)")
    args = ap.parse_args()

    def settle() -> None:
        """Wait until the device is idle, the way --wait says."""
        if args.wait == "sync":
            torch.cuda.synchronize()
            return
        ev = torch.cuda.Event()  # the work before was on this stream; side streams are idle
        ev.record()
        while not ev.query():
            pass
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    transports = ["cuda_ipc", "nixl"] if args.nixl else ["cuda_ipc"]
    p = ctx.Process(target=producer, args=(q, done, transports))
    p.start()
    remote_ptrs, descs = q.get(timeout=300)
    print("producer ready", {k: v[:40] for k, v in descs.items()}, flush=True)
    torch.cuda.set_device(0)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "cases": {}}
    local = {n: torch.zeros(c["cache"] // 4, dtype=torch.int32, device="cuda")
             for n, c in CASES.items()}
    conns = {}
    for tname in transports:
        if descs[tname].startswith(b"unavailable"):
            results[f"{tname}_unavailable"] = descs[tname].decode()
            continue
        try:
            t = create_transport(tname, _ctx(f"consumer-{tname}"))
            t.register([Region(b.data_ptr(), b.numel() * 4, "cuda:0") for b in local.values()])
            t.connect("producer", descs[tname])
            conns[tname] = t
            if tname == "cuda_ipc":
                results["cuda_ipc_kernel"] = t._copier.kernel  # "cuda" (NVRTC) or "triton"
            print(f"{tname}: connected", flush=True)
        except Exception as exc:
            results[f"{tname}_unavailable"] = f"{type(exc).__name__}: {exc}"
    rng = np.random.default_rng(0)
    for ci, (name, c) in enumerate(CASES.items()):
        if args.cases and name not in args.cases:
            continue
        ext, count = c["ext"], c["count"]
        nblk = c["cache"] // ext
        rblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
        lblk = rng.choice(nblk, size=count, replace=False).astype(np.uint64)
        nbytes = ext * count
        lbase, rbase = local[name].data_ptr(), remote_ptrs[name]
        lext = make_extents(lbase + lblk * np.uint64(ext), ext)
        rext = make_extents(rbase + rblk * np.uint64(ext), ext)
        src = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
        dst = torch.empty_like(src)
        copy_s = []
        for _ in range(args.reps + 1):
            settle()
            t0 = time.perf_counter()
            dst.copy_(src)
            settle()
            copy_s.append(time.perf_counter() - t0)
        base = statistics.median(copy_s[1:])
        row: dict[str, Any] = {"bytes": nbytes, "extents": count, "device_copy_s": base,
                               "device_copy_gbps": nbytes / base / 1e9}
        expected = _source(c["cache"], seed=ci + 1).view(torch.uint8).view(-1, ext)
        for tname, t in conns.items():
            # the worker plans into the transport's own extent arrays (cuda_ipc: pinned memory
            # its kernel reads in place); cuda_ipc also timed from ordinary arrays
            lx, rx = t.extents(count), t.extents(count)
            lx[:], rx[:] = lext, rext
            posts = [(tname, lx, rx)]
            if tname == "cuda_ipc":
                posts.append((f"{tname}_pageable", lext, rext))
            for op, (key, le, re_) in itertools.product((Op.READ, Op.WRITE), posts):
                times, ok = [], True
                for _ in range(args.reps + 1):
                    local[name].zero_()
                    settle()
                    span = None
                    if args.spans and tname == "cuda_ipc":  # post start -> copy done, GPU clock
                        span = (torch.cuda.Event(enable_timing=True),
                                torch.cuda.Event(enable_timing=True))
                        span[0].record(t._stream)
                    t0 = time.perf_counter()
                    if args.profile and tname == "cuda_ipc" and len(times) == 2:
                        import cProfile
                        import pstats

                        prof = cProfile.Profile()
                        h = prof.runcall(t.post, op, "producer", le, re_)
                        print(f"--- timed post profile {key} {name} {op.value}", flush=True)
                        pstats.Stats(prof).sort_stats("tottime").print_stats(6)
                    else:
                        h = t.post(op, "producer", le, re_)
                    row.setdefault(f"{key}_{op.value}_post_s", []).append(
                        time.perf_counter() - t0)
                    if span is not None:
                        span[1].record(t._stream)
                    deadline = t0 + args.op_timeout
                    while (st := t.poll(h)).status is XferStatus.PENDING:
                        if time.perf_counter() > deadline:
                            print(f"{key} {op.value} {name}: TIMEOUT", flush=True)
                            break
                    times.append(time.perf_counter() - t0)
                    if span is not None:
                        span[1].synchronize()
                        row.setdefault(f"{key}_{op.value}_gpu_span_s", []).append(
                            span[0].elapsed_time(span[1]) / 1e3)
                    t.release(h)
                    print(f"{key} {op.value} {name}: {st.status.value} "
                          f"{nbytes / times[-1] / 1e9:.1f} GB/s", flush=True)
                    if st.status is not XferStatus.DONE:
                        row[f"{key}_{op.value}_error"] = st.reason or "timeout"
                        ok = False
                        break
                if not ok:
                    continue
                if op is Op.READ:
                    got = local[name].view(torch.uint8).view(-1, ext)[torch.from_numpy(
                        lblk.astype(np.int64)).cuda()]
                    want = expected[torch.from_numpy(rblk.astype(np.int64)).cuda()]
                    verified = bool(torch.equal(got, want))
                else:  # WRITE of zeros: the producer's blocks must now read back as zero
                    verified = None  # checked below through a READ of the same blocks
                med = statistics.median(times[1:])
                row[f"{key}_{op.value}_s"] = med
                row[f"{key}_{op.value}_gbps"] = nbytes / med / 1e9
                row[f"{key}_{op.value}_ratio_to_device_copy"] = base / med
                if verified is not None:
                    row[f"{key}_{op.value}_verified"] = verified
            if f"{tname}_write_s" in row and f"{tname}_read_s" in row:
                # after WRITEs of our zeroed blocks, fill ours with a pattern, WRITE, READ back
                local[name].fill_(7)
                h = t.post(Op.WRITE, "producer", lext, rext)
                while t.poll(h).status is XferStatus.PENDING:
                    pass
                local[name].zero_()
                h = t.post(Op.READ, "producer", lext, rext)
                while t.poll(h).status is XferStatus.PENDING:
                    pass
                got = local[name].view(torch.uint8).view(-1, ext)[torch.from_numpy(
                    lblk.astype(np.int64)).cuda()]
                row[f"{tname}_write_verified"] = bool(torch.all(got.view(torch.int32) == 7))
                # put the producer's original bytes back for the next transport's READ check
                lidx = torch.from_numpy(lblk.astype(np.int64)).cuda()
                local[name].view(torch.uint8).view(-1, ext)[lidx] = expected[
                    torch.from_numpy(rblk.astype(np.int64)).cuda()]
                h = t.post(Op.WRITE, "producer", lext, rext)
                while t.poll(h).status is XferStatus.PENDING:
                    pass
        results["cases"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    done.set()
    p.join(60)
    for t in conns.values():
        t.close()


    results["wait"] = args.wait
    _gpu_common.write(args.out, "gpu_cuda_ipc.json", results)


if __name__ == "__main__":
    main()
