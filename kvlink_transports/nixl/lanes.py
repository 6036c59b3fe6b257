"""Which UCX lanes carry a nixl peer's bytes, and what is done when they are slow.

Per new peer (option ``ucx_probe``, default True) a background thread predicts UCX's
transport with ``ucx_info`` and warns on TCP between hosts or GPU memory staged through host
buffers (cuda_copy); for a GPU pair it also gets a verdict on the path (same host: measured
once per process and UCX settings by a NIXL VRAM READ+WRITE between two probe processes; other
hosts: predicted), and a GPU pair on a slow path (tcp, cuda_copy, UCX's emulation) has its
posts FAILED unless ``allow_slow_gpu``. ``ucx_info`` takes 0.5 s on an idle machine and tens
of seconds on a loaded one, so this is never on a handshake's path
(:meth:`_LaneChecks.wait_probes` waits for it). Separate from the transport because it is
diagnosis, not transfer: it only reads the peer table, and writes one field of it
(``_Peer.blocked``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
from typing import Any

from kvlink.transport import Region
from kvlink_transports import _ucx
from kvlink_transports.nixl.agent import _warn_once
from kvlink_transports.nixl.memory import _mem_of
from kvlink_transports.nixl.records import _Peer

log = logging.getLogger("kvlink.nixl")

#: verdicts on the UCX path of GPU pairs, per (same host, UCX settings): measured once per
#: process (same host: a NIXL VRAM READ+WRITE between two probe processes), else predicted
_gpu_verdicts: dict[tuple[Any, ...], _ucx.LaneVerdict] = {}


class _LaneChecks:
    """The UCX path checks, as methods of the transport."""

    _lock: threading.RLock
    _closed: bool
    _backends: list[str]
    _ucx_probe: bool  # option ucx_probe
    _allow_slow_gpu: bool  # option allow_slow_gpu
    _regions: list[Region]
    _peers: dict[str, _Peer]
    _probe_pool: cf.ThreadPoolExecutor | None  # ucx_info, off the handshake path
    _probes: list[cf.Future[None]]

    def _check_ucx_path(self, peer: str, same_host: bool, vram: bool) -> None:
        """Start the UCX path check of a new peer on the probe thread (see ``ucx_probe``)."""
        if not self._ucx_probe or "UCX" not in self._backends or self._closed:
            return
        if self._probe_pool is None:
            self._probe_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvlink-ucx-probe")
        self._probes = [f for f in self._probes if not f.done()]
        self._probes.append(self._probe_pool.submit(self._probe_ucx_path, peer, same_host, vram))

    def wait_probes(self, timeout: float) -> bool:
        """Wait for the UCX path checks started so far; True if all finished in time."""
        _done, pending = cf.wait(list(self._probes), timeout)
        return not pending

    def _judge_known(self, p: _Peer, same_host: bool, vram: bool) -> None:
        """At connect (lock held): a verdict this process already has on such a pair applies
        to ``p`` at once."""
        if (bad := _gpu_verdicts.get(self._gpu_key(same_host))) is not None:
            self._judge_gpu_path(p, bad, vram)

    def _stop_probes(self) -> None:
        """At close: checks not started yet never start; a running one finishes alone."""
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _gpu_key(same_host: bool) -> tuple[Any, ...]:
        return (same_host, tuple(sorted((k, v or "") for k, v in _ucx.ucx_settings().items())))

    def _gpu_device(self) -> int:
        for r in self._regions:
            mem, dev = _mem_of(r.device)
            if mem == 1:
                return int(dev)
        return 0

    def _gpu_verdict(self, same_host: bool) -> _ucx.LaneVerdict:
        """What carries a GPU pair's bytes (cached per process and UCX settings)."""
        key = self._gpu_key(same_host)
        v = _gpu_verdicts.get(key)
        if v is not None:
            return v
        if same_host:
            pr = _ucx.nixl_probe("VRAM", 64 << 20, 2, timeout=120, device=self._gpu_device())
            v = _ucx.classify_lanes(pr.lanes, vram=True, same_host=True,
                                    protocols=pr.protocols)
            if not pr.ok and v.verdict == "unknown":
                v = _ucx.LaneVerdict("unknown", f"the NIXL VRAM probe failed: {pr.error}")
            log.info("nixl: measured NIXL VRAM path on this host: lanes %s, GB/s %s -> %s",
                     pr.lanes, {k: round(g, 1) for k, g in pr.gbps.items()}, v.verdict)
        else:
            rma = _ucx.rma_transports("inter")
            lanes = {"read": [f"{t}/" for t in rma], "write": [f"{t}/" for t in rma]}
            v = _ucx.classify_lanes(lanes, vram=True, same_host=False)
            if rma:
                v = dataclasses.replace(v, reason=f"{v.reason} (predicted by ucx_info)")
        _gpu_verdicts[key] = v
        return v

    def _judge_gpu_path(self, p: _Peer, v: _ucx.LaneVerdict, vram: bool) -> None:
        """A GPU pair on tcp / cuda_copy / emulation: its posts fail unless allow_slow_gpu
        (lock held)."""
        if not vram or v.verdict != "slow":
            return
        why = (f"nixl peer {p.key!r}: GPU memory would move over a slow UCX path: {v.reason}. "
               f"Fix: UCX_TLS must allow cuda_ipc (same host) or rc/dc with GPUDirect RDMA "
               f"(other hosts), UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, the CUDA device set before "
               f"connect; see `kvlink doctor`. To accept it, set nixl option "
               f"allow_slow_gpu=True")
        if self._allow_slow_gpu:
            _warn_once(f"slowgpu-{v.reason}", "%s (allowed: allow_slow_gpu)", why)
            return
        if p.blocked is None:
            log.error("!!! %s; its transfers fail until then", why)
        p.blocked = why

    def _probe_ucx_path(self, peer: str, same_host: bool, vram: bool) -> None:
        placement = "intra" if same_host else "inter"
        rma = _ucx.rma_transports(placement)
        log.info(
            "nixl peer %s: %s host, UCX RMA predicted over %s",
            peer,
            "same" if same_host else "other",
            ",".join(rma) or "unknown (no ucx_info)",
        )
        if not same_host and _ucx.tcp_fallback_between_hosts() is True:
            _warn_once(
                "tcp",
                "NIXL/UCX moves KV between hosts over TCP (peer %s; UCX RMA lanes: %s; "
                "transports here: %s). Expect ~1 GB/s instead of the NIC's line rate: install "
                "RDMA drivers (rdma-core) and check UCX_TLS.",
                peer,
                ",".join(rma),
                ",".join(_ucx.ucx_transports()),
            )
        if vram:
            v = self._gpu_verdict(same_host)
            with self._lock:
                p = self._peers.get(peer)
                if p is not None:
                    self._judge_gpu_path(p, v, True)
            if v.verdict != "unknown":
                return
        if vram and _ucx.gpu_staged(same_host) is True:
            _warn_once(
                "cuda_copy",
                "NIXL/UCX stages GPU memory for peer %s through host buffers (cuda_copy): no "
                "%s among UCX transports %s. Set the CUDA device before connect and check "
                "UCX_TLS includes cuda_ipc / rc.",
                peer,
                "cuda_ipc" if same_host else "GPUDirect RDMA transport",
                ",".join(_ucx.ucx_transports()),
            )
