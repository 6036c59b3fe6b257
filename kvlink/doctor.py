"""`kvlink doctor`: what carries my bytes here, and how do I fix it.

Every line is read off the machine (sysfs, /proc, the libraries' metadata, a measured NIXL
transfer between two processes); nothing is assumed. What cannot be checked says why.

* versions of kvlink, NIXL, the UCX NIXL bundles (``ucp_get_version_string`` of its own
  libucp) and the libucx wheel's, Mooncake (``importlib.metadata``);
* the UCX settings that decide the path (UCX_TLS, UCX_NET_DEVICES, cuda_ipc GET zero-copy,
  software emulation, ...) and what kvlink's nixl transport adds to them;
* a measured NIXL probe: READ and WRITE between two agents in two processes, host memory and
  (with a CUDA device) GPU memory, naming the UCX lanes UCX_PROTO_INFO says carried them and
  the GB/s;
* a verdict per transport: usable, slow and why, or missing with the pip line;
* the system: memlock ulimit, /dev/shm, CMA's ptrace scope, RDMA NICs (state, rate), GPU/NIC
  NUMA affinity, nvidia_peermem and dma-buf.

:func:`run` prints it (text or JSON) and returns the exit code: 1 under ``strict`` when any
warning was raised, else 0.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata as md
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from kvlink.transport import registered_transports

PIP = {
    "nixl": "pip install 'kvlink[nixl]'  (or: pip install nixl)",
    "mooncake": "pip install mooncake-transfer-engine  (CPU only: "
                "mooncake-transfer-engine-non-cuda)",
    "ucx_tools": "pip install --no-deps libucx-cu12  (ucx_info, ucx_perftest)",
}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _dist_version(*names: str) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            continue
    return out


def _mooncake_dists() -> dict[str, str]:
    out = {}
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower()
        if name.startswith("mooncake"):
            out[name] = d.version
    return out


def _nixl_ucx_version() -> str | None:
    """Version of the UCX that NIXL bundles: its own libucp, asked in this process."""
    for mod in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.origin:
            continue
        libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(spec.origin)),
                                      f"{mod}.libs", "libucp*.so*"))
        for lib in libs:
            try:
                fn = ctypes.CDLL(lib).ucp_get_version_string
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_char_p
            v = fn()
            return f"{v.decode()} ({mod})" if v else None
    return None


def _wheel_ucx_version() -> str | None:
    from kvlink_transports import _ucx

    path = _ucx.ucx_info_path()
    if path is None:
        return None
    try:
        out = subprocess.run([path, "-v"], env=_ucx.ucx_env(path), capture_output=True,
                             text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    import re

    m = re.search(r"version[=:]\s*([0-9][0-9.]*)", out, re.IGNORECASE)
    return m.group(1) if m else None


def versions() -> dict[str, Any]:
    nixl = _dist_version("nixl", "nixl-cu12", "nixl-cu13")
    return {
        "python": sys.version.split()[0],
        "kvlink": _dist_version("kvlink").get("kvlink", "source tree"),
        "nixl": nixl or None,
        "ucx_in_nixl": _nixl_ucx_version() if nixl else None,
        "ucx_libucx_wheel": _wheel_ucx_version(),
        "mooncake": _mooncake_dists() or None,
        "torch": _dist_version("torch").get("torch"),
    }


# ------------------------------------------------------------------ UCX

_TLS_ALIASES = {
    "sm": {"sysv", "posix", "cma", "knem", "xpmem"},
    "shm": {"sysv", "posix", "cma", "knem", "xpmem"},
    "cuda": {"cuda_copy", "cuda_ipc", "gdr_copy"},
    "ib": {"rc", "rc_v", "rc_verbs", "rc_x", "rc_mlx5", "ud", "ud_v", "ud_verbs", "ud_x",
           "ud_mlx5", "dc", "dc_x", "dc_mlx5"},
    "rc": {"rc_v", "rc_verbs", "rc_x", "rc_mlx5"},
    "ud": {"ud_v", "ud_verbs", "ud_x", "ud_mlx5"},
    "dc": {"dc_x", "dc_mlx5"},
    "mm": {"sysv", "posix"},
}


def tls_allowed(transports: list[str], tls: str | None) -> list[str]:
    """The transports of ``transports`` that ``UCX_TLS`` lets UCX use (``ucx_info -d`` lists
    every one, whatever UCX_TLS says): "a,b" allows those (aliases sm, cuda, ib, ...), "^a,b"
    all but those, unset or "all" every one."""
    if not tls or tls.strip() in ("all", "^"):
        return list(transports)
    neg = tls.startswith("^")
    names: set[str] = set()
    for t in tls.lstrip("^").split(","):
        t = t.strip().removesuffix(":aux")
        if t:
            names |= {t} | _TLS_ALIASES.get(t, set())
    if "all" in names:
        return list(transports)
    return [t for t in transports if (t in names) != neg]


def ucx_section(probe: bool) -> dict[str, Any]:
    from kvlink_transports import _ucx

    settings = _ucx.ucx_settings()
    offered = _ucx.ucx_transports(tls="")  # everything this UCX build can open here
    out: dict[str, Any] = {
        "settings": settings,
        "kvlink_adds": _ucx.kvlink_adds(),
        "ucx_info": _ucx.ucx_info_path(),
        "transports_built": offered,
        "transports_allowed": tls_allowed(offered, settings.get("UCX_TLS")),
        "predicted_rma_same_host": _ucx.rma_transports("intra"),
        "predicted_rma_other_host": _ucx.rma_transports("inter"),
        "net_devices": _net_devices(),
    }
    if probe:
        measured: dict[str, Any] = {}
        mems = ["DRAM"] + (["VRAM"] if _cuda_usable() else [])
        for mem in mems:
            pr = _ucx.nixl_probe(mem, 64 << 20 if mem == "VRAM" else 16 << 20, 3, timeout=90)
            v = _ucx.classify_lanes(pr.lanes, vram=mem == "VRAM", same_host=True,
                                    protocols=pr.protocols)
            measured[mem] = {**pr.as_dict(), "verdict": v.verdict, "why": v.reason}
        out["measured_same_host"] = measured
    return out


def _net_devices() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob("/sys/class/net/*"))


# ------------------------------------------------------------------ system


def system_section() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def lim(v: int) -> str | int:
        return "unlimited" if v == resource.RLIM_INFINITY else v

    shm: dict[str, Any] = {"present": os.path.isdir("/dev/shm")}
    if shm["present"]:
        st = os.statvfs("/dev/shm")
        shm |= {"size_bytes": st.f_frsize * st.f_blocks, "free_bytes": st.f_frsize * st.f_bavail}
    ptrace = _read("/proc/sys/kernel/yama/ptrace_scope")
    return {
        "memlock_soft": lim(soft),
        "memlock_hard": lim(hard),
        "dev_shm": shm,
        "ptrace_scope": int(ptrace) if ptrace and ptrace.isdigit() else None,
        "rdma": _rdma(),
        "gpu_nic_affinity": _affinity(),
        "nvidia_peermem": os.path.isdir("/sys/module/nvidia_peermem"),
        "dma_buf": _dmabuf(),
    }


def _rdma() -> list[dict[str, Any]]:
    out = []
    for dev in sorted(glob.glob("/sys/class/infiniband/*")):
        ports = []
        for port in sorted(glob.glob(f"{dev}/ports/*")):
            ports.append({
                "port": os.path.basename(port),
                "state": _read(f"{port}/state"),
                "rate": _read(f"{port}/rate"),
                "link_layer": _read(f"{port}/link_layer"),
            })
        node = _read(f"{dev}/device/numa_node")
        out.append({"device": os.path.basename(dev), "numa_node": node, "ports": ports,
                    "pci": os.path.basename(os.path.realpath(f"{dev}/device"))})
    return out


def _gpus_pci() -> list[dict[str, Any]]:
    out = []
    for d in sorted(glob.glob("/sys/bus/pci/devices/*")):
        if _read(f"{d}/vendor") == "0x10de" and (_read(f"{d}/class") or "").startswith("0x03"):
            out.append({"pci": os.path.basename(d), "numa_node": _read(f"{d}/numa_node")})
    return out


def _affinity() -> dict[str, Any]:
    gpus = _gpus_pci()
    nics = [{"device": r["device"], "numa_node": r["numa_node"]} for r in _rdma()]
    if not gpus or not nics:
        return {"gpus": gpus, "nics": nics, "note": "needs both a GPU and an RDMA NIC"}
    pairs = []
    for g in gpus:
        same = [n["device"] for n in nics if n["numa_node"] == g["numa_node"]]
        pairs.append({"gpu": g["pci"], "numa_node": g["numa_node"], "nics_same_numa": same})
    return {"gpus": gpus, "nics": nics, "pairs": pairs}


def _dmabuf() -> dict[str, Any]:
    ver = _read("/proc/driver/nvidia/version") or ""
    return {
        "nvidia_driver": ver.splitlines()[0] if ver else None,
        "open_kernel_module": "Open Kernel Module" in ver if ver else None,
        "kernel_dma_buf": os.path.isdir("/sys/kernel/dmabuf") or os.path.isdir(
            "/sys/kernel/debug/dma_buf"),
    }


def _cuda_usable() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def cuda_section() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "note": "torch not installed"}
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "note": f"torch {torch.__version__}: no CUDA device"}
    n = torch.cuda.device_count()
    out: dict[str, Any] = {"available": True,
                           "devices": [torch.cuda.get_device_name(i) for i in range(n)]}
    if n > 1:
        out["p2p_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    if shutil.which("nvidia-smi"):
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                  timeout=30, check=False)
            out["topology"] = topo.stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            out["topology"] = f"nvidia-smi failed: {exc}"
    return out


# ------------------------------------------------------------------ verdicts


def native_section() -> dict[str, Any]:
    """kvlink's C helpers (kvlink.native): built here, or why not, and where they are kept."""
    from kvlink import native

    built = native.load() is not None
    return {"built": built, "why_not": "" if built else native.why_not(),
            "cache": str(native.cache_dir())}


