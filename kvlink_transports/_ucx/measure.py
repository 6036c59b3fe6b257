"""Measured: which UCX lanes a real NIXL READ and WRITE used, and the verdict on them.

:func:`nixl_probe` runs one READ and one WRITE between two throw-away NIXL agents in two
processes on this host, with kvlink's UCX settings and ``UCX_PROTO_INFO=y`` on the initiator;
:func:`parse_proto_info` reads the protocol tables UCX prints, and :func:`classify_lanes` says
whether those lanes are fast for the pair (a GPU pair: cuda_ipc or RDMA; a host pair: shared
memory or RDMA). The libucx wheel's UCX is not byte-for-byte the UCX that NIXL bundles, so
treat ``ucx_info``'s lanes (``info``) as a prediction and this as the measurement. Separate
because it starts processes and NIXL agents, which takes seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Mapping

from kvlink_transports._ucx.env import apply_kvlink_env, apply_safe_env
from kvlink_transports._ucx.info import RDMA_TRANSPORTS

_PROTO_OP_RE = re.compile(r"remote memory (read|write) by ucp_(?:get|put)")
#: the memory types of a table's header, local then remote: "... into host memory from host"
#: (a GET), "... from host memory to cuda/dev[1]", "... into cuda/GPU0 from cuda/dev[1]" (UCX
#: 1.23 in nixl-cu13, an H200: tests/data/ucx_proto_info_vram_h200.txt)
_PROTO_MEM_RE = re.compile(r"\b(?:into|from) ([A-Za-z][\w-]*)\S*(?: memory)? (?:from|to) "
                           r"([A-Za-z][\w-]*)")
_PROTO_SCOPE_RE = re.compile(r"\s(self|intra-node|inter-node) cfg#\d+")


def parse_proto_info(text: str, memory: str | None = None) -> dict[str, list[str]]:
    """Parse ``UCX_PROTO_INFO=y`` tables of endpoints to other processes (loopback "self"
    endpoints are skipped): {"read": [config, ...], "write": [...]}, config as UCX prints it,
    e.g. "cma/memory" or "52% on tcp/lo and 48% on tcp/eth0" (:func:`parse_proto_rows`'
    configs per op, each once, in order). ``memory`` ("host", "cuda"): only the tables of
    transfers from and to that memory type (a process moving GPU memory also prints tables
    for host memory it moves, which say nothing about the GPU's path)."""
    out: dict[str, list[str]] = {}
    for row in rows_for(parse_proto_rows(text), memory):
        lst = out.setdefault(row["op"], [])
        if row["config"] not in lst:
            lst.append(row["config"])
    return out


_PROBE_CHILD = r"""
import json, os, sys, time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
role, mem, nbytes, iters = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
gpu = int(sys.argv[5])
if mem == "VRAM":
    import torch
    torch.cuda.set_device(gpu)
    buf = torch.full((nbytes,), 1 if role == "t" else 0, dtype=torch.uint8, device=f"cuda:{gpu}")
    torch.cuda.synchronize()
    addr, dev = buf.data_ptr(), gpu
    def checksum():
        torch.cuda.synchronize()
        return int(buf.to(torch.int64).sum().item())
    def fill(v):
        buf.fill_(v)
        torch.cuda.synchronize()
else:
    buf = np.full(nbytes, 1 if role == "t" else 0, np.uint8)
    addr, dev = buf.ctypes.data, 0
    def checksum():
        return int(buf.sum(dtype=np.int64))
    def fill(v):
        buf[:] = v
# the target needs UCX progress (wire-up, AM-emulated RMA) while it waits: a progress thread
a = nixl_agent("kvlink-probe-" + role + str(os.getpid()),
               nixl_agent_config(enable_prog_thread=(role == "t")))
a.register_memory(np.array([[addr, nbytes, dev]], dtype=np.uint64), mem)
out = sys.stdout.buffer
if role == "t":
    md = a.get_agent_metadata() + addr.to_bytes(8, "little")
    out.write(b"KVLINK-MD " + md.hex().encode() + b"\n")
    out.flush()
    sys.stdin.buffer.read(1)  # the initiator is done: what its WRITEs left here
    out.write(b"KVLINK-SUM %d\n" % checksum())
    out.flush()
    sys.exit(0)
blob = bytes.fromhex(sys.stdin.read().strip())
md, raddr = blob[:-8], int.from_bytes(blob[-8:], "little")
peer = a.add_remote_agent(md)
peer = peer.decode() if isinstance(peer, bytes) else peer
res = {}
for op in ("READ", "WRITE"):  # READ takes the target's 1s; WRITE gives it our 2s
    if op == "WRITE":
        fill(2)
    best = None
    for i in range(iters + 1):  # the first one prints UCX's protocol table: not timed
        t0 = time.perf_counter()
        h = a.initialize_xfer(op, a.get_xfer_descs([(addr, nbytes, dev)], mem),
                              a.get_xfer_descs([(raddr, nbytes, dev)], mem), peer)
        s = a.transfer(h)
        while s == "PROC":
            s = a.check_xfer_state(h)
        dt = time.perf_counter() - t0
        h.release()
        if s != "DONE":
            res[op] = {"error": f"NIXL state {s}"}
            break
        if i:
            best = dt if best is None else min(best, dt)
    else:
        res[op] = {"gbps": nbytes / best / 1e9}
    if op == "READ" and "error" not in res[op] and checksum() != nbytes:
        res[op]["error"] = "bytes read differ from the target's"
sys.stderr.write("KVLINK-PROBE " + json.dumps(res) + "\n")
"""


def rows_for(rows: list[dict[str, str]], memory: str | None) -> list[dict[str, str]]:
    """The rows of transfers whose local and remote memory are both of type ``memory``
    ("host", "cuda"; None: every row). A row whose table named no memory type is kept."""
    if memory is None:
        return rows
    return [r for r in rows if r.get("local", memory).startswith(memory)
            and r.get("remote", memory).startswith(memory)]


def parse_proto_rows(text: str) -> list[dict[str, str]]:
    """Rows of ``UCX_PROTO_INFO=y`` tables of endpoints to other processes (loopback "self"
    endpoints skipped): {"op": "read"|"write", "scope": "intra-node"|"inter-node", "range":
    "0..8184", "protocol": "zero-copy", "config": "cma/memory"}, in the order printed, with
    "local" and "remote" (memory types, e.g. "host", "cuda") where the table's header names
    them."""
    rows: list[dict[str, str]] = []
    scope = ""
    current: str | None = None
    mem: dict[str, str] = {}
    in_table = 0  # rows read of the current table (its closing rule comes after them)
    for raw in text.splitlines():
        line = re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", raw).strip()
        sm = _PROTO_SCOPE_RE.search(line)
        if sm:
            scope, current = sm.group(1), None
            continue
        m = _PROTO_OP_RE.search(line)
        if m:
            current = m.group(1) if scope != "self" else None
            mm = _PROTO_MEM_RE.search(line, m.end())
            mem = {"local": mm.group(1), "remote": mm.group(2)} if mm else {}
            in_table = 0
            continue
        if current is None:
            continue
        r = _PROTO_FULL_ROW_RE.match(line)
        if r:
            rows.append({"op": current, "scope": scope, "range": r.group(1).strip(),
                         "protocol": r.group(2).strip(), "config": r.group(3).strip(),
                         **mem})
            in_table += 1
        elif line.startswith("+") and in_table:  # this table's rows are over (a second
            current = None  # table of the same op had been cut off here at its first rule)
    return rows


_PROTO_FULL_ROW_RE = re.compile(
    r"^\|\s*([0-9][0-9KMGTinf.]*(?:\.\.[0-9KMGTinf]+)?)\s*\|([^|]*)\|\s*([^|]+?)\s*\|"
)
_TL_IN_CFG_RE = re.compile(r"([A-Za-z][A-Za-z0-9_]*)/")

#: UCX transports that copy between processes of one host without the network stack
SHM_TRANSPORTS = frozenset({"cma", "knem", "xpmem", "sysv", "posix", "self"})


def lane_transports(configs: list[str]) -> list[str]:
    """UCX transport names in protocol configs: ["52% on tcp/lo and 48% on tcp/eth0"] ->
    ["tcp"]; "cuda_ipc/cuda" -> "cuda_ipc"."""
    out: list[str] = []
    for c in configs:
        for t in _TL_IN_CFG_RE.findall(c):
            if t not in out:
                out.append(t)
    return out


@dataclasses.dataclass(frozen=True)
class LaneVerdict:
    """What :func:`classify_lanes` says about the lanes of one op between two memories."""

    verdict: str  # "fast" | "slow" | "unknown"
    reason: str
    transports: tuple[str, ...] = ()


def classify_lanes(lanes: Mapping[str, list[str]], *, vram: bool, same_host: bool,
                   protocols: Mapping[str, list[str]] | None = None) -> LaneVerdict:
    """Classify measured UCX lanes ({"read": [config, ...], "write": [...]}, as
    :func:`parse_proto_info` returns them; ``protocols`` the protocol column per op, for
    emulation) of a pair whose memory is GPU (``vram``) or host, on one host or two.

    A GPU pair is fast only on cuda_ipc (same host) or an RDMA transport (GPUDirect, other
    host); on tcp, cuda_copy (staged through host memory) or UCX's software emulation it is
    slow. A host pair is fast on shared-memory transports (same host) or RDMA; tcp is slow."""
    ops = {op: lane_transports(list(cfgs)) for op, cfgs in lanes.items() if cfgs}
    if not ops:
        return LaneVerdict("unknown", "no UCX protocol was measured")
    used = tuple(dict.fromkeys(t for tls in ops.values() for t in tls))
    emulated = sorted(op for op, ps in (protocols or {}).items()
                      if any("emul" in p.lower() or p.strip().startswith("am ") for p in ps))
    if emulated:
        return LaneVerdict("slow", f"UCX emulates {'/'.join(emulated)} in software over active "
                           f"messages ({', '.join(used)})", used)
    if vram:
        good = {"cuda_ipc"} if same_host else set(RDMA_TRANSPORTS)
        want = "cuda_ipc" if same_host else "a GPUDirect RDMA transport (rc/dc/ud)"
    else:
        good = set(SHM_TRANSPORTS | RDMA_TRANSPORTS) if same_host else set(RDMA_TRANSPORTS)
        want = "cma/shared memory" if same_host else "an RDMA transport (rc/dc/ud)"
    bad = {op: tls for op, tls in ops.items() if not any(t in good for t in tls)}
    if not bad:
        return LaneVerdict("fast", f"{', '.join(used)}", used)
    why = "; ".join(f"{op.upper()} over {'+'.join(tls)}" for op, tls in sorted(bad.items()))
    extra = ""
    if vram and any("cuda_copy" in tls for tls in bad.values()):
        extra = " (cuda_copy stages GPU memory through host buffers)"
    elif any("tcp" in tls for tls in bad.values()):
        extra = " (the kernel's TCP stack)"
    return LaneVerdict("slow", f"{why}{extra}, not {want}", used)


@dataclasses.dataclass
class NixlProbe:
    """One measured NIXL READ+WRITE between two agents in two processes (:func:`nixl_probe`)."""

    memory: str  # "DRAM" | "VRAM"
    ok: bool
    lanes: dict[str, list[str]]  # {"read": [config], "write": [...]}, from UCX_PROTO_INFO
    protocols: dict[str, list[str]]  # {"read": ["zero-copy"], ...}
    gbps: dict[str, float]  # {"read": 9.8, "write": 10.1}, best of the timed iterations
    nbytes: int
    error: str = ""
    #: the UCX_PROTO_INFO rows those come from (parse_proto_rows), of the probed memory only
    rows: list[dict[str, str]] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # what kvlink added

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def nixl_probe(memory: str = "DRAM", nbytes: int = 16 << 20, iters: int = 3,
               tls: str | None = None, timeout: float = 60.0,
               base_env: Mapping[str, str] | None = None, device: int = 0) -> NixlProbe:
    """Run READ and WRITE of ``nbytes`` (one descriptor) between two throw-away NIXL agents in
    two processes on this host, with kvlink's UCX settings (:func:`apply_kvlink_env`) and
    ``UCX_PROTO_INFO=y`` on the initiator: the UCX lanes NIXL's own UCX chose, and the
    bandwidth. ``memory`` "VRAM" puts both buffers on cuda:``device`` (needs torch with
    CUDA). Never
    raises: a failure is ``ok=False`` with ``error`` saying why."""
    env = dict(os.environ if base_env is None else base_env)
    if tls is not None:
        env["UCX_TLS"] = tls
    added = apply_kvlink_env(env)
    apply_safe_env(env)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    res = NixlProbe(memory, False, {}, {}, {}, nbytes, env=added)
    if importlib.util.find_spec("nixl") is None:
        res.error = "nixl not installed (pip install nixl)"
        return res
    args = [memory, str(nbytes), str(iters), str(device)]
    cmd = [sys.executable, "-c", _PROBE_CHILD]
    import tempfile

    errf = tempfile.TemporaryFile()  # noqa: SIM115 (closed at the end, on every path)
    try:
        target = subprocess.Popen([*cmd, "t", *args], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=errf)
    except OSError as exc:
        errf.close()
        res.error = f"could not start the probe: {exc}"
        return res
    try:
        assert target.stdout is not None and target.stdin is not None
        blob = b""
        done = threading.Event()
        def _kill() -> None:
            if not done.is_set():
                target.kill()

        timer = threading.Timer(timeout, _kill)
        timer.daemon = True
        timer.start()
        for line in target.stdout:
            if line.startswith(b"KVLINK-MD "):
                blob = line[len(b"KVLINK-MD "):].strip()
                break
        done.set()
        timer.cancel()
        if not blob:
            target.wait(timeout=10)
            errf.seek(0)
            err = errf.read().decode(errors="replace")
            res.error = "probe target failed: " + (_last_line(err) or "no output")
            return res
        init = subprocess.run([*cmd, "i", *args], env={**env, "UCX_PROTO_INFO": "y"},
                              input=blob, capture_output=True, timeout=timeout, check=False)
        text = init.stdout.decode(errors="replace") + init.stderr.decode(errors="replace")
        kind = "cuda" if memory == "VRAM" else "host"
        res.rows = rows_for(parse_proto_rows(text), kind)
        res.lanes = parse_proto_info(text, kind)
        for row in res.rows:
            lst = res.protocols.setdefault(row["op"], [])
            if row["protocol"] not in lst:
                lst.append(row["protocol"])
        m = re.search(r"KVLINK-PROBE (\{.*\})", text)
        if m is None:
            res.error = f"probe initiator failed (exit {init.returncode}): " + (
                _last_line(text) or "no output")
            return res
        out = json.loads(m.group(1))
        errs = [f"{op} {v['error']}" for op, v in out.items() if "error" in v]
        if "gbps" in out.get("WRITE", {}) and _target_sum(target) != 2 * nbytes:
            errs.append("WRITE: bytes written differ from ours")
        res.gbps = {op.lower(): float(v["gbps"]) for op, v in out.items() if "gbps" in v}
        res.error = "; ".join(errs)
        res.ok = not errs
        return res
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    finally:
        try:
            if target.stdin is not None:
                target.stdin.close()
            target.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            target.kill()
            target.wait()
        errf.close()


def _target_sum(target: subprocess.Popen[bytes]) -> int | None:
    """The probe target's checksum once the initiator is done (None: it did not say)."""
    assert target.stdin is not None and target.stdout is not None
    try:
        target.stdin.write(b"x")
        target.stdin.close()
        if not select.select([target.stdout], [], [], 30.0)[0]:
            return None
        line = target.stdout.readline()
    except (OSError, ValueError):
        return None
    m = re.match(rb"KVLINK-SUM (\d+)", line)
    return int(m.group(1)) if m else None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "rror" in ln or "ERR" in ln]
    return (errs or lines or [""])[-1][-300:]


def nixl_protocols(tls: str | None = None, timeout: float = 60.0) -> dict[str, list[str]]:
    """The UCX configs that carried one DRAM READ and WRITE between two throw-away NIXL agents
    on this host (:func:`nixl_probe`), e.g. ``{"read": ["cma/memory"], "write":
    ["cma/memory"]}``. Empty on any failure (nixl missing)."""
    p = nixl_probe("DRAM", 1 << 20, 1, tls=tls, timeout=timeout)
    return p.lanes if p.ok else {}
