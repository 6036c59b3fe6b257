"""kvlink's NIXL READ path vs NixlConnector's, outside vLLM, on the same agent pair.

Run:  .venv/bin/python bench/nixl_post_paths.py [--reads 60] [--out FILE]

A target process registers a KV-cache-like region and serves it; this process READs requests
into its own (touched) region, in two shapes (``CASES``):

* ``16``: 4 layer planes x 256 blocks x 32 KiB (the vllm_pd tiny model's LBHNC pages), requests
  of 16 blocks per plane (64 block descriptors), consecutive runs;
* ``20480``: the 70B TP8-rank shape, 160 planes (80 layers x K, V) x 256 blocks x 4 KiB,
  requests of 128 scattered blocks per plane (20480 block descriptors);

per request, in a fresh random order,

* ``kvlink``: ``NixlTransport.post_runs`` of the request in the RUNS form the worker hands it
  (the planes' bases and one run per block; descriptor lists prepped once at connect, the
  request's indices two broadcast adds, ``make_prepped_xfer``) — with ``--extents``, ``post``
  of its extents instead (blocks adjacent on both sides coalesced, as the planner does for a
  transport without ``post_runs``) — and ``poll`` in a loop until DONE, without a NIXL
  notification (kvlink's worker sends a READ's "done" over its side channel);
* ``baseline``: NixlConnector's way, one descriptor per (plane, block) prepped ONCE for the
  whole region on both sides, then ``make_prepped_xfer`` with index lists (built per request
  from the block ids, as NixlConnector does) + ``transfer`` and ``check_xfer_state`` until DONE,
  notification attached;

each on its own NIXL agent in this process (so the same UCX configuration). Reported per path
and case, every clock starting at the transport-level call (``post`` / ``make_prepped_xfer``):
wall time to DONE; host time before NIXL's transfer starts (kvlink: ``xfer_timing``'s
``pre_transfer_s``, from the post call to ``transfer()``, bounds checks and index computation
included; baseline: ``make_prepped_xfer``) and the whole post call (baseline: +
``transfer()``; over cma the copy runs inside ``transfer()``); NIXL's telemetry
``xferDuration`` / ``postDuration``; ratios kvlink / baseline. What each side does before that
call is timed on its own (``plan_s``: kvlink making its RUNS form, or with ``--extents``
coalescing the request's extents and making the extent arrays, as its planner does; the
baseline building its block id lists) and ``total_s`` is the two together: from the request's
block ids to DONE (kvlink's index arithmetic is inside ``post_runs``, NixlConnector's before its
call). Bytes are verified for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _common import change_interval, write_result  # noqa: E402

#: case -> (planes, blocks per plane, block bytes, blocks per request per plane, scattered)
CASES = {"16": (4, 256, 32768, 16, False), "20480": (160, 256, 4096, 128, True)}


def coalesce(lo: np.ndarray, ro: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Merge extents adjacent on both sides (what kvlink's planner hands a transport)."""
    brk = np.ones(lo.shape[0], dtype=bool)
    brk[1:] = (lo[1:] != lo[:-1] + size) | (ro[1:] != ro[:-1] + size)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, lo.shape[0])).astype(np.uint64) * np.uint64(size)
    return lo[starts], ro[starts], lens