def _verdicts(rep: dict[str, Any]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {"tcp": {"verdict": "usable", "why": "kvlink's own, "
                                              "always there (host memory, any host)"}}
    reg = rep["transports_registered"]
    if rep["versions"]["nixl"] is None or "nixl" not in reg:
        out["nixl"] = {"verdict": "missing", "fix": PIP["nixl"]}
    else:
        meas = rep["ucx"].get("measured_same_host") or {}
        slow = [f"{m}: {v['why']}" for m, v in meas.items() if v.get("verdict") == "slow"]
        fail = [f"{m}: {v['error']}" for m, v in meas.items() if not v.get("ok")]
        if fail:
            out["nixl"] = {"verdict": "broken", "why": "; ".join(fail)}
        elif slow:
            out["nixl"] = {"verdict": "slow", "why": "; ".join(slow)}
        elif not meas:  # (installed is all that is known: usable is what a probe says)
            out["nixl"] = {"verdict": "installed", "why": "not measured (--no-probe)"}
        else:
            lanes = ", ".join(f"{m} {'/'.join(v.get('lanes', {}).get('read', []))}"
                              for m, v in meas.items())
            out["nixl"] = {"verdict": "usable", "why": f"same host over {lanes}"}
        if rep["ucx"]["predicted_rma_other_host"] and not any(
                "rc" in t or "dc" in t for t in rep["ucx"]["predicted_rma_other_host"]):
            out["nixl"]["between_hosts"] = "slow: tcp (no RDMA transport)"
    if rep["versions"]["mooncake"] is None or "mooncake" not in reg:
        out["mooncake"] = {"verdict": "missing", "fix": PIP["mooncake"]}
    elif not rep["system"]["rdma"]:
        out["mooncake"] = {"verdict": "slow", "why": "no RDMA NIC: protocol tcp only"}
    else:
        out["mooncake"] = {"verdict": "usable", "why": "RDMA NIC present (protocol rdma)"}
    if not rep["cuda"].get("available"):
        out["cuda_ipc"] = {"verdict": "missing", "why": rep["cuda"].get("note", "no CUDA")}
    else:
        out["cuda_ipc"] = {"verdict": "usable", "why": "same-host GPU pairs"}
    return out


def warnings_of(rep: dict[str, Any]) -> list[str]:
    """Every problem found, each with what to do about it."""
    out: list[str] = []
    sysr, ucx, cuda = rep["system"], rep["ucx"], rep["cuda"]
    settings = ucx.get("settings", {})
    if not sysr["rdma"]:
        out.append("no RDMA NIC: transfers between hosts run over TCP (expect ~1-3 GB/s)")
    for r in sysr["rdma"]:
        for p in r["ports"]:
            if p["state"] and "ACTIVE" not in p["state"]:
                out.append(f"RDMA {r['device']} port {p['port']} is {p['state']}: check the "
                           f"cable/switch (ibstat)")
    inter = ucx.get("predicted_rma_other_host") or []
    if inter and not any(t in _rdma_names() for t in inter):
        out.append(f"UCX would move inter-host RMA over {'/'.join(inter)} (no rc/dc/ud "
                   f"transport): install rdma-core and check UCX_TLS / UCX_NET_DEVICES")
    allowed = ucx.get("transports_allowed") or []
    if ucx.get("transports_built") and "tcp" not in allowed:
        out.append("UCX_TLS excludes tcp: NIXL's UCX backend cannot start (it needs tcp for "
                   "wire-up and notifications)")
    emu = settings.get("UCX_PROTO_EMULATION_ENABLE")
    if emu is not None and emu.lower() in ("n", "no", "0", "off"):
        out.append("UCX_PROTO_EMULATION_ENABLE=n: a READ that UCX can only emulate (over tcp) "
                   "fails with NIXL_ERR_REMOTE_DISCONNECT instead of running slowly")
    zc = settings.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    if cuda.get("available") and zc is not None and zc.lower() not in ("y", "yes", "1", "on"):
        out.append(f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={zc}: NIXL READs of GPU memory over cuda_ipc "
                   f"run at ~0.5 GB/s without NVLink; unset it (kvlink sets y) or set y")
    for mem, v in (ucx.get("measured_same_host") or {}).items():
        if not v.get("ok"):
            out.append(f"NIXL {mem} probe failed: {v.get('error')}")
        elif v.get("verdict") == "slow":
            out.append(f"NIXL {mem} between two processes here: {v.get('why')}")
    if cuda.get("available") and "VRAM" not in (ucx.get("measured_same_host") or {}):
        from kvlink_transports import _ucx

        if _ucx.gpu_staged(True) is True:  # the prediction, when the probe did not run
            out.append("UCX has no cuda_ipc here: VRAM transfers would be staged through host "
                       "memory by cuda_copy (check UCX_TLS)")
    ptrace = sysr.get("ptrace_scope")
    if ptrace is not None and ptrace >= 1:
        out.append(f"kernel.yama.ptrace_scope={ptrace}: UCX's cma (process_vm_readv) between "
                   f"unrelated processes is refused; same-host host-memory RMA falls back "
                   f"(sysctl -w kernel.yama.ptrace_scope=0)")
    soft = sysr["memlock_soft"]
    if sysr["rdma"] and soft != "unlimited" and int(soft) < (1 << 30):
        out.append(f"memlock ulimit {soft} bytes: RDMA registration of a KV cache needs "
                   f"more (ulimit -l unlimited)")
    shm = sysr["dev_shm"]
    if not shm["present"]:
        out.append("/dev/shm missing: UCX's posix/sysv shared memory transports cannot work")
    elif shm.get("free_bytes", 0) < (256 << 20):
        out.append(f"/dev/shm has {shm.get('free_bytes', 0) >> 20} MiB free: UCX's shared "
                   f"memory transports may fail (docker: --shm-size)")
    if cuda.get("available") and sysr["rdma"]:
        dma = sysr["dma_buf"]
        if not sysr["nvidia_peermem"] and not dma.get("open_kernel_module"):
            out.append("GPU + RDMA NIC but neither nvidia_peermem nor the open kernel module "
                       "(dma-buf): GPUDirect RDMA is off, GPU memory is staged through host")
        for p in sysr["gpu_nic_affinity"].get("pairs", []):
            if not p["nics_same_numa"]:
                out.append(f"GPU {p['gpu']} has no RDMA NIC on its NUMA node "
                           f"{p['numa_node']}: traffic crosses the socket interconnect")
    for name, v in rep["verdicts"].items():
        if v["verdict"] == "missing" and "fix" in v:
            out.append(f"{name} transport missing: {v['fix']}")
    if ucx.get("ucx_info") is None:
        out.append(f"ucx_info not found: predictions skipped ({PIP['ucx_tools']})")
    nat = rep.get("native") or {}
    if nat.get("built") is False:
        out.append(f"kvlink's C helpers not built ({nat.get('why_not')}): cuda_ipc READs launch "
                   "through ctypes and check the hold board in Python, tens of us more a "
                   "request (install a C compiler and Python's headers)")
    return out


def _rdma_names() -> frozenset[str]:
    from kvlink_transports import _ucx

    return _ucx.RDMA_TRANSPORTS


def collect(probe: bool = True) -> dict[str, Any]:
    def safe(fn: Any, *a: Any) -> Any:
        try:
            return fn(*a)
        except Exception as exc:  # one broken piece must not hide the rest of the report
            return {"error": f"{type(exc).__name__}: {exc}"}

    rep: dict[str, Any] = {
        "transports_registered": registered_transports(),
        "versions": safe(versions),
        "ucx": safe(ucx_section, probe),
        "cuda": safe(cuda_section),
        "system": safe(system_section),
        "native": safe(native_section),
    }
    rep["verdicts"] = safe(_verdicts, rep)
    rep["warnings"] = safe(warnings_of, rep)
    if isinstance(rep["warnings"], dict):
        rep["warnings"] = [f"doctor failed to check: {rep['warnings']['error']}"]
    return rep


# ------------------------------------------------------------------ text


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v) or "none"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items()) or "none"
    return str(v)


