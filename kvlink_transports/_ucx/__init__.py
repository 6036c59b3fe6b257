"""UCX probes: which binaries exist, which transports UCX offers, and which it would pick.

Used by the ``nixl`` transport (to warn when KV would cross hosts over TCP or GPU memory would be
staged through host copies, and to tear down a hung peer) and by ``kvlink doctor``. Nothing
here loads UCX into this process: the probes shell out to the ``ucx_info`` / ``ucx_perftest``
binaries (from a system UCX or from the ``libucx-cu12`` wheel) or to throw-away NIXL agents in
child processes, and return an empty answer, never raise, when those are missing.

By job: ``info`` (what UCX's tools predict), ``env`` (the settings kvlink applies), ``measure``
(what a real NIXL transfer used, and the verdict on it), ``connections`` (this process's UCX
TCP connections, from /proc). This face hands all of their public names on;
``python -m kvlink_transports._ucx`` prints a report.
"""

from kvlink_transports._ucx.connections import (
    TcpEnd,
    TcpSocket,
    new_ucx_connections,
    shutdown_connections,
    tcp_sockets,
)
from kvlink_transports._ucx.env import (
    KVLINK_UCX_DEFAULTS,
    UCX_SETTINGS,
    apply_kvlink_env,
    apply_safe_env,
    cuda_driver_present,
    kvlink_adds,
    rdma_devices,
    ucx_settings,
)
from kvlink_transports._ucx.info import (
    GPU_DIRECT_TRANSPORTS,
    RDMA_TRANSPORTS,
    PerftestResult,
    UcxLane,
    gpu_staged,
    report,
    rma_transports,
    run_perftest,
    tcp_fallback_between_hosts,
    ucx_env,
    ucx_info_path,
    ucx_lanes,
    ucx_perftest_path,
    ucx_transports,
)
from kvlink_transports._ucx.measure import (
    SHM_TRANSPORTS,
    LaneVerdict,
    NixlProbe,
    classify_lanes,
    lane_transports,
    nixl_probe,
    nixl_protocols,
    parse_proto_info,
    parse_proto_rows,
    rows_for,
)

__all__ = [
    "GPU_DIRECT_TRANSPORTS", "KVLINK_UCX_DEFAULTS", "RDMA_TRANSPORTS", "SHM_TRANSPORTS",
    "UCX_SETTINGS", "LaneVerdict", "NixlProbe", "PerftestResult", "TcpEnd", "TcpSocket", "UcxLane",
    "apply_kvlink_env", "apply_safe_env", "classify_lanes", "cuda_driver_present", "gpu_staged",
    "kvlink_adds", "lane_transports", "new_ucx_connections", "nixl_probe", "nixl_protocols",
    "parse_proto_info", "parse_proto_rows", "rdma_devices", "report", "rma_transports", "rows_for",
    "run_perftest", "shutdown_connections", "tcp_fallback_between_hosts", "tcp_sockets", "ucx_env",
    "ucx_info_path", "ucx_lanes", "ucx_perftest_path", "ucx_settings", "ucx_transports",
]
