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
import os
import re
import shutil
import subprocess
import sys
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
_PROTO_ROW_RE = re.compile(
    r"^\|\s*[0-9][0-9KMGTinf.]*(?:\.\.[0-9KMGTinf]+)?\s*\|[^|]*\|\s*([^|]+?)\s*\|"
)


def parse_proto_info(text: str) -> dict[str, list[str]]:
    """Parse ``UCX_PROTO_INFO=y`` tables of endpoints to other processes (loopback "self"
    endpoints are skipped): {"read": [config, ...], "write": [...]}, config as UCX prints it,
    e.g. "cma/memory" or "52% on tcp/lo and 48% on tcp/eth0"."""
    out: dict[str, list[str]] = {}
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
        r = _PROTO_ROW_RE.match(line)
        if r:
            cfg = r.group(1).strip()
            lst = out.setdefault(current, [])
            if cfg not in lst:
                lst.append(cfg)
        elif line.startswith("+") and out.get(current):
            current = None
    return out


_PROBE_CHILD = r"""
import sys, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
role, = sys.argv[1:]
# the target needs UCX progress (wire-up, AM-emulated RMA) while it waits: a progress thread
a = nixl_agent("kvlink-probe-" + role, nixl_agent_config(enable_prog_thread=(role == "t")))
buf = np.ones(1 << 20, np.uint8)
a.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
out = sys.stdout.buffer
if role == "t":
    md = a.get_agent_metadata() + buf.ctypes.data.to_bytes(8, "little")
    out.write(b"KVLINK-MD " + md.hex().encode() + b"\n")
    out.flush()
    sys.stdin.buffer.read(1)
    sys.exit(0)
blob = bytes.fromhex(sys.stdin.read().strip())
md, raddr = blob[:-8], int.from_bytes(blob[-8:], "little")
peer = a.add_remote_agent(md)
peer = peer.decode() if isinstance(peer, bytes) else peer
for op in ("READ", "WRITE"):
    h = a.initialize_xfer(op, a.get_xfer_descs([(buf.ctypes.data, buf.nbytes, 0)], "DRAM"),
                          a.get_xfer_descs([(raddr, buf.nbytes, 0)], "DRAM"), peer)
    s = a.transfer(h)
    while s == "PROC":
        s = a.check_xfer_state(h)
    h.release()
sys.stderr.write("KVLINK-PROBE-DONE\n")
"""


def nixl_protocols(tls: str | None = None, timeout: float = 60.0) -> dict[str, list[str]]:
    """Run one READ and one WRITE between two throw-away NIXL agents in two processes on this host
    with ``UCX_PROTO_INFO=y`` and return the UCX transports that carried them, e.g.
    ``{"read": ["cma/memory"], "write": ["cma/memory"]}``. Empty on any failure (nixl missing)."""
    env = dict(os.environ)
    if tls is not None:
        env["UCX_TLS"] = tls
    apply_safe_env(env)
    cmd = [sys.executable, "-c", _PROBE_CHILD]
    try:
        target = subprocess.Popen(
            [*cmd, "t"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return {}
    try:
        assert target.stdout is not None and target.stdin is not None
        blob = b""
        for line in target.stdout:
            if line.startswith(b"KVLINK-MD "):
                blob = line[len(b"KVLINK-MD ") :].strip()
                break
        if not blob:
            return {}
        init = subprocess.run(
            [*cmd, "i"],
            env={**env, "UCX_PROTO_INFO": "y"},
            input=blob,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        text = init.stdout.decode(errors="replace") + init.stderr.decode(errors="replace")
        if "KVLINK-PROBE-DONE" not in text:
            return {}
        return parse_proto_info(text)
    except (OSError, subprocess.SubprocessError):
        return {}
    finally:
        try:
            if target.stdin is not None:
                target.stdin.close()
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


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