def _failed(section: Any) -> str | None:
    """Why a section of the report could not be collected (collect's ``{"error": ...}``)."""
    if isinstance(section, dict) and set(section) == {"error"}:
        return str(section["error"])
    return None


def render(rep: dict[str, Any]) -> str:
    """The report as text; a section that could not be collected says why in its place (one
    broken piece must not hide the rest: it raised here before, taking the whole report)."""
    lines: list[str] = []
    add = lines.append
    add("kvlink doctor: what carries the bytes here")
    for title, part in (("versions", _versions_text), ("UCX", _ucx_text),
                        ("transports", _verdicts_text), ("system", _system_text),
                        ("C helpers", _native_text), ("CUDA", _cuda_text)):
        add("")
        try:
            part(rep, add)
        except (KeyError, TypeError, AttributeError) as exc:
            add(f"{title}: could not be shown ({type(exc).__name__}: {exc})")
    add("")
    ws = rep["warnings"]
    add(f"warnings ({len(ws)})" if ws else "warnings: none")
    for w in ws:
        add(f"  ! {w}")
    return "\n".join(lines)


def _versions_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    add("versions")
    if (why := _failed(rep["versions"])) is not None:
        add(f"  could not be checked: {why}")
        return
    for k, v in rep["versions"].items():
        add(f"  {k:18s} {_fmt(v)}")


