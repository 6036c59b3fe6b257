"""UCX probes: which binaries exist, which transports UCX offers, and which it would pick.

Used by the ``nixl`` transport (to warn when KV would cross hosts over TCP or GPU memory would be
staged through host copies) and meant for ``kvlink doctor``. Everything here shells out to the
``ucx_info`` / ``ucx_perftest`` binaries (from a system UCX or from the ``libucx-cu12`` wheel);
nothing loads UCX into this process. Every probe returns an empty answer, never raises, when the
binaries are missing.

What the probes can and cannot tell:

* :func:`ucx_transports` lists the transports UCX can open here (``ucx_info -d``), honouring
  ``UCX_TLS``.
* :func:`ucx_lanes` asks UCX to build an endpoint as if the peer were on this host (``intra``) or
  another host (``inter``) and returns its lanes (``ucx_info -e -u rm -P ...``). The lanes tagged
  ``rma_bw`` are the ones that carry bulk READ/WRITE. NIXL creates its endpoints with peer-failure
  handling, which puts active messages (notifications, wire-up) on ``tcp`` and keeps RMA on the
  lanes shown here; :func:`nixl_protocols` confirms it by running a real two-agent NIXL transfer.
* The libucx wheel's UCX is not byte-for-byte the UCX that NIXL bundles, so treat the lane probe as
  a prediction and :func:`nixl_protocols` as the measurement.

:func:`tcp_sockets`, :func:`new_ucx_connections` and :func:`shutdown_connections` read this
process's TCP sockets from /proc (no UCX call either): the nixl transport uses them to tear down a
hung peer's UCX connections (docs/nixl.md "Deadlines").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping

#: UCX transports that move bytes with RDMA (what a cross-host KV transfer wants).
RDMA_TRANSPORTS = frozenset(
    {
        "rc",
        "rc_v",
        "rc_verbs",
        "rc_x",
        "rc_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "ud",
        "ud_v",
        "ud_verbs",
        "ud_x",
        "ud_mlx5",
        "srd",
        "gga",
        "gga_mlx5",
    }
)
#: UCX transports that move GPU memory without staging through host buffers.
GPU_DIRECT_TRANSPORTS = frozenset({"cuda_ipc", "gdr_copy"}) | RDMA_TRANSPORTS

_LANE_RE = re.compile(
    r"lane\[(\d+)\]:\s+\d+:([A-Za-z0-9_]+)/(\S+?)\s+md\[\d+\]\s+->.*?seg\s+\d+(.*)$"
)
_TL_RE = re.compile(r"^#\s+Transport:\s+(\S+)")


@dataclasses.dataclass(frozen=True)
class UcxLane:
    """One lane of a UCP endpoint as ``ucx_info -e`` prints it."""

    transport: str  # "cma", "tcp", "rc_mlx5", ...
    device: str  # "memory", "lo.0", "mlx5_0:1", ...
    roles: tuple[str, ...]  # "rma_bw#0", "am", "keepalive", "wireup", ...

    @property
    def rma(self) -> bool:
        return any(r.startswith(("rma_bw", "rma#", "rma")) for r in self.roles)


def _libucx_dir() -> str | None:
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(next(iter(spec.submodule_search_locations)))


def _find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    base = _libucx_dir()
    if base:
        cand = os.path.join(base, "bin", name)
        if os.access(cand, os.X_OK):
            return cand
    cand = os.path.join(os.path.dirname(sys.executable), name)
    return cand if os.access(cand, os.X_OK) else None


def ucx_info_path() -> str | None:
    """Path of a runnable ``ucx_info`` (PATH first, then the ``libucx`` wheel), or None."""
    return _find_binary("ucx_info")


def ucx_perftest_path() -> str | None:
    """Path of a runnable ``ucx_perftest`` (PATH first, then the ``libucx`` wheel), or None."""
    return _find_binary("ucx_perftest")


@dataclasses.dataclass(frozen=True)
class PerftestResult:
    server_cmd: str
    client_cmd: str
    iterations: int
    latency_us_avg: float
    mib_per_s: float  # bandwidth overall

    @property
    def gbps(self) -> float:
        return self.mib_per_s * (1 << 20) / 1e9


def run_perftest(test: str, size: int, iters: int, extra: tuple[str, ...] = (),
                 timeout: float = 300.0) -> PerftestResult:
    """``ucx_perftest`` server and client on loopback, the baseline kvlink's UCX paths are
    measured against. Raises RuntimeError saying why it could not run."""
    import socket
    import time

    path = ucx_perftest_path()
    if path is None:
        raise RuntimeError("ucx_perftest not found (pip install --no-deps libucx-cu12)")
    env = ucx_env(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([path, "-p", str(port), *extra], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cmd = [path, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size), "-n", str(iters),
           "-w", str(max(iters // 10, 10)), *extra]
    try:
        deadline = time.monotonic() + 30
        while True:  # the server needs a moment to listen: retry while the connect is refused
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if "Final:" in out.stdout:
                break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"ucx_perftest failed: {out.stderr.strip()[-200:]}")
            time.sleep(0.05)
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    line = next(ln for ln in out.stdout.splitlines() if "Final:" in ln)
    # Final: iters  lat50 lat_avg lat_overall  bw_avg bw_overall (MiB/s)  rate_avg rate_overall
    nums = [float(x) for x in line.split()[1:]]
    return PerftestResult(" ".join(["ucx_perftest", "-p", str(port), *extra]),
                          " ".join(["ucx_perftest", *cmd[1:]]), int(nums[0]), nums[2], nums[5])


def ucx_env(binary: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment to run a UCX binary with: the wheel's binaries need its lib/ on the path."""
    env = dict(os.environ if base is None else base)
    libdir = os.path.join(os.path.dirname(os.path.dirname(binary)), "lib")
    if os.path.isfile(os.path.join(libdir, "libucp.so.0")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p
        )
    return env


