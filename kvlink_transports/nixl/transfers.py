"""Posting a nixl transfer and polling it: extents to NIXL requests, states, timing, telemetry.

Each :meth:`_Transfers.post` turns the extent arrays into Nx3 ``(addr, len, devId)`` numpy
arrays (no Python loop over extents), prepares a local and a remote descriptor list with
``prep_xfer_dlist``, makes ONE transfer of all descriptors with ``make_prepped_xfer`` (NIXL merges
back-to-back descriptors there, so a run of adjacent blocks costs one UCX operation) and releases
the two lists right away (the request keeps its own copy). ``options["post_mode"] = "direct"``
uses ``initialize_xfer`` instead, which does not merge; measured on CPU DRAM it is several times
slower for many small descriptors (see docs/nixl.md). The notification rides on the transfer
(NIXL sends it after the last byte); a transfer whose extents mix DRAM and VRAM is split into one
NIXL request per memory pair and the notification is sent once all of them are done.

Separate from how requests end (:mod:`kvlink_transports.nixl.requests`, which this builds on)
because this is the fast path, measured per call (``xfer_timing``): what it costs is the index
arithmetic of :mod:`kvlink_transports.nixl.memory` and NIXL's own calls, nothing else.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlink.errors import TransferError
from kvlink.staging import StreamMarks, mark_post
from kvlink.transport import (
    DONE,
    Extents,
    Op,
    PerBases,
    Runs,
    XferState,
    XferStatus,
    check_pairs,
)
from kvlink_transports.nixl.agent import _nixl_reason, _warn_once
from kvlink_transports.nixl.memory import (
    _MEM_NAMES,
    _dlist,
    _memory_pairs,
    _pair_indices,
    _Prep,
    _run_indices,
    _segment_firsts,
    _Side,
)
from kvlink_transports.nixl.records import _Peer, _Xfer
from kvlink_transports.nixl.requests import _Requests

log = logging.getLogger("kvlink.nixl")

_OPS = {Op.READ: "READ", Op.WRITE: "WRITE"}


class _Transfers(_Requests):
    """post, poll, release and what they report, as methods of the transport."""

    _closed: bool
    _post_mode: str  # "prepped" | "direct"
    _telemetry: bool
    _local: _Side  # our registered regions
    _lpreps: dict[int, _Prep]  # block size -> our regions prepped at it
    _ids: itertools.count[int]
    _marks: StreamMarks | None  # stream order for our VRAM (None: no VRAM, or turned off)
    #: (prep, base array) -> the segments' first blocks and room (post_runs)
    _run_firsts: PerBases

    def post(
        self, op: Op, peer: str, local: Extents, remote: Extents, notify: bytes | None = None,
        *, ticket: bytes = b"",  # not checked by the owner here (docs/security.md)
    ) -> int:
        t0 = time.perf_counter()
        check_pairs(local, remote)
        notif = bytes(notify) if notify else None
        with self._lock:
            li = self._local.table.locate(local, "local extent")
            if self._abandoned:  # (first: its deadline may drop the peer)
                self._reap_abandoned()
            p = self._peers.get(peer)
            if self._closed or p is None:
                why = "the transport is closed" if self._closed else "it is not connected"
                return self._failed_handle(peer, f"nixl: peer {peer!r}: {why}")
            ri = p.side.table.locate(remote, "remote extent")
            if p.blocked is not None:
                return self._failed_handle(peer, p.blocked)
            if self._zombies:
                self._reap_zombies()
            n = int(local.shape[0])
            x = _Xfer(p.key, p.agent, [], [], int(local["len"].sum()) if n else 0, n, t0,
                      op=_OPS[op], deadline=time.monotonic() + self._timeout)
            handle = next(self._ids)
            self._xfers[handle] = x
            mark = self._stream_mark(li) if n else None
            if mark is not None:  # the caller's GPU work first: issued by poll once it ran
                # (our own copies of the extents: the caller's arrays are its own again now)
                x.after = (mark, (op, peer, p, local.copy(), remote.copy(), li, ri, notif))
            else:
                self._issue(x, op, peer, p, local, remote, li, ri, notif)
        x.t_posted = time.perf_counter()
        self._account(post_seconds=x.t_posted - t0)
        return handle

    #: post_runs takes one run per block: NIXL merges adjacent indices of prepped lists itself,
    #: so the host finds no runs (kvlink.plan.PlanTable.runs, coalesce=False)
    coalesce_runs = False

    def post_runs(self, op: Op, peer: str, runs: Runs, *, ticket: bytes = b"") -> int:
        """Optional hook (the worker uses it where a plan takes the RUNS form): :meth:`post` of
        ``runs.expand()`` without expanding it — the request's prepped-list indices come from
        the segments' first blocks (worked out once per peer's base arrays) plus the runs'
        block ids, two broadcast adds (NixlConnector's own arithmetic), with one bounds check
        per request instead of one per extent. Same contract as post. Where the form does not
        fit the prepped lists (no lists, mixed memory, VRAM that waits for the caller's
        stream, runs of unequal length) it is ``post`` of the expanded extents."""
        t0 = time.perf_counter()
        with self._lock:
            if self._abandoned:  # (first: its deadline may drop the peer)
                self._reap_abandoned()
            got = self._indexed_runs(peer, runs)
            if got is not None:
                handle, x = self._post_runs_locked(op, runs, t0, *got)
        if got is None:
            plan = runs.expand()
            return self.post(op, peer, plan.local, plan.remote, ticket=ticket)
        x.t_posted = time.perf_counter()
        self._account(post_seconds=x.t_posted - t0)
        return handle

    def _post_runs_locked(self, op: Op, runs: Runs, t0: float, p: _Peer, lidx: Any, ridx: Any,
                          lm: int, rm: int) -> tuple[int, _Xfer]:
        if self._zombies:
            self._reap_zombies()
        n = runs.descriptors
        x = _Xfer(p.key, p.agent, [], [], runs.nbytes, n, t0, op=_OPS[op],
                  deadline=time.monotonic() + self._timeout)
        handle = next(self._ids)
        self._xfers[handle] = x
        x.path = "prepped"
        assert p.prep is not None
        lprep = self._lpreps[p.prep.block]
        err = self._post_indexed(x, _OPS[op], (lprep.handles[lm], lidx),
                                 (p.prep.handles[rm], ridx), None)
        if err is not None:
            self._fail(x, f"nixl {op.value} to {p.key!r} failed at post: {err} "
                       f"({n} extents, {x.nbytes} bytes)")
        return handle, x

    def _indexed_runs(self, peer: str, runs: Runs) -> tuple[_Peer, Any, Any, int, int] | None:
        """(peer, local and remote indices, memory codes) of a RUNS post through the prepped
        lists, or None for :meth:`post`'s path (lock held)."""
        p = self._peers.get(peer)
        if (self._closed or p is None or p.blocked is not None or p.prep is None
                or self._post_mode != "prepped" or runs.descriptors == 0):
            return None
        lprep = self._lpreps.get(p.prep.block)
        lk, rk = self._local.one_kind, p.side.one_kind
        if (lprep is None or lprep.side is not self._local or p.prep.side is not p.side
                or lk is None or rk is None or lk not in lprep.handles
                or rk not in p.prep.handles
                or (self._marks is not None and self._local.has_vram)):
            return None  # (VRAM in stream order: post's deferred issue)
        b, unit = lprep.block, runs.longest_run
        if unit % b or runs.run_bytes != unit * int(runs.lens.shape[0]):
            return None  # runs not all one length of whole blocks
        lf = self._firsts(lprep, runs.local_base)
        rf = self._firsts(p.prep, runs.remote_base)
        if lf is None or rf is None:
            return None
        per = unit // b
        if (int(runs.local_at.max()) + unit > lf[1] or int(runs.remote_at.max()) + unit > rf[1]
                or runs.local_at.dtype != np.uint64 or runs.descriptors * per >= 1 << 31):
            return None  # past a region's prepped blocks: post's bounds check says where
        if ((runs.local_at | runs.remote_at) & np.uint64(b - 1) if b & (b - 1) == 0
                else (runs.local_at | runs.remote_at) % np.uint64(b)).any():
            return None
        lidx, ridx = _run_indices(lf[0], rf[0], runs.local_at, runs.remote_at, b, per)
        return p, lidx, ridx, lk, rk

    def _firsts(self, prep: _Prep, bases: npt.NDArray[np.uint64]
                ) -> tuple[npt.NDArray[np.int32], int] | None:
        """:func:`_segment_firsts`, once per (prep, base array) (:class:`PerBases`)."""
        got: tuple[npt.NDArray[np.int32], int] | None = self._run_firsts.get(
            lambda: _segment_firsts(prep, bases), prep, bases)
        return got

    def _stream_mark(self, li: npt.NDArray[np.intp]) -> Any:
        """Stream order (kvlink.transport rule 6) for a transfer touching our VRAM: a mark of
        the work on the caller's current stream, or None where there is none (an idle stream,
        no VRAM extent). NIXL copies on UCX's own streams, which know nothing of the caller's:
        a layer-wise push posted as the forward enqueues each layer would have copied the
        layer's blocks before the forward wrote them (every byte wrong, on one H200)."""
        return mark_post(self._marks, self._local.vram, li)

    def _issue(self, x: _Xfer, op: Op, peer: str, p: _Peer, local: Extents, remote: Extents,
               li: npt.NDArray[np.intp], ri: npt.NDArray[np.intp], notif: bytes | None) -> None:
        """Hand ``x``'s descriptors to NIXL (lock held): at post, or at the poll that finds the
        caller's stream past the post's mark (then only if ``peer`` is still connected as it
        was: else it fails, nothing having moved)."""
        current: _Peer | None = self._peers.get(peer)
        if self._closed or current is not p or p.blocked is not None:
            self._fail(x, f"nixl: peer {peer!r} went away before the caller's CUDA stream "
                       "reached the post: nothing was moved")
            return
        n = x.ndesc
        if n == 0:  # nothing moves; DONE unless its notification cannot be sent
            if notif is None or self._send_notif(x, p.agent, notif):
                x.state = DONE
        else:
            parts = _memory_pairs(self._local, li, p.side, ri)
            if parts[0][0] is not None:  # split: poll sends the notification at the end
                x.notify = notif
            lprep = self._lpreps.get(p.prep.block) if p.prep is not None else None
            for mask, lm, rm in parts:
                lx, rx = (local, remote) if mask is None else (local[mask], remote[mask])
                lr, rr = (li, ri) if mask is None else (li[mask], ri[mask])
                idx: tuple[Any, Any] | None = None
                if (lprep is not None and p.prep is not None
                        and lprep.side is self._local and p.prep.side is p.side
                        and lm in lprep.handles and rm in p.prep.handles):
                    pair_idx = _pair_indices(lprep, lr, lx, p.prep, rr, rx)
                    if pair_idx is not None:
                        idx = (lprep.handles[lm], pair_idx[0]), (p.prep.handles[rm],
                                                                 pair_idx[1])
                    elif not x.path:
                        _warn_once(
                            f"unaligned{p.prep.block}", "nixl: a request's extents are not "
                            "whole %d-byte blocks of the registered regions: it builds its "
                            "own descriptor lists (slower; set option prep_block_bytes to "
                            "the KV block size)", p.prep.block)
                msg = notif if mask is None else None
                if idx is not None:
                    x.path = x.path or "prepped"
                    err = self._post_indexed(x, _OPS[op], idx[0], idx[1], msg)
                else:
                    x.path = x.path or ("direct" if self._post_mode == "direct"
                                        else "per-request")
                    err = self._post_one(x, _OPS[op], p.agent,
                                         _dlist(lx, self._local.dev[lr]), _MEM_NAMES[lm],
                                         _dlist(rx, p.side.dev[rr]), _MEM_NAMES[rm], msg)
                if err is not None:  # parts already posted are cancelled or awaited
                    self._fail(x, f"nixl {op.value} to {p.key!r} failed at post: {err} "
                               f"({x.ndesc} extents, {x.nbytes} bytes)")
                    break

    def xfer_timing(self, handle: int) -> dict[str, float | str]:
        """Host time of one post: ``pre_transfer_s`` from the post call to NIXL's transfer()
        starting (bounds checks, index computation, ``make_prepped_xfer``), ``post_call_s`` the
        whole call (over cma the copy runs inside transfer()), and ``path``: "prepped" (lists
        prepped at connect, no list built), "per-request" or "direct"."""
        with self._lock:
            x = self._xfers.get(handle)
            if x is None or x.abandoned:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            return {
                "pre_transfer_s": (x.t_transfer or x.t_posted) - x.t_post,
                "post_call_s": x.t_posted - x.t_post,
                "path": x.path,
            }

    def _failed_handle(self, peer: str, reason: str) -> int:
        """A handle that never started (lock held): FAILED at once, nothing to wait for."""
        handle = next(self._ids)
        x = _Xfer(peer, "", [], [], 0, 0, time.perf_counter())
        self._xfers[handle] = x
        self._fail(x, reason)
        return handle

    def _post_one(
        self,
        x: _Xfer,
        op: str,
        agent: str,
        ld: npt.NDArray[np.uint64],
        lmem: str,
        rd: npt.NDArray[np.uint64],
        rmem: str,
        notif: bytes | None,
    ) -> str | None:
        a = self._agent
        msg = notif or b""
        try:
            if self._post_mode == "prepped":
                lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", ld, lmem)
                try:
                    rh = a.prep_xfer_dlist(agent, rd, rmem)
                    try:
                        idx = np.arange(ld.shape[0], dtype=np.int32)
                        req = a.make_prepped_xfer(op, lh, idx, rh, idx, notif_msg=msg)
                    finally:
                        rh.release()
                finally:
                    lh.release()
            else:
                req = a.initialize_xfer(
                    op, a.get_xfer_descs(ld, lmem), a.get_xfer_descs(rd, rmem), agent, notif_msg=msg
                )
        except Exception as exc:
            return _nixl_reason(exc)
        return self._start(x, req)

    def _post_indexed(self, x: _Xfer, op: str, local: tuple[Any, Any], remote: tuple[Any, Any],
                      notif: bytes | None) -> str | None:
        """One NIXL request from the lists prepped at connect, by index (lock held)."""
        try:
            req = self._agent.make_prepped_xfer(op, local[0], local[1], remote[0], remote[1],
                                                notif_msg=notif or b"")
        except Exception as exc:
            return _nixl_reason(exc)
        return self._start(x, req)

    def _start(self, x: _Xfer, req: Any) -> str | None:
        x.reqs.append(req)
        x.done.append(False)
        if not x.t_transfer:
            x.t_transfer = time.perf_counter()
        self._owner_calls += 1
        try:
            state = self._agent.transfer(req)
        except Exception as exc:
            return _nixl_reason(exc)
        if state == "ERR":
            return "NIXL returned ERR"
        return None

    def poll(self, handle: int) -> XferState:
        with self._lock:
            x = self._xfers.get(handle)
            if x is None or x.abandoned:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            if x.after is not None and not self._issue_after(x):
                return x.state
            if x.state.status is not XferStatus.PENDING:
                return x.state
            pending = self._check_reqs(x)
            if pending and not x.expired and time.monotonic() >= x.deadline:
                self._expire(x)  # may report it FAILED already
                if x.state.status is not XferStatus.PENDING:
                    return x.state
                pending = self._check_reqs(x)
            if x.failure is not None:
                if not pending:
                    self._failed(x)
                return x.state
            if pending:
                return x.state
            if x.notify is not None and not self._send_notif(x, x.agent, x.notify):
                return x.state
            x.state = DONE
            if self._telemetry:
                for req in x.reqs:
                    try:
                        x.telemetry.append(self._agent.get_xfer_telemetry(req))
                    except Exception as exc:
                        log.debug("nixl telemetry: %s", _nixl_reason(exc))
        self._account(
            transfers=1,
            bytes=x.nbytes,
            descriptors=x.ndesc,
            xfer_seconds=time.perf_counter() - x.t_post,
        )
        return DONE

    def _issue_after(self, x: _Xfer) -> bool:
        """A post waiting for the caller's stream (lock held): issued once the device is past
        its mark (True); still waiting (False), or failed at its deadline with nothing moved."""
        assert x.after is not None and self._marks is not None
        mark, args = x.after
        if x.state.status is XferStatus.PENDING and not self._marks.reached(mark):
            if time.monotonic() < x.deadline:
                return False
            self._fail(x, f"nixl {x.op} to {x.peer!r}: the caller's CUDA stream did not reach "
                       f"the post within timeout_s ({self._timeout} s): nothing was moved")
        x.after = None
        self._marks.drop(mark)
        if x.state.status is XferStatus.PENDING:
            self._issue(x, *args)
        return True

    def release(self, handle: int) -> None:
        """Forget the handle; one still in flight is kept until UCX ends it
        (:meth:`_abandon`: releasing its NIXL requests would not stop them)."""
        with self._lock:
            x = self._xfers.get(handle)
            if x is not None and not x.abandoned:
                del self._xfers[handle]
                if x.after is not None:  # never issued: nothing to end
                    assert self._marks is not None
                    self._marks.drop(x.after[0])
                    x.after = None
                if not self._abandon(handle, x):
                    self._release_reqs(x)
            if self._abandoned:
                self._reap_abandoned()
            if self._zombies:
                self._reap_zombies()
            if self._draining:
                self._settle_draining()

    def xfer_telemetry(self, handle: int) -> list[dict[str, float]]:
        """NIXL telemetry of a DONE transfer (needs ``options["telemetry"]``), one dict per NIXL
        request: start_us, post_us, xfer_us, bytes, descriptors (after NIXL's merging)."""
        with self._lock:
            x = self._xfers.get(handle)
            if x is None or x.abandoned:
                raise TransferError(f"nixl: unknown or released handle {handle}")
            out = []
            for t in x.telemetry:
                out.append(
                    {
                        "start_us": float(getattr(t, "startTime", 0)),
                        "post_us": float(getattr(t, "postDuration", 0)),
                        "xfer_us": float(getattr(t, "xferDuration", 0)),
                        "bytes": float(getattr(t, "totalBytes", 0)),
                        "descriptors": float(getattr(t, "descCount", 0)),
                    }
                )
            return out