def _ucx_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    ucx = rep["ucx"]
    add("UCX settings (this process's environment)")
    if (why := _failed(ucx)) is not None:
        add(f"  could not be checked: {why}")
        return
    for k, v in ucx.get("settings", {}).items():
        add(f"  {k:32s} {v if v is not None else '(unset)'}")
    adds = ucx.get("kvlink_adds")
    add("  kvlink's nixl transport adds: "
        + (_fmt(adds) if adds else "nothing (already set)"))
    add("")
    add("UCX transports")
    add(f"  built here (ucx_info -d)   {_fmt(ucx.get('transports_built'))}")
    add(f"  allowed by UCX_TLS         {_fmt(ucx.get('transports_allowed'))}")
    add(f"  network devices            {_fmt(ucx.get('net_devices'))}")
    add(f"  predicted RMA, same host   {_fmt(ucx.get('predicted_rma_same_host'))}   "
        f"(libucx wheel's ucx_info: a prediction)")
    add(f"  predicted RMA, other host  {_fmt(ucx.get('predicted_rma_other_host'))}")
    meas = ucx.get("measured_same_host")
    if meas is None:
        add("  measured: skipped (--no-probe)")
    for mem, v in (meas or {}).items():
        add(f"  measured NIXL {mem} between two processes ({v['nbytes'] >> 20} MiB, NIXL's own "
            f"UCX, UCX_PROTO_INFO):")
        for op in ("read", "write"):
            lanes = "/".join(v["lanes"].get(op, [])) or "?"
            proto = "/".join(v["protocols"].get(op, [])) or "?"
            gbps = v["gbps"].get(op)
            add(f"    {op.upper():5s} {lanes:30s} {proto:20s} "
                f"{f'{gbps:.2f} GB/s' if gbps is not None else '-'}")
        add(f"    verdict: {v['verdict']} ({v['why']})" + (f"; error: {v['error']}"
                                                          if v.get("error") else ""))