def _run_ucx_info(args: tuple[str, ...], tls: str | None) -> str:
    path = ucx_info_path()
    if path is None:
        return ""
    env = ucx_env(path)
    if tls is not None:
        env["UCX_TLS"] = tls
    try:
        proc = subprocess.run(
            [path, *args], env=env, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout


def _current_tls(tls: str | None) -> str | None:
    return tls if tls is not None else os.environ.get("UCX_TLS")


@functools.lru_cache(maxsize=16)
def _transports_cached(tls: str | None) -> tuple[str, ...]:
    out: list[str] = []
    for line in _run_ucx_info(("-d",), tls).splitlines():
        m = _TL_RE.match(line.strip())
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return tuple(out)


def ucx_transports(tls: str | None = None) -> list[str]:
    """Transports UCX can open on this machine under ``UCX_TLS`` (``tls`` overrides the env)."""
    return list(_transports_cached(_current_tls(tls)))


@functools.lru_cache(maxsize=16)
def _lanes_cached(placement: str, features: str, tls: str | None) -> tuple[UcxLane, ...]:
    lanes: list[UcxLane] = []
    for line in _run_ucx_info(("-e", "-u", features, "-P", placement), tls).splitlines():
        m = _LANE_RE.search(line)
        if m:
            lanes.append(UcxLane(m.group(2), m.group(3), tuple(m.group(4).split())))
    return tuple(lanes)


def ucx_lanes(
    placement: str = "intra", features: str = "rm", tls: str | None = None
) -> list[UcxLane]:
    """Lanes of an endpoint to a peer on this host (``intra``) or another (``inter``)."""
    if placement not in ("self", "intra", "inter"):
        raise ValueError(f"placement must be self, intra or inter, not {placement!r}")
    return list(_lanes_cached(placement, features, _current_tls(tls)))


def rma_transports(placement: str = "intra", tls: str | None = None) -> list[str]:
    """Transports UCX would use for bulk READ/WRITE to such a peer (empty when unknown)."""
    lanes = ucx_lanes(placement, "rm", tls)
    chosen = [ln.transport for ln in lanes if any(r.startswith("rma_bw") for r in ln.roles)]
    if not chosen:  # RMA emulated over active messages
        chosen = [ln.transport for ln in lanes if "am" in ln.roles]
    return list(dict.fromkeys(chosen))


def tcp_fallback_between_hosts(tls: str | None = None) -> bool | None:
    """True when a cross-host READ/WRITE would run over TCP only; None when it can't be told."""
    chosen = rma_transports("inter", tls)
    if not chosen:
        return None
    return not any(t in RDMA_TRANSPORTS for t in chosen)


def gpu_staged(same_host: bool, tls: str | None = None) -> bool | None:
    """True when GPU memory would be staged through host copies (cuda_copy) for such a peer."""
    avail = ucx_transports(tls)
    if not avail:
        return None
    if same_host:
        return "cuda_ipc" not in avail
    return not any(t in RDMA_TRANSPORTS for t in avail)


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes (``/sys/class/infiniband``); empty on hosts without any."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def apply_safe_env(env: dict[str, str] | None = None) -> str | None:
    """Work around a crash at process exit of every process that started a NIXL UCX backend.

    The nixl wheels bundle their own libibverbs/libnl; UCX's ``ib`` module loads them, and the
    system's libibverbs providers (rdma-core, when installed) pull in the system's libnl too. Two
    copies of libnl-route then interpose each other's symbols and their destructors segfault in
    ``rtnl_tc_unregister`` after ``main`` returns (exit status 139; seen with nixl 1.5.1). On a host
    without RDMA devices the ``ib`` module is useless, so unless the user set ``UCX_MODULES``
    themselves this sets ``UCX_MODULES=^ib`` in ``env`` (default: ``os.environ``, which must happen
    before the first UCX context of the process). Returns the value set, or None.
    """
    target = os.environ if env is None else env
    if "UCX_MODULES" in target or rdma_devices():
        return None
    target["UCX_MODULES"] = "^ib"
    return "^ib"


# ------------------------------------------------------------------ measured: real NIXL agents

_PROTO_OP_RE = re.compile(r"remote memory (read|write) by ucp_(?:get|put)")
_PROTO_SCOPE_RE = re.compile(r"\s(self|intra-node|inter-node) cfg#\d+")


def parse_proto_info(text: str) -> dict[str, list[str]]:
    """Parse ``UCX_PROTO_INFO=y`` tables of endpoints to other processes (loopback "self"
    endpoints are skipped): {"read": [config, ...], "write": [...]}, config as UCX prints it,
    e.g. "cma/memory" or "52% on tcp/lo and 48% on tcp/eth0" (:func:`parse_proto_rows`'
    configs per op, each once, in order)."""
    out: dict[str, list[str]] = {}
    for row in parse_proto_rows(text):
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
else:
    buf = np.full(nbytes, 1 if role == "t" else 0, np.uint8)
    addr, dev = buf.ctypes.data, 0
    def checksum():
        return int(buf.sum(dtype=np.int64))
# the target needs UCX progress (wire-up, AM-emulated RMA) while it waits: a progress thread
a = nixl_agent("kvlink-probe-" + role + str(os.getpid()),
               nixl_agent_config(enable_prog_thread=(role == "t")))
a.register_memory(np.array([[addr, nbytes, dev]], dtype=np.uint64), mem)
out = sys.stdout.buffer
if role == "t":
    md = a.get_agent_metadata() + addr.to_bytes(8, "little")
    out.write(b"KVLINK-MD " + md.hex().encode() + b"\n")
    out.flush()
    sys.stdin.buffer.read(1)
    sys.exit(0)
blob = bytes.fromhex(sys.stdin.read().strip())
md, raddr = blob[:-8], int.from_bytes(blob[-8:], "little")
peer = a.add_remote_agent(md)
peer = peer.decode() if isinstance(peer, bytes) else peer
res = {}
for op in ("READ", "WRITE"):
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


def parse_proto_rows(text: str) -> list[dict[str, str]]:
    """Rows of ``UCX_PROTO_INFO=y`` tables of endpoints to other processes (loopback "self"
    endpoints skipped): {"op": "read"|"write", "scope": "intra-node"|"inter-node", "range":
    "0..8184", "protocol": "zero-copy", "config": "cma/memory"}, in the order printed."""
    rows: list[dict[str, str]] = []
    scope = ""
    current: str | None = None
    for raw in text.splitlines():
        line = re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", raw).strip()
        sm = _PROTO_SCOPE_RE.search(line)
        if sm:
            scope, current = sm.group(1), None
            continue
        m = _PROTO_OP_RE.search(line)
        if m:
            current = m.group(1) if scope != "self" else None
            continue
        if current is None:
            continue
        r = _PROTO_FULL_ROW_RE.match(line)
        if r:
            rows.append({"op": current, "scope": scope, "range": r.group(1).strip(),
                         "protocol": r.group(2).strip(), "config": r.group(3).strip()})
        elif line.startswith("+") and any(x["op"] == current for x in rows):
            current = None
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


#: UCX settings kvlink applies to the NIXL agents it creates, unless already set. Why: UCX's
#: cuda_ipc turns GET zero-copy off when NVML reports no active NVLink (its default "auto"), and
#: NIXL's READ of VRAM then ran at ~0.5 GB/s instead of 330-500 GB/s on one H200 (issue 22).
KVLINK_UCX_DEFAULTS: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}

