"""What UCX's own tools say: where ``ucx_info`` / ``ucx_perftest`` are, and their predictions.

* :func:`ucx_transports` lists the transports UCX can open here (``ucx_info -d``), honouring
  ``UCX_TLS``.
* :func:`ucx_lanes` asks UCX to build an endpoint as if the peer were on this host (``intra``) or
  another host (``inter``) and returns its lanes (``ucx_info -e -u rm -P ...``). The lanes tagged
  ``rma_bw`` are the ones that carry bulk READ/WRITE. NIXL creates its endpoints with peer-failure
  handling, which puts active messages (notifications, wire-up) on ``tcp`` and keeps RMA on the
  lanes shown here; :func:`~kvlink_transports._ucx.measure.nixl_protocols` confirms it by running
  a real two-agent NIXL transfer.
* :func:`run_perftest` runs ``ucx_perftest`` on loopback, the baseline kvlink's UCX paths are
  measured against.

Separate from the measurement (``measure``) because these are predictions from binaries that
are not the UCX NIXL bundles: cheap, cached, and never more than a hint.
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