def _verdicts_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    add("transports")
    if (why := _failed(rep["verdicts"])) is not None:
        add(f"  could not be judged: {why}")
        return
    for name, v in rep["verdicts"].items():
        rest = "; ".join(f"{k}: {x}" for k, x in v.items() if k != "verdict")
        add(f"  {name:10s} {v['verdict']:9s} {rest}")


def _system_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    add("system")
    s = rep["system"]
    if (why := _failed(s)) is not None:
        add(f"  could not be checked: {why}")
        return
    add(f"  memlock ulimit      soft {s['memlock_soft']}, hard {s['memlock_hard']}")
    shm = s["dev_shm"]
    add("  /dev/shm            " + (f"{shm['size_bytes'] >> 20} MiB, {shm['free_bytes'] >> 20} "
                                    f"MiB free" if shm["present"] else "missing"))
    add(f"  ptrace_scope (CMA)  {_fmt(s['ptrace_scope'])}")
    if not s["rdma"]:
        add("  RDMA NICs           none (/sys/class/infiniband empty)")
    for r in s["rdma"]:
        for p in r["ports"]:
            add(f"  RDMA {r['device']}:{p['port']}  {p['state']}, {p['rate']}, "
                f"{p['link_layer']}, NUMA {r['numa_node']}")
    aff = s["gpu_nic_affinity"]
    add(f"  GPU/NIC affinity    {_fmt(aff.get('pairs')) if aff.get('pairs') else aff.get('note')}")
    add(f"  nvidia_peermem      {_fmt(s['nvidia_peermem'])}")
    add(f"  dma-buf             {_fmt(s['dma_buf'])}")


