"""GPU check of kvlink's nixl transport: READ and WRITE VRAM -> VRAM between two processes.

    python scripts/gpu_nixl_check.py [--out DIR] [--memory vram|dram] [--timeout 220]

Two processes on one GPU (the target is this script with ``--role target``), each with one
``NixlTransport`` (kvlink's UCX settings applied: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y unless set).
Cases: ``4MiB`` (4 MiB descriptors at random distinct ids of a 1 GiB cache, through a transport
prepped at 4 MiB blocks: ``prep_block_bytes`` set to the descriptor size) and ``70b_tp8``
(the Llama-3-70B TP8-rank request: 80 layers x K,V x 256 blocks of 4 KiB = 160 MiB, planned
through kvlink's ``plan_transfer`` at random distinct block ids of 512-block caches). First
one READ and one WRITE from fresh bytes, every byte verified (sha256 of the moved blocks on
both sides); then ``--reps`` of each, timed end to end (post -> DONE, polled in a loop) in
a fresh random order every round (READ and WRITE see the same stretch of the machine), both
sides' blocks equal at the end. Medians as a ratio of baselines measured in the same run: one
contiguous device copy of as many bytes (CUDA events) and torch's gather of the same blocks;
``read_vs_write`` is READ's median time against WRITE's (negative: READ faster) with a 90 %
bootstrap interval. A measured NIXL probe (``_ucx.nixl_probe``) says which UCX lanes carried VRAM.
``--memory dram`` runs the same on host memory (no GPU needed; smaller caches), to check the
script itself. JSON to ``--out`` (default ``$OUT`` or bench/results), as gpu_nixl_check.json.
Every wait has a timeout; the whole run is bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

MIB = 1 << 20
#: name -> (cache bytes, descriptor bytes, descriptors) per memory kind; 70b_tp8 is planned
CASES = {
    "vram": {"4MiB": (1 << 30, 4 * MIB, 128)},
    "dram": {"4MiB": (256 * MIB, 4 * MIB, 32)},
}
LAYERS, CACHE_BLOCKS, REQ_BLOCKS, BLOCK_TOKENS, HEADS, DIM = 80, 512, 256, 16, 1, 128  # bf16


class Mem:
    """A seeded buffer on the GPU (torch) or in host memory (numpy)."""

    def __init__(self, kind: str, nbytes: int, seed: int) -> None:
        self.kind, self.nbytes, self.seed = kind, nbytes, seed
        if kind == "vram":
            import torch

            self.t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.addr = int(self.t.data_ptr())
        else:
            self.a = np.empty(nbytes, dtype=np.uint8)
            self.addr = int(self.a.ctypes.data)
        self.reset()

    def reset(self) -> None:
        """Refill with the seeded bytes, in place (the registered address stays)."""
        if self.kind == "vram":
            import torch

            g = torch.Generator(device="cuda").manual_seed(self.seed)
            self.t.random_(0, 256, generator=g)
            torch.cuda.synchronize()
        else:
            self.a[:] = np.random.default_rng(self.seed).integers(0, 256, self.nbytes,
                                                                  dtype=np.uint8)

    @property
    def device(self) -> str:
        return "cuda:0" if self.kind == "vram" else "cpu"

    def digest(self, offsets: np.ndarray, lens: np.ndarray) -> str:
        """sha256 of the bytes at (offset, len) pairs, in order."""
        h = hashlib.sha256()
        if self.kind == "vram":
            import torch

            torch.cuda.synchronize()
            host = self.t.cpu().numpy()
        else:
            host = self.a
        for o, n in zip(offsets.tolist(), lens.tolist(), strict=True):
            h.update(host[o:o + n].tobytes())
        return h.hexdigest()

    def contiguous_copy_seconds(self, dst: Mem, nbytes: int, reps: int) -> float:
        """Median time of one contiguous copy of ``nbytes`` (CUDA events; numpy in host
        memory): what the device does with these bytes at its best."""
        if self.kind != "vram":
            ts = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                dst.a[:nbytes] = self.a[:nbytes]
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts[1:])
        import torch

        src, out = self.t[:nbytes], dst.t[:nbytes]
        out.copy_(src)
        ev = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out.copy_(src)
            e1.record()
            ev.append((e0, e1))
        torch.cuda.synchronize()
        return statistics.median(e0.elapsed_time(e1) / 1e3 for e0, e1 in ev)

    def device_copy_seconds(self, dst: Mem, so: np.ndarray, do: np.ndarray, size: int,
                            reps: int) -> float:
        """Median time of copying blocks of ``size`` bytes at offsets so -> do on the device
        (torch's index_select + index_copy_, host-timed; numpy in host memory): the gather
        baseline (two passes over the bytes, so slower than one copy)."""
        if self.kind == "vram":
            import _gpu_common
            import torch

            w = size
            s = torch.from_numpy((so // size).astype(np.int64)).cuda()
            d = torch.from_numpy((do // size).astype(np.int64)).cuda()
            sv, dv = self.t.view(-1, w), dst.t.view(-1, w)

            def fn() -> None:
                dv.index_copy_(0, d, sv.index_select(0, s))

            return float(_gpu_common.host_seconds(fn, reps))
        ha: Any = self.a.reshape(-1, size)
        hb: Any = dst.a.reshape(-1, size)
        si, di = (so // size).astype(np.int64), (do // size).astype(np.int64)
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            hb[di] = ha[si]
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])


def _ctx(name: str) -> Any:
    from kvlink.transport import TransportContext

    return TransportContext(agent_name=name)


def _seed(case: str, role: str) -> int:
    return int(hashlib.sha256(f"{case}-{role}".encode()).hexdigest()[:8], 16)


def _blocks(offs: np.ndarray, lens: np.ndarray, size: int) -> np.ndarray:
    """Offsets of the ``size``-byte blocks making up extents (offs, lens), in order."""
    cnt = (lens // size).astype(np.int64)
    start = np.cumsum(cnt) - cnt
    out: np.ndarray = np.repeat(offs, cnt) + (
        np.arange(int(cnt.sum())) - np.repeat(start, cnt)) * size
    return out


def _sizes(kind: str) -> dict[str, int]:
    out = {c: v[0] for c, v in CASES[kind].items()}
    out["70b_tp8"] = LAYERS * 2 * CACHE_BLOCKS * BLOCK_TOKENS * HEADS * DIM * 2
    return out


# ------------------------------------------------------------------ target process


def target(kind: str) -> None:
    from kvlink.transport import Region
    from kvlink_transports.nixl import NixlTransport

    if kind == "vram":
        import torch

        torch.cuda.set_device(0)
    t = NixlTransport(_ctx(f"gpucheck-t-{uuid.uuid4().hex[:6]}"), {"ucx_probe": False})
    mems = {c: Mem(kind, n, _seed(c, "t")) for c, n in _sizes(kind).items()}
    t.register([Region(m.addr, m.nbytes, m.device) for m in mems.values()])
    print(json.dumps({"desc": t.descriptor().hex(),
                      "addr": {c: m.addr for c, m in mems.items()}}), flush=True)
    for line in sys.stdin:  # commands: one JSON per line
        cmd = json.loads(line)
        if cmd["op"] == "digest":
            m = mems[cmd["case"]]
            d = m.digest(np.array(cmd["off"], dtype=np.int64), np.array(cmd["len"], np.int64))
            print(json.dumps({"digest": d}), flush=True)
        elif cmd["op"] == "reset":  # back to the seeded bytes (after a WRITE)
            mems[cmd["case"]].reset()
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "stop":
            break
    t.close()


class Target:
    def __init__(self, kind: str, timeout: float) -> None:
        self.timeout = timeout
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target",
                                   "--memory", kind], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.hello = self._line()

    def _line(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        r, _, _ = select.select([self.p.stdout], [], [], self.timeout)
        if not r:
            raise TimeoutError(f"target did not answer within {self.timeout:g}s")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited (rc {self.p.poll()})")
        return dict(json.loads(line))

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._line()

    def stop(self) -> None:
        try:
            if self.p.poll() is None and self.p.stdin is not None:
                self.p.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.p.stdin.flush()
            self.p.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait(timeout=10)


# ------------------------------------------------------------------ initiator


def _plan_70b(kind: str, local: Mem, raddr: int, rng: np.random.Generator
              ) -> tuple[Any, Any, int, dict[str, Any]]:
    """The 70B TP8-rank request planned by kvlink: (local extents, remote extents, block
    bytes, info). Both caches have the same geometry, so the plan is made against our own
    spec for both sides and its remote side rebased onto the target's cache."""
    from kvlink.layout import KVCacheSpec
    from kvlink.plan import plan_transfer

    cache: Any
    if kind == "vram":
        import torch

        cache = local.t.view(torch.bfloat16).view(
            LAYERS, 2, CACHE_BLOCKS, BLOCK_TOKENS, HEADS, DIM)
    else:  # host memory: the same bytes as float16 pages
        cache = local.a.view(np.float16).reshape(
            LAYERS, 2, CACHE_BLOCKS, BLOCK_TOKENS, HEADS, DIM)
    spec = KVCacheSpec.from_tensors([cache[i] for i in range(LAYERS)])
    lids = np.sort(rng.choice(CACHE_BLOCKS, REQ_BLOCKS, replace=False))
    rids = rng.choice(CACHE_BLOCKS, REQ_BLOCKS, replace=False)
    plan = plan_transfer(spec, spec, lids, rids)
    rem = plan.remote.copy()
    rem["addr"] = rem["addr"] - np.uint64(local.addr) + np.uint64(raddr)
    block = BLOCK_TOKENS * HEADS * DIM * 2
    info = {"raw_descriptors": int(plan.raw_descriptors), "extents": int(plan.local.shape[0]),
            "nbytes": int(plan.nbytes), "block_bytes": block}
    return plan.local, rem, block, info


def _timed(t: Any, op: Any, le: Any, re_: Any, kind: str, timeout: float, paths: set[str],
           case: str) -> float:
    """One post -> DONE (polled) of ``op`` over the extents, in seconds; raises if it fails."""
    from kvlink.transport import XferStatus

    if kind == "vram":
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter()
    h = t.post(op, "target", le, re_)
    # polled in a loop, as a caller that waits for it does (Transport.wait backs off to 1 ms
    # sleeps: half a millisecond of its grain in a 1 ms transfer)
    st = t.poll(h)
    while st.status is XferStatus.PENDING and time.perf_counter() - t0 < timeout:
        st = t.poll(h)
    dt = time.perf_counter() - t0
    paths.add(f"{op.value}:{t.xfer_timing(h)['path']}")
    if st.status is XferStatus.PENDING:  # past the timeout: ended by wait's own deadline
        st = t.wait(h, 0.0)
    t.release(h)
    if st.status is not XferStatus.DONE:
        raise RuntimeError(f"{op.value} {case}: {st.reason or f'not DONE within {timeout:g}s'}")
    return dt


def initiator(args: argparse.Namespace) -> dict[str, Any]:
    from kvlink.transport import Op, Region, make_extents
    from kvlink_transports import _ucx
    from kvlink_transports.nixl import NixlTransport

    kind = args.memory
    res: dict[str, Any] = {"memory": kind, "cases": {}}
    if kind == "vram":
        import torch

        torch.cuda.set_device(0)
        res["gpu"] = torch.cuda.get_device_name(0)
    pr = _ucx.nixl_probe("VRAM" if kind == "vram" else "DRAM", 64 * MIB, 2,
                         timeout=min(60.0, args.timeout / 4))
    v = _ucx.classify_lanes(pr.lanes, vram=kind == "vram", same_host=True,
                            protocols=pr.protocols)
    res["nixl_probe"] = {**pr.as_dict(), "verdict": v.verdict, "why": v.reason}
    tgt = Target(kind, timeout=min(120.0, args.timeout / 2))
    # the initiator as a user gets it (ucx_probe on: a same-host GPU pair on a slow UCX path
    # would have its posts FAILED), its verdict awaited before the first post
    t = NixlTransport(_ctx(f"gpucheck-i-{uuid.uuid4().hex[:6]}"), {"telemetry": True})
    res["ucx_env_set_by_kvlink"] = t.ucx_env
    res["ucx_settings"] = _ucx.ucx_settings()
    extra: dict[str, Any] = {}
    try:
        mems = {c: Mem(kind, n, _seed(c, "i")) for c, n in _sizes(kind).items()}
        t.register([Region(m.addr, m.nbytes, m.device) for m in mems.values()])
        t.connect("target", bytes.fromhex(tgt.hello["desc"]))
        res["lane_check_done"] = t.wait_probes(min(150.0, args.timeout / 2))
        res["lane_check_blocked"] = t._peers["target"].blocked  # None: not judged slow
        # the 4 MiB case through a transport prepped at its descriptor size, as docs/nixl.md
        # tells users to set it (at the default 4 KiB each descriptor is 1024 prepped blocks
        # for NIXL to merge back on every post)
        for case, m in mems.items():
            if case != "70b_tp8":
                tt = NixlTransport(_ctx(f"gpucheck-i{case}-{uuid.uuid4().hex[:6]}"),
                                   {"telemetry": True, "ucx_probe": False,
                                    "prep_block_bytes": CASES[kind][case][1]})
                extra[case] = tt
                tt.register([Region(m.addr, m.nbytes, m.device)])
                tt.connect("target", bytes.fromhex(tgt.hello["desc"]))
        res["prep_block_bytes"] = {c: CASES[kind][c][1] if c in extra else 4096 for c in mems}
        rng = np.random.default_rng(0)
        for case, m in mems.items():
            tc = extra.get(case, t)
            raddr = int(tgt.hello["addr"][case])
            if case == "70b_tp8":
                le, re_, size, info = _plan_70b(kind, m, raddr, rng)
            else:
                cache, size, count = CASES[kind][case]
                lo = rng.choice(cache // size, count, replace=False).astype(np.uint64) * size
                ro = rng.choice(cache // size, count, replace=False).astype(np.uint64) * size
                le = make_extents(np.uint64(m.addr) + lo, size)
                re_ = make_extents(np.uint64(raddr) + ro, size)
                info = {"extents": count, "nbytes": count * size}
            row: dict[str, Any] = {**info, "descriptor_bytes": size}
            loff = (le["addr"] - np.uint64(m.addr)).astype(np.int64)
            roff = (re_["addr"] - np.uint64(raddr)).astype(np.int64)
            lens = le["len"].astype(np.int64)
            nbytes = int(lens.sum())
            # the same-run baselines: one contiguous device copy of as many bytes (CUDA
            # events), and a gather of the same blocks (local -> a scratch copy)
            scratch = Mem(kind, m.nbytes, 99)
            dc = m.contiguous_copy_seconds(scratch, nbytes, args.reps)
            gather = m.device_copy_seconds(scratch, _blocks(loff, lens, size),
                                           _blocks(loff, lens, size), size, args.reps)
            del scratch
            row["device_copy_gbps"] = nbytes / dc / 1e9
            row["device_gather_gbps"] = nbytes / gather / 1e9

            paths: set[str] = set()
            times: dict[str, list[float]] = {"read": [], "write": []}

            def once(op: Any, le: Any = le, re_: Any = re_, case: str = case,
                     paths: set[str] = paths, tc: Any = tc) -> float:
                return _timed(tc, op, le, re_, kind, args.op_timeout, paths, case)

            def same(m: Mem = m, case: str = case, loff: Any = loff, roff: Any = roff,
                     lens: Any = lens) -> bool:
                """READ put the target's blocks into ours; WRITE ours into the target's."""
                theirs = tgt.call(op="digest", case=case, off=roff.tolist(),
                                  len=lens.tolist())
                return m.digest(loff, lens) == theirs["digest"]

            try:
                for op in (Op.READ, Op.WRITE):  # one of each first, verified from fresh bytes
                    once(op)
                    row[f"{op.value.lower()}_verified"] = same()
                    if op is Op.READ:  # back to our own bytes before the WRITE
                        m.reset()
                    else:
                        tgt.call(op="reset", case=case)
                order = np.random.default_rng(1)
                for _ in range(args.reps):  # then both, in a fresh random order each time
                    for k in order.permutation(2).tolist():
                        op = (Op.READ, Op.WRITE)[k]
                        times[op.value.lower()].append(once(op))
                row["timed_consistent"] = same()  # both sides hold the same blocks
                m.reset()
                tgt.call(op="reset", case=case)
            except RuntimeError as exc:
                row["error"] = str(exc)
            row["paths"] = sorted(paths)
            for key, ts in times.items():
                if len(ts) == args.reps:
                    med = statistics.median(ts)
                    row[f"{key}_median_s"] = med
                    row[f"{key}_gbps"] = nbytes / med / 1e9
                    row[f"{key}_over_device_copy"] = dc / med
                    row[f"{key}_over_device_gather"] = gather / med
            if len(times["read"]) == len(times["write"]) == args.reps:
                from _common import change_interval

                row["read_vs_write"] = (statistics.median(times["read"])
                                        / statistics.median(times["write"]) - 1)
                row["read_vs_write_90pct"] = change_interval(times["write"], times["read"])
            row["raw_s"] = times
            res["cases"][case] = row
            print(case, json.dumps(row), flush=True)
    finally:
        for x in extra.values():
            x.close()
        t.close()
        tgt.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=("vram", "dram"), default="vram")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--reps", type=int, default=20,
                    help="timed READs and WRITEs each, interleaved in a random order")
    ap.add_argument("--op-timeout", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=220.0, help="bound on the whole run (s)")
    ap.add_argument("--role", choices=("initiator", "target"), default="initiator",
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.alarm(int(args.timeout) + (30 if args.role == "target" else 0))  # hard bound
    if args.role == "target":
        target(args.memory)
        return
    res = initiator(args)
    out_dir = args.out or os.path.join(HERE, "..", "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    from _common import write_result

    write_result("gpu_nixl_check", res, os.path.join(out_dir, "gpu_nixl_check.json"))


if __name__ == "__main__":
    main()
