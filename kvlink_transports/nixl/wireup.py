"""UCX's wire-up with a new peer, completed inside ``connect`` under ``timeout_s``.

Why: UCX wires an endpoint up at its first operation, and when the peer was stopped (a hung
host, SIGSTOP) as NIXL's ``add_remote_agent`` dialled it, that first operation waits for good:
the deadline's teardown shuts the connections down, and UCX still does not fail the endpoint
(measured, nixl 1.5.1 with UCX tcp and with the default transports: a READ PENDING 8 s past
``timeout_s=2`` until the peer resumed, then its bytes landed). A peer that hangs once the
wire-up is done fails its transfers at ``timeout_s`` (tests/test_nixl_deadline.py). So
``connect`` reads a few bytes of the peer's registered memory into a scratch buffer of ours, and
a peer whose READ does not complete within ``timeout_s`` fails the handshake instead of
leaving the caller's first READ hanging. Every later transfer finds the endpoint wired up (the
first request no longer pays the wire-up either).

The scratch is never the caller's memory: a wire-up READ that hung may still land when its peer
resumes, so its destination stays registered, and alive, for as long as the process runs.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvlink.errors import HandshakeError
from kvlink_transports.nixl.agent import _nixl_reason
from kvlink_transports.nixl.memory import _MEM_NAMES, _mem_of
from kvlink_transports.nixl.records import _Peer, _Xfer
from kvlink_transports.nixl.transfers import _Transfers

log = logging.getLogger("kvlink.nixl")

_READ_BYTES = 64  # what the wire-up reads: any operation wires the whole endpoint up
_POLL = 0.0002  # seconds between the wire-up's checks (the lock is free meanwhile)

#: scratch buffers of transports gone by: a hung wire-up READ may land in one whenever its peer
#: resumes, so none is ever freed (64 bytes each, one per transport)
_KEEP: list[np.ndarray] = []


class _WireUp(_Transfers):
    """The wire-up READ, as methods of the transport."""

    _backends: list[str]  # NIXL backends (the wire-up is UCX's)
    _scratch: np.ndarray | None = None  # registered once, at the first wire-up

    def _wire_up(self, p: _Peer) -> None:
        """READ ``_READ_BYTES`` of ``p``'s first region into our scratch, and wait for it up to
        ``timeout_s``; lock NOT held (it is taken per check). A peer that does not answer is
        dropped (torn down, as by a transfer's deadline) and :class:`HandshakeError` raised.
        Peers without registered memory, or without UCX between us, are not checked."""
        if "UCX" not in self._backends or not p.side.table.regions:
            return
        region = p.side.table.regions[0]
        n = min(_READ_BYTES, region.nbytes)
        mem, dev = _mem_of(region.device)
        t0 = time.monotonic()
        with self._lock:
            if self._peers.get(p.key) is not p:
                return  # replaced or dropped meanwhile: that connect's own business
            scratch = self._scratch_buffer()
            x = _Xfer(p.key, p.agent, [], [], n, 1, time.perf_counter(), op="READ")
            err = self._post_one(
                x, "READ", p.agent, np.array([[scratch.ctypes.data, n, 0]], dtype=np.uint64),
                "DRAM", np.array([[region.addr, n, dev]], dtype=np.uint64), _MEM_NAMES[mem],
                None)
            x.failure = err
        deadline = t0 + self._timeout
        while True:
            with self._lock:
                pending = self._check_reqs(x)  # notes an error in x.failure
                if not pending and x.failure is None:
                    self._release_reqs(x)
                    log.debug("nixl peer %s: UCX wired up in %.2f ms", p.key,
                              (time.monotonic() - t0) * 1e3)
                    return
                if not pending or time.monotonic() >= deadline:
                    # a hung READ goes on into the scratch, never freed: forgetting it is safe,
                    # and the peer's agent can go at once
                    self._release_reqs(x)
                    if self._peers.get(p.key) is p:
                        self._drop_peer(p, "its UCX wire-up did not complete")
                    why = x.failure or (f"no answer within timeout_s={self._timeout:g}s (peer "
                                        "hung or unreachable)")
                    raise HandshakeError(
                        f"nixl peer {p.key!r} (agent {p.agent}): UCX's connection wire-up (a "
                        f"{n}-byte READ of its memory) did not complete: {why}; not connected")
            time.sleep(_POLL)

    def _scratch_buffer(self) -> np.ndarray:
        """Our wire-up READs' destination, registered with NIXL once (lock held); never
        deregistered, never freed (``_KEEP``)."""
        if self._scratch is None:
            buf = np.zeros(_READ_BYTES, dtype=np.uint8)
            try:
                self._agent.register_memory(
                    np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
            except Exception as exc:
                raise HandshakeError(
                    f"nixl could not register its wire-up buffer: {_nixl_reason(exc)}") from exc
            _KEEP.append(buf)
            self._scratch = buf
        return self._scratch
