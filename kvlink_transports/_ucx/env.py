"""The UCX settings kvlink puts in the environment before a NIXL agent exists, and reports.

Separate because these change this process (``os.environ``, read once by UCX when its context
is made): :func:`apply_safe_env` (``UCX_MODULES=^ib`` on hosts without RDMA devices, against a
crash at exit) and :func:`apply_kvlink_env` (:data:`KVLINK_UCX_DEFAULTS`); everything else in
the package only reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


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


#: UCX settings kvlink applies to the NIXL agents it creates, unless already set. Why:
#: - ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``: UCX's cuda_ipc turns GET zero-copy off when NVML reports
#:   no active NVLink (its default "auto"), and NIXL's READ of VRAM then ran at ~0.5 GB/s
#:   instead of 330-500 GB/s on one H200 (issue 22). Set only where an NVIDIA driver is
#:   loaded (elsewhere UCX warns of an unused variable at each init).
#: - ``UCX_KEEPALIVE_INTERVAL``: off. With it on, an endpoint whose peer died holding a
#:   keepalive queued asserts as it is destroyed (UCX 1.x, ``arbiter.c:36 Assertion
#:   `ucs_arbiter_group_is_empty(group)' failed``) and aborts the whole process: a decode
#:   whose prefill died after their connection was up took SIGABRT closing its transport (3 to
#:   6 processes in 10 here, nixl 1.5.1: tests/test_nixl_transport.py). What keepalive would
#:   find, kvlink finds itself: a killed peer's reset connection still fails its transfers
#:   at once, a hung one's at ``timeout_s``, and the side channel says who is gone.
KVLINK_UCX_DEFAULTS: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
                                       "UCX_KEEPALIVE_INTERVAL": "inf"}
#: of them, the ones UCX reads only where its CUDA transports load
_CUDA_ONLY = frozenset({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY"})

#: settings the doctor shows and checks
UCX_SETTINGS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
                "UCX_KEEPALIVE_INTERVAL",
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
    cuda = cuda_driver_present()  # (else UCX would warn "unused environment variable")
    for k, v in KVLINK_UCX_DEFAULTS.items():
        if k not in target and (cuda or k not in _CUDA_ONLY):
            target[k] = v
            done[k] = v
    return done


def kvlink_adds(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What :func:`apply_kvlink_env` would set here (the doctor's report), changing nothing."""
    return apply_kvlink_env(dict(os.environ if env is None else env))


def ucx_settings(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The UCX settings that decide what carries the bytes, as this process has them."""
    src = os.environ if env is None else env
    return {k: src.get(k) for k in UCX_SETTINGS}