#: settings the doctor shows and checks
UCX_SETTINGS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
                "UCX_PROTO_EMULATION_ENABLE", "UCX_MODULES", "UCX_RNDV_SCHEME",
                "UCX_IB_GPU_DIRECT_RDMA", "UCX_MAX_RNDV_RAILS")


def cuda_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded here (UCX's cuda transports can load)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(
        [d for d in _listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def apply_kvlink_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set :data:`KVLINK_UCX_DEFAULTS` in ``env`` (default ``os.environ``; must happen before
    the UCX context is made, i.e. before the NIXL agent) where the user has not set them.
    Returns what was set (empty when the user's own values stand)."""
    target = os.environ if env is None else env
    done: dict[str, str] = {}
    if not cuda_driver_present():  # UCX would warn "unused environment variable" at each init
        return done
    for k, v in KVLINK_UCX_DEFAULTS.items():
        if k not in target:
            target[k] = v
            done[k] = v
    return done


def ucx_settings(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The UCX settings that decide what carries the bytes, as this process has them."""
    src = os.environ if env is None else env
    return {k: src.get(k) for k in UCX_SETTINGS}


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
        res.lanes = parse_proto_info(text)
        for row in parse_proto_rows(text):
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


# ------------------------------------------------------------------ UCX's TCP connections here
#
# NIXL 1.5.1 has no call that stops a UCX READ/WRITE in flight (releasing the request or removing
# the remote agent leaves UCX's operation running: docs/nixl.md "Deadlines"). What does stop it is
# UCX failing the endpoint, which it does when a TCP connection of the endpoint breaks. These
# helpers find the TCP connections this process's UCX opened to a peer and shut them down. Linux
# only (/proc); elsewhere they find nothing.

TcpEnd = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process (from /proc/self/fd and /proc/self/net/tcp{,6})."""

    fd: int
    inode: int
    local: TcpEnd
    remote: TcpEnd
    listening: bool


def _proc_addr(text: str) -> TcpEnd:
    """``0100007F:1F90`` (/proc/net/tcp: 32-bit words in host order) -> ("127.0.0.1", 8080)."""
    import socket

    ip_hex, _, port_hex = text.partition(":")
    raw = bytes.fromhex(ip_hex)
    ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(ip) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, ip), int(port_hex, 16)


def tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets, listening or connected (any state); empty where /proc is not."""
    inodes: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes[int(link[8:-1])] = int(fd)
    out: list[TcpSocket] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or int(cols[9]) not in inodes:
                continue
            inode = int(cols[9])
            out.append(TcpSocket(inodes[inode], inode, _proc_addr(cols[1]), _proc_addr(cols[2]),
                                 int(cols[3], 16) == 0x0A))
    return out


def _in_ucx_address(end: TcpEnd, blob: bytes) -> bool:
    """Whether ``blob`` (a peer's NIXL metadata, which holds its UCX worker address) carries
    ``end`` as a UCX tcp interface: the iface address is the listening port, big-endian, after
    a length byte whose low 6 bits are 2 (the top two are flags); a non-loopback device address
    carries the IP's bytes."""
    import ipaddress
    import socket

    ip, port = end
    pb = port.to_bytes(2, "big")
    at = blob.find(pb, 1)
    while at > 0 and (blob[at - 1] & 0x3F) != 2:
        at = blob.find(pb, at + 1)
    if at <= 0:
        return False
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback:  # UCX's loopback device address holds namespace ids, not the IP
        return True
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    return socket.inet_pton(family, ip) in blob


def new_ucx_connections(before: list[TcpSocket], after: list[TcpSocket],
                        metadata: bytes) -> frozenset[TcpEnd]:
    """Remote ends of the TCP connections this process opened between two :func:`tcp_sockets`
    snapshots to UCX interfaces named in a peer's ``metadata``: what NIXL's ``add_remote_agent``
    (UCX's endpoint creation) dialled. Connections accepted on one of our listening ports and
    ones to ports the peer's UCX address does not name are left out."""
    seen = {s.inode for s in before}
    ours = {s.local[1] for s in after if s.listening}
    return frozenset(
        s.remote
        for s in after
        if s.inode not in seen and not s.listening and s.local[1] not in ours
        and _in_ucx_address(s.remote, metadata)
    )


def shutdown_connections(remotes: frozenset[TcpEnd]) -> int:
    """``shutdown(SHUT_RDWR)`` every TCP connection of this process to one of ``remotes``; the
    descriptors stay open (UCX closes its own once it sees the connection end). Each socket is
    checked by inode through a duplicate of its descriptor first, so one closed and reused
    meanwhile is left alone. Returns how many were shut down."""
    import socket

    done = 0
    for s in tcp_sockets():
        if s.listening or s.remote not in remotes:
            continue
        try:
            dup = os.dup(s.fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != s.inode:
                continue
            sock = socket.socket(fileno=dup)
            dup = -1  # the socket object owns it now
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # already shut or reset
                pass
            finally:
                sock.close()
        finally:
            if dup >= 0:
                os.close(dup)
    return done


def report(tls: str | None = None) -> dict[str, object]:
    """Everything ``kvlink doctor`` wants to print about UCX here."""
    return {
        "ucx_info": ucx_info_path(),
        "ucx_perftest": ucx_perftest_path(),
        "UCX_TLS": _current_tls(tls),
        "transports": ucx_transports(tls),
        "rma_same_host": rma_transports("intra", tls),
        "rma_other_host": rma_transports("inter", tls),
        "tcp_between_hosts": tcp_fallback_between_hosts(tls),
    }


if __name__ == "__main__":  # python -m kvlink_transports._ucx
    import json

    rep = report()
    rep["nixl_measured"] = nixl_protocols()
    print(json.dumps(rep, indent=2))