def run_case(name: str, reads: int, OPTS: dict[str, Any], Peer: Any, use_runs: bool = True
             ) -> dict[str, Any]:
    from kvlink.transport import Op, Region, Runs, TransportContext, XferStatus, make_extents
    from kvlink_transports.nixl import NixlTransport

    planes, blocks, page, per, scattered = CASES[name]
    nbytes = planes * blocks * page
    peer = Peer(f"peer-{uuid.uuid4().hex[:6]}", nbytes, seed=3)
    t = NixlTransport(TransportContext(agent_name=f"bench-{uuid.uuid4().hex[:6]}"),
                      {**OPTS, "telemetry": True})
    tb = NixlTransport(TransportContext(agent_name=f"base-{uuid.uuid4().hex[:6]}"),
                       {**OPTS, "telemetry": True})
    buf = np.ones(nbytes, dtype=np.uint8)
    res: dict[str, list[float]] = {}
    paths: set[str] = set()

    def add(key: str, v: float) -> None:
        res.setdefault(key, []).append(v)

    plane_off = (np.arange(planes, dtype=np.uint64) * np.uint64(blocks * page))[:, None]

    def offsets(bl: np.ndarray) -> np.ndarray:  # plane-major, the request's block order
        return (plane_off + bl.astype(np.uint64)[None, :] * np.uint64(page)).ravel()

    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(peer.name, peer.descriptor)
        tb.register([Region(buf.ctypes.data, buf.nbytes)])
        tb.connect(peer.name, peer.descriptor)
        # NIXL agents are not safe to drive from two threads: take the lock the transport's
        # own progress thread takes (without it, READs here hung for good now and then)
        agent: Any = tb._agent
        lock = tb._lock
        every = offsets(np.arange(blocks))
        dl = np.empty((every.shape[0], 3), dtype=np.uint64)
        dl[:, 1], dl[:, 2] = page, 0
        dl[:, 0] = buf.ctypes.data + every
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", dl.copy(), "DRAM")
        dl[:, 0] = peer.addr + every
        rh = agent.prep_xfer_dlist(peer.name, dl, "DRAM")
        ref = peer.reference()
        rng = np.random.default_rng(0)
        plane_idx = (np.arange(planes, dtype=np.int64) * blocks)[:, None]
        lbases = np.uint64(buf.ctypes.data) + plane_off.ravel()
        rbases = np.uint64(peer.addr) + plane_off.ravel()
        pg = np.uint64(page)

        def kvlink_one(lb: np.ndarray, rb: np.ndarray, lo: np.ndarray, ro: np.ndarray,
                       want: np.ndarray) -> None:
            # kvlink (its planner's part, coalescing, timed on its own: the clock starts at
            # the transport call, as the baseline's starts at make_prepped_xfer)
            tp = time.perf_counter()
            if use_runs:  # the worker's RUNS form: plane bases + one run per block
                runs = Runs(lbases, rbases, lb.astype(np.uint64) * pg, rb.astype(np.uint64) * pg,
                            np.full(lb.shape[0], page, dtype=np.uint64), lo.shape[0],
                            lb.shape[0] * page, page)
                extents = runs.descriptors
            else:
                cl, cr, cn = coalesce(lo, ro, page)
                le = make_extents(buf.ctypes.data + cl, cn)
                re_ = make_extents(peer.addr + cr, cn)
                extents = cl.shape[0]
            t0 = time.perf_counter()
            if use_runs:
                h = t.post_runs(Op.READ, peer.name, runs)
            else:
                h = t.post(Op.READ, peer.name, le, re_)
            t1 = time.perf_counter()
            deadline = time.monotonic() + 30
            while (st := t.poll(h)).status is XferStatus.PENDING:  # in a loop, as the baseline
                if time.monotonic() > deadline:
                    raise TimeoutError("kvlink READ not DONE within 30 s")
            t2 = time.perf_counter()
            if st.status is not XferStatus.DONE:
                raise RuntimeError(f"kvlink READ failed: {st.reason}")
            tel = t.xfer_telemetry(h)
            tim = t.xfer_timing(h)
            paths.add(str(tim["path"]))
            t.release(h)
            add("kvlink_wall_s", t2 - t0)
            # from the post call to NIXL's transfer() starting
            add("kvlink_host_before_transfer_s", float(tim["pre_transfer_s"]))
            add("kvlink_plan_s", t0 - tp)
            add("kvlink_post_call_s", t1 - t0)
            add("kvlink_nixl_xfer_s", sum(e["xfer_us"] for e in tel) / 1e6)
            add("kvlink_nixl_post_s", sum(e["post_us"] for e in tel) / 1e6)
            add("kvlink_extents", float(extents))
            got = buf.reshape(-1, page)[(lo // page).astype(np.int64)]
            assert np.array_equal(got, want), "kvlink READ: bytes differ"
            buf[:] = 1

        def baseline_one(lb: np.ndarray, rb: np.ndarray, lo: np.ndarray,
                         want: np.ndarray) -> None:
            # NixlConnector's way (its block id lists timed on their own, like kvlink's plan)
            tp = time.perf_counter()
            il = (plane_idx + lb[None, :]).ravel().astype(np.int32)
            ir = (plane_idx + rb[None, :]).ravel().astype(np.int32)
            t0 = time.perf_counter()
            with lock:
                req = agent.make_prepped_xfer("READ", lh, il, rh, ir, notif_msg=b"b")
                ta = time.perf_counter()
                agent.transfer(req)
            t1 = time.perf_counter()
            deadline = time.monotonic() + 30
            while True:
                with lock:
                    if agent.check_xfer_state(req) != "PROC":
                        break
                if time.monotonic() > deadline:
                    done = len(res.get("baseline_wall_s", []))
                    raise TimeoutError(f"baseline READ {done} not DONE within 30 s")
            t2 = time.perf_counter()
            with lock:
                tl = agent.get_xfer_telemetry(req)
                agent.release_xfer_handle(req)
            add("baseline_wall_s", t2 - t0)
            add("baseline_host_before_transfer_s", ta - t0)
            add("baseline_plan_s", t0 - tp)
            add("baseline_post_call_s", t1 - t0)
            add("baseline_nixl_xfer_s", tl.xferDuration / 1e6)
            add("baseline_nixl_post_s", tl.postDuration / 1e6)
            got = buf.reshape(-1, page)[(lo // page).astype(np.int64)]
            assert np.array_equal(got, want), "baseline READ: bytes differ"
            buf[:] = 1

        order = np.random.default_rng(1)
        for _ in range(reads):
            if scattered:
                lb = np.sort(rng.choice(blocks, per, replace=False))
                rb = rng.choice(blocks, per, replace=False)
            else:
                start = int(rng.integers(0, blocks - per))
                lb = np.arange(start, start + per)
                rb = np.arange(blocks - start - per, blocks - start)
            lo, ro = offsets(lb), offsets(rb)
            want = ref.reshape(-1, page)[(ro // page).astype(np.int64)]
            # the two paths in a fresh random order every request (a fixed order biases)
            for k in order.permutation(2).tolist():
                if k == 0:
                    kvlink_one(lb, rb, lo, ro, want)
                else:
                    baseline_one(lb, rb, lo, want)
        lh.release()
        rh.release()
    finally:
        peer.stop()
        t.close()
        tb.close()

    for path in ("kvlink", "baseline"):  # NIXL saw the request complete inside the post call
        inline = [x == p for x, p in zip(res[f"{path}_nixl_xfer_s"], res[f"{path}_nixl_post_s"])]
        res[f"{path}_done_at_post"] = [float(sum(inline) / len(inline))]
        # from the request's block ids in hand: what it does before its transport-level call
        # plus the wall — kvlink's index arithmetic is inside post_runs, the baseline's
        # (NixlConnector building its index lists) before make_prepped_xfer
        res[f"{path}_total_s"] = [p + w for p, w in zip(res[f"{path}_plan_s"],
                                                        res[f"{path}_wall_s"])]
    med = {k: statistics.median(v) for k, v in res.items()}
    ratios = {f"{k}_kvlink_over_baseline": med[f"kvlink_{k}_s"] / med[f"baseline_{k}_s"]
              for k in ("wall", "total", "host_before_transfer", "post_call", "nixl_xfer")}
    # the acceptance line: kvlink's host time before NIXL's transfer starts against
    # NixlConnector's make_prepped_xfer + transfer() call
    ratios["host_before_transfer_kvlink_over_baseline_post_call"] = (
        med["kvlink_host_before_transfer_s"] / med["baseline_post_call_s"])
    print(f"case {name}: {planes} planes x {blocks} blocks x {page} B, {per} blocks per plane "
          f"per request ({planes * per} block descriptors), kvlink path {sorted(paths)}")
    for k, v in sorted(med.items()):
        if k.endswith("done_at_post"):
            print(f"  {k:34s} {v:7.3f} (fraction)")
        elif k.endswith("extents"):
            print(f"  {k:34s} {v:7.0f}")
        else:
            print(f"  {k:34s} p50 {v * 1e3:7.3f} ms")
    lo90, hi90 = change_interval(res["baseline_wall_s"], res["kvlink_wall_s"])
    interval = [1 + lo90, 1 + hi90]  # of wall_kvlink_over_baseline, 90 % bootstrap
    tlo, thi = change_interval(res["baseline_total_s"], res["kvlink_total_s"])
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f" (wall ratio 90 % interval [{interval[0]:.3f}, {interval[1]:.3f}], total"
          f" [{1 + tlo:.3f}, {1 + thi:.3f}])")
    return {
        "layout": {"planes": planes, "blocks": blocks, "page_bytes": page,
                   "blocks_per_plane_per_read": per, "scattered": scattered,
                   "block_descriptors_per_read": planes * per},
        "kvlink_path": sorted(paths), "p50_s": med, "ratios": ratios,
            "wall_kvlink_over_baseline_90pct": interval,
            "total_kvlink_over_baseline_90pct": [1 + tlo, 1 + thi], "raw_s": res,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=60, help="READs per path and case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: 16,20480")
    ap.add_argument("--extents", action="store_true",
                    help="kvlink posts extents (post), not the RUNS form (post_runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from test_nixl_transport import OPTS, Peer  # the target process of the transport tests

    cases = {c: run_case(c, args.reads, OPTS, Peer, not args.extents)
             for c in args.cases.split(",")}
    write_result("nixl_post_paths", {"description": __doc__.split("\n\n")[0],
                                     "cases": cases}, args.out)


if __name__ == "__main__":
    main()