def _native_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    nat = rep.get("native") or {}
    add("C helpers (kvlink.native) "
        + (f"built, kept in {nat.get('cache')}" if nat.get("built")
           else f"not built: {nat.get('why_not') or nat.get('error')}"))


def _cuda_text(rep: dict[str, Any], add: Callable[[str], None]) -> None:
    cuda = rep["cuda"]
    add("CUDA                  "
        + (_fmt(cuda.get("devices")) if cuda.get("available")
           else str(cuda.get("note") or cuda.get("error"))))
    if cuda.get("topology"):
        for ln in str(cuda["topology"]).splitlines():
            add("  " + ln)


def run(*, as_json: bool = False, strict: bool = False, probe: bool = True) -> int:
    """Print the report (text, or JSON with ``as_json``); 1 under ``strict`` when any warning
    was raised, else 0."""
    rep = collect(probe=probe)
    if as_json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(render(rep))
    return 1 if strict and rep["warnings"] else 0


def run_doctor(json_out: str | None = None, *, strict: bool = False, probe: bool = True) -> int:
    """What ``kvlink doctor --json PATH`` calls today: the text report on stdout, the JSON
    written to ``json_out``. Prefer :func:`run`."""
    rep = collect(probe=probe)
    print(render(rep))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rep, f, indent=2, default=str)
    return 1 if strict and rep["warnings"] else 0
