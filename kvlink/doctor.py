"""`kvlink doctor`: what this machine can do, and the silent slowdowns it would suffer.

Every line is read off the machine (sysfs, the libraries' own probes); nothing is assumed. What
cannot be checked says why.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
from typing import Any

from kvlink.transport import registered_transports


def _rdma() -> dict[str, Any]:
    devs = sorted(os.path.basename(p) for p in glob.glob("/sys/class/infiniband/*"))
    return {
        "devices": devs,
        "ib_write_bw": shutil.which("ib_write_bw"),
        "nvidia_peermem": os.path.isdir("/sys/module/nvidia_peermem"),
        "note": "" if devs else "no RDMA device: ib_write_bw/ib_read_bw baselines cannot run",
    }


def _cuda() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "note": "torch not installed"}
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "note": f"torch {torch.__version__}: no CUDA device"}
    out: dict[str, Any] = {"available": True, "devices": [
        torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if torch.cuda.device_count() > 1:
        out["p2p_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    if shutil.which("nvidia-smi"):
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=30)
        out["topology"] = topo.stdout.strip()
    return out


def _ucx() -> dict[str, Any]:
    try:
        from kvlink_transports import _ucx
    except ImportError as exc:
        return {"available": False, "note": str(exc)}
    try:
        return dict(_ucx.report())
    except Exception as exc:  # a broken UCX install must not hide the rest of the report
        return {"available": False, "note": f"{type(exc).__name__}: {exc}"}


def _module(name: str) -> dict[str, Any]:
    spec = importlib.util.find_spec(name.split(".")[0])
    if spec is None:
        return {"installed": False}
    try:
        mod = importlib.import_module(name)
    except Exception as exc:
        return {"installed": True, "importable": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"installed": True, "importable": True,
            "version": getattr(mod, "__version__", "?")}


def collect() -> dict[str, Any]:
    return {
        "transports_registered": registered_transports(),
        "rdma": _rdma(),
        "cuda": _cuda(),
        "ucx": _ucx(),
        "nixl": _module("nixl._api"),
        "mooncake": _module("mooncake.engine"),
    }


def warnings_of(rep: dict[str, Any]) -> list[str]:
    out = []
    if not rep["rdma"]["devices"]:
        out.append("no RDMA NIC: transfers between hosts run over TCP (expect ~1-3 GB/s)")
    ucx = rep["ucx"]
    if ucx.get("tcp_between_hosts"):
        out.append("UCX would move inter-host RMA over tcp (no rc/dc/ud transport found)")
    if rep["cuda"].get("available") and ucx.get("gpu_staged"):
        out.append("UCX stages GPU memory through cuda_copy: VRAM transfers go via host memory")
    return out


def run_doctor(json_out: str | None = None) -> int:
    rep = collect()
    rep["warnings"] = warnings_of(rep)
    for key, value in rep.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                text = v if not isinstance(v, (dict, list)) else json.dumps(v)
                print(f"  {k}: {text}")
        else:
            print(f"{key}: {value}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rep, f, indent=2, default=str)
    return 0
