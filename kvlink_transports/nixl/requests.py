"""How a nixl transfer's NIXL requests end: failure, deadlines, teardown, draining, zombies.

Contract (``kvlink/transport.py``): a handle reports FAILED only once none of its NIXL requests
can move a byte any more. NIXL 1.5.1 cannot stop a UCX request in flight: releasing it returns
success while UCX's READ goes on (``ucp_request_cancel`` does nothing to RMA), and removing the
remote agent makes NIXL answer NOT_FOUND for it without asking UCX, which still completes it
(measured: 4-64 MiB landed in a FAILED READ's destination after the peer resumed; docs/nixl.md
"Deadlines"). So a failed handle keeps asking NIXL about each request until UCX has ended it,
and what ends a request that hangs is UCX failing its endpoint: when a transfer outlives
``timeout_s``, when its peer is disconnected or replaced, and at close, the transport shuts
down the TCP connections its UCX opened to that peer (found at
:meth:`~kvlink_transports.nixl.transport.NixlTransport.connect`, ``_ucx.new_ucx_connections``);
UCX then fails the endpoint at its next progress, which aborts every request on it, and NIXL
reports them ERR (NIXL_ERR_REMOTE_DISCONNECT) and drops the peer's metadata itself. kvlink
removes a remote agent only once none of its requests is in flight (until then the peer is
"draining"), so a NOT_FOUND answer always comes after such an endpoint failure.
:meth:`~kvlink_transports.nixl.transport.NixlTransport.post` gives a FAILED handle, never an
exception, for an unknown peer or a closed transport.

Separate from posting because this is the contract's hard half, and one piece: a transfer
turns FAILED only once quiescent (:meth:`_Requests._fail`), a peer is dropped only by tearing
down what its requests run on (:meth:`_Requests._drop_peer`), and its agent is removed only
once drained (:meth:`_Requests._settle_draining`). The state it works on is the transport's
(``NixlTransport.__init__`` sets it); every method here runs with ``_lock`` held.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvlink.transport import Transport, XferState, XferStatus
from kvlink_transports import _ucx
from kvlink_transports.nixl.agent import _nixl_reason
from kvlink_transports.nixl.records import _Peer, _Xfer

log = logging.getLogger("kvlink.nixl")


class _Requests(Transport):
    """The end of NIXL requests, as methods of the transport (lock held)."""

    _agent: Any  # the NIXL agent
    _lock: threading.RLock
    _timeout: float  # timeout_s
    _peers: dict[str, _Peer]
    _by_agent: dict[str, str]  # NIXL agent name -> peer
    # agents dropped (disconnect, reconnect, deadline, close) while requests to them were in
    # flight: NIXL keeps them loaded until those requests are over (see the module doc)
    _draining: dict[str, _Peer]
    _xfers: dict[int, _Xfer]
    _zombies: list[Any]  # NIXL requests whose release failed; retried later
    _abandoned: list[int]  # handles released in flight, kept in _xfers until UCX ends them
    #: the owner's calls that progress UCX (a transfer started or asked about), counted so
    #: the progress thread stays out of the way of an owner that polls (kvlink_transports.
    #: nixl.progress)
    _owner_calls: int

    def _drop_peer(self, p: _Peer, reason: str) -> None:
        """Forget the peer (lock held); its transfers turn FAILED, each once quiescent (rule 1).

        With requests to it still in flight, its UCX connections are torn down (UCX then fails
        the endpoint, which ends them) and its NIXL agent stays loaded, "draining", until they
        are over: removing it first would make NIXL stop asking UCX about them. Without any, the
        agent is removed now."""
        self._peers.pop(p.key, None)
        if self._by_agent.get(p.agent) == p.key:
            del self._by_agent[p.agent]
        if p.prep is not None:  # requests made from it hold their own copy of the descriptors
            p.prep.release()
            p.prep = None
        live = []
        for x in self._xfers.values():
            if x.peer != p.key or x.agent != p.agent:
                continue
            if x.state.status is XferStatus.PENDING:
                live.append(x)
            else:
                self._release_reqs(x)
        in_flight = sum(self._check_reqs(x) for x in live)
        if in_flight:
            self._draining[p.agent] = p
            self._teardown(p, in_flight)
        for x in live:
            self._fail(x, f"{reason} (peer {p.key!r}, agent {p.agent})")
        if not in_flight:
            self._remove_remote(p.agent)

    def _teardown(self, p: _Peer, in_flight: int) -> int:
        """Shut down the TCP connections our UCX opened to ``p`` (lock held): UCX then fails
        the endpoint at its next progress, which ends every request on it (NIXL reports them
        NIXL_ERR_REMOTE_DISCONNECT). Returns how many were shut down."""
        first = not p.torn
        p.torn = True
        shut = _ucx.shutdown_connections(p.ucx) if p.ucx else 0
        if shut and first:
            log.warning(
                "nixl: tearing down peer %r (agent %s): shut down %d UCX TCP connection(s) to "
                "%s; its %d transfer(s) in flight end when UCX fails the endpoint",
                p.key, p.agent, shut, sorted(p.ucx), in_flight,
            )
        elif not shut and first:
            log.warning(
                "nixl: cannot tear down peer %r (agent %s): no TCP connection of this process "
                "goes to its UCX interfaces (%s); its %d transfer(s) in flight stay PENDING until "
                "UCX ends them (docs/nixl.md 'Deadlines')",
                p.key, p.agent, sorted(p.ucx) or "none seen at connect", in_flight,
            )
        return shut

    def _settle_draining(self) -> None:
        """Remove the NIXL agents of dropped peers none of whose requests is in flight any more
        (lock held)."""
        for agent in list(self._draining):
            if any(
                x.agent == agent and x.state.status is XferStatus.PENDING
                for x in self._xfers.values()
            ):
                continue
            del self._draining[agent]
            if agent not in self._by_agent:
                self._remove_remote(agent)

    def _await_drained(self, agent: str, timeout: float) -> bool:
        """Progress the requests of a draining agent until none is in flight (True) or
        ``timeout`` seconds pass (False). Lock held."""
        end = time.monotonic() + timeout
        while True:
            for x in list(self._xfers.values()):
                if x.agent == agent and x.state.status is XferStatus.PENDING:
                    self._fail(x, f"peer dropped (agent {agent})")
            self._settle_draining()
            if agent not in self._draining:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def _remove_remote(self, agent: str) -> None:
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:  # NIXL already dropped it (e.g. after a remote disconnect)
            log.debug("nixl remove_remote_agent(%s): %s", agent, _nixl_reason(exc))

    def _fail(self, x: _Xfer, reason: str) -> None:
        """Fail ``x`` (lock held): FAILED with the first error once none of its requests is in
        flight; until then it stays PENDING and poll keeps asking NIXL about them. (Releasing
        one would not stop it, only hide it: see the module doc.)"""
        if x.state.status is not XferStatus.PENDING:
            return
        if x.failure is None:
            x.failure = reason
            log.warning("%s", reason)
        if not self._check_reqs(x):
            self._failed(x)

    def _failed(self, x: _Xfer) -> None:
        """``x`` has a failure and nothing in flight (lock held): report it FAILED."""
        if x.state.status is not XferStatus.PENDING:
            return
        x.state = XferState(XferStatus.FAILED, x.failure or "nixl transfer failed")
        self._account(failed=1)
        if x.agent in self._draining:
            self._settle_draining()

    def _check_reqs(self, x: _Xfer) -> bool:
        """Ask NIXL about each request of ``x`` not known to be over (lock held); a request
        that is no longer PROC is over (DONE, or ended by an error). Records the first error in
        ``x.failure``. True while one is still in flight."""
        pending = False
        self._owner_calls += 1
        for i, req in enumerate(x.reqs):
            if x.done[i] or req is None:
                continue
            try:
                s = self._agent.check_xfer_state(req)
            except Exception as exc:
                s, err = "ERR", _nixl_reason(exc)
            else:
                err = "NIXL returned ERR"
            if s == "PROC":
                pending = True
                continue
            x.done[i] = True
            if s != "DONE" and x.failure is None:  # the others may still be moving bytes
                x.failure = f"nixl transfer with {x.peer!r} (agent {x.agent}) failed: {err}"
        return pending

    def _expire(self, x: _Xfer) -> None:
        """``x`` outlived its deadline with requests in flight (lock held): fail it, and tear
        down its peer so that UCX ends them (every transfer of that peer fails with it)."""
        x.expired = True
        why = (
            f"nixl {x.op or 'transfer'} {'from' if x.op == 'READ' else 'to'} peer {x.peer!r} "
            f"(agent {x.agent}) did not complete within timeout_s={self._timeout:g}s (peer hung "
            f"or unreachable)"
        )
        if x.failure is None:
            x.failure = why
            log.warning("%s", why)
        p = self._peers.get(x.peer)
        if p is not None and p.agent == x.agent:
            self._drop_peer(
                p, f"torn down: a transfer to it outlived timeout_s={self._timeout:g}s"
            )
        elif (d := self._draining.get(x.agent)) is not None:
            self._teardown(d, 1)  # dropped already; UCX may have dialled it again since

    def _send_notif(self, x: _Xfer, agent: str, msg: bytes) -> bool:
        try:
            self._agent.send_notif(agent, msg)
        except Exception as exc:
            self._fail(x, f"nixl notification to {x.peer!r} failed: {_nixl_reason(exc)}")
            return False
        return True

    def _abandon(self, handle: int, x: _Xfer) -> bool:
        """The caller released ``x`` (lock held): True where it is kept, a request of it being
        still in flight. Why: releasing a NIXL request does not stop UCX's READ or WRITE (the
        module doc), and one forgotten is invisible to what does stop it: a disconnect saw no
        transfer in flight and removed the peer's agent without a teardown (a 4 MiB READ from
        a stopped peer, released, landed whole once the peer resumed), and close deregistered
        the memory under it. So it stays in ``_xfers`` under its handle, which no call answers
        any more, until UCX ends it (:meth:`_reap_abandoned`): a disconnect, a replaced peer or
        close tear its peer down as for any transfer in flight, and its deadline still holds."""
        if x.state.status is not XferStatus.PENDING or not self._check_reqs(x):
            return False
        x.abandoned = True
        self._xfers[handle] = x
        self._abandoned.append(handle)
        log.debug("nixl %s with %r (agent %s) released in flight: kept until UCX ends it",
                  x.op or "transfer", x.peer, x.agent)
        return True

    def _reap_abandoned(self) -> None:
        """Forget the transfers released in flight that UCX has ended, and tear down the peer
        of one past its deadline (lock held; :meth:`_abandon`)."""
        keep: list[int] = []
        now = time.monotonic()
        for handle in self._abandoned:
            x = self._xfers[handle]
            if x.state.status is XferStatus.PENDING and self._check_reqs(x):
                if not x.expired and now >= x.deadline:
                    self._expire(x)
                keep.append(handle)
                continue
            del self._xfers[handle]
            self._release_reqs(x)
        self._abandoned = keep
        if self._draining:
            self._settle_draining()

    def _release_reqs(self, x: _Xfer) -> None:
        for req in x.reqs:
            if req is None:
                continue
            try:
                req.release()
            except Exception as exc:
                log.debug("nixl release_xfer_handle deferred: %s", _nixl_reason(exc))
                self._zombies.append(req)
        x.reqs = []
        x.done = []

    def _reap_zombies(self) -> None:
        keep = []
        for req in self._zombies:
            try:
                req.release()
            except Exception:
                keep.append(req)
        self._zombies = keep

    def _handle_counts(self) -> dict[str, int]:
        """Sizes of the internal tables (tests check they drain)."""
        with self._lock:
            return {
                "xfers": len(self._xfers),
                "nixl_requests": sum(
                    sum(r is not None for r in x.reqs) for x in self._xfers.values()
                ),
                "zombies": len(self._zombies),
                "peers": len(self._peers),
            }
