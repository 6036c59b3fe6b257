"""The NIXL library and its agent: importing NIXL, quieting its logs, starting one agent.

Separate from the transport because this is the part that talks to NIXL as a library (its
import, its loggers, its agent config and backends, the UCX settings that must be in the
environment before the agent's UCX context exists), not to peers; every other module of the
package gets the agent from here, already started.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kvlink.errors import TransportUnavailable
from kvlink_transports import _ucx

log = logging.getLogger("kvlink.nixl")

PIP_HINT = "pip install 'kvlink[nixl]'  (or: pip install nixl)"

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, msg: str, *args: object) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("!!! " + msg, *args)


def quiet_third_party_logs(verbose: int = 0) -> None:
    """NIXL's and Mooncake's own logs: warnings only by default (NIXL's Python logger prints
    every agent and backend creation at INFO on stdout), their INFO with ``verbose`` >= 1 and
    DEBUG with >= 2. A value the user set in NIXL_LOG_LEVEL / MC_LOG_LEVEL is kept. Call it
    before the first transport is made (``kvlink -v``); the transports call it with 0 when
    kvlink's own loggers are quieter than INFO."""
    nixl_level, mc_level = ("WARN", "WARNING") if verbose <= 0 else (
        ("INFO", "INFO") if verbose == 1 else ("DEBUG", "INFO"))
    os.environ.setdefault("NIXL_LOG_LEVEL", nixl_level)
    os.environ.setdefault("MC_LOG_LEVEL", mc_level)
    py = {"WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG}
    lvl = py.get(os.environ["NIXL_LOG_LEVEL"].upper(), logging.WARNING)
    logging.getLogger("nixl").setLevel(lvl)


_ucx_env_logged = False


def _import_nixl() -> Any:
    if not logging.getLogger("kvlink").isEnabledFor(logging.INFO):
        quiet_third_party_logs(0)
    try:
        from nixl import _api
    except ImportError as exc:
        raise TransportUnavailable(
            f"the nixl transport needs the NIXL Python package ({exc}); install it with "
            f"`{PIP_HINT}`"
        ) from exc
    if "NIXL_LOG_LEVEL" in os.environ:  # NIXL's dictConfig at import reset its logger's level
        quiet_third_party_logs(0)
    return _api


def _nixl_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def start_agent(
    api: Any, name: str, backends: list[str], *, progress_thread: bool, telemetry: bool,
    num_threads: int, error_handling: str | None,
) -> tuple[Any, dict[str, str]]:
    """Start NIXL agent ``name`` with those of ``backends`` NIXL has a plugin for, once
    kvlink's UCX settings are in the environment (:mod:`kvlink_transports._ucx`). Returns the
    agent and the UCX settings this call added to the environment (the user's own are kept);
    raises TransportUnavailable when the agent or one of ``backends`` cannot start."""
    cfg = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        capture_telemetry=telemetry,
        num_threads=num_threads,
        backends=[],  # made below, with their init parameters
    )
    ucx_env: dict[str, str] = {}
    if "UCX" in backends:
        if _ucx.apply_safe_env():
            log.info("nixl: no RDMA devices here, set UCX_MODULES=^ib (avoids a crash at "
                     "exit)")
        ucx_env = _ucx.apply_kvlink_env()
        global _ucx_env_logged
        if ucx_env or not _ucx_env_logged:
            _ucx_env_logged = True
            log.info(
                "nixl: UCX settings %s (%s)",
                {k: os.environ.get(k) for k in _ucx.KVLINK_UCX_DEFAULTS},
                f"set by kvlink: {sorted(ucx_env)}" if ucx_env
                else "kept as found",
            )
    try:
        agent = api.nixl_agent(name, cfg)
        plugins = set(agent.get_plugin_list())
        for b in backends:
            if b not in plugins:
                continue
            init: dict[str, str] = {}
            if num_threads > 0 and b in ("UCX", "OBJ", "LIBFABRIC"):
                init["num_threads"] = str(num_threads)
            if b == "UCX" and error_handling is not None:
                init["ucx_error_handling_mode"] = str(error_handling)
            agent.create_backend(b, init)
    except Exception as exc:
        raise TransportUnavailable(
            f"nixl agent {name!r} with backends {backends} failed to start: "
            f"{_nixl_reason(exc)} (UCX needs tcp in UCX_TLS for its wire-up, see docs/nixl.md)"
        ) from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise TransportUnavailable(
            f"nixl backends {missing} are not available here; plugins found: "
            f"{sorted(agent.get_plugin_list())}"
        )
    return agent, ucx_env
