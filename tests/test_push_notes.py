"""A push's "written" note is sent once, and only after the lease check.

Before the fix, ``KVWorker.push(..., lease=...)`` attached the lease to the request only after
``_start`` had already stepped it: with the decode's handshake cached (every push after the
first to a decode rank), the WRITE was posted at once, while ``req.lease`` was still None, so
``_notes_natively`` put a "written" note on the WRITE itself (through the transport's native
notifications, i.e. *before* the validate-after-write lease check); once DONE, ``_report``
(lease set by then) sent the side-channel "written" note as well. The decode finished the push
on the native note and answered the second one ``unknown: no push of ... is awaited here``:
``reports_failed`` on the prefill, ``refusals["written"]`` on the decode, for most pushes.

Real KVWorkers over the real tcp transport and ZMQ side channel on 127.0.0.1; no sleep is a
sync (each wait polls a condition with a deadline).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from test_lifecycle import blocks, make, outcome, remote, until

from kvlink.worker import KVWorker


def settle(*workers: KVWorker, timeout: float = 10.0) -> None:
    """Poll until every report each worker sent has been answered (so a refusal, if any, is
    counted on both sides: the receiver counts before it answers)."""
    deadline = time.monotonic() + timeout
    while any(w._told for w in workers):
        assert time.monotonic() < deadline, f"reports still unanswered after {timeout}s"
        for w in workers:
            w.poll()
        time.sleep(0.001)


def push_held(prefill: KVWorker, decode: KVWorker, req: str, held: list[int],
              into: list[int]) -> str:
    """The connector's flow: the prefill holds ``req``, the decode asks for a push, the
    prefill writes it under the lease; returns the prefill's transfer id."""
    prefill.hold(req, held, readers=1)
    decode.expect_push(req, remote(prefill), into, timeout=10)
    until(lambda: prefill.queued_pushes() == 1, 10, "the push request arrived")
    (msg,) = prefill.push_requests()
    return prefill.push(msg, held, lease=req)


def both(decode: KVWorker, req: str, prefill: KVWorker, key: str,
         timeout: float = 10.0) -> None:
    """Step both sides, the decode first (as in a deployment, it takes what arrived without
    waiting for the prefill's next step), until each reported its end; both must succeed."""
    ends: dict[str, tuple[bool, str]] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < 2:
        assert time.monotonic() < deadline, f"push {req} did not end within {timeout}s: {ends}"
        for w, rid in ((decode, req), (prefill, key)):
            done, failed = w.poll()
            if rid in done or rid in failed:
                ends[rid] = (rid in done, failed.get(rid, ""))
        time.sleep(0.001)
    assert all(ok for ok, _ in ends.values()), ends


def test_clean_pushes_under_a_lease_leave_no_refused_note() -> None:
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        for i in range(4):  # the first handshakes; the others post inside push()
            req = f"cmpl-{i}"
            key = push_held(prefill, decode, req, [5 + i, 9 + i], [3, 4])
            both(decode, req, prefill, key)
            assert np.array_equal(blocks(decode, [3, 4]), blocks(prefill, [5 + i, 9 + i]))
            settle(prefill, decode)
            assert (prefill.reports_failed, decode.reports_failed) == (0, 0), i
            assert (prefill.refusals["written"], decode.refusals["written"]) == (0, 0), i
        assert prefill.pending() == 0 and decode.pending() == 0
    finally:
        prefill.close()
        decode.close()


def test_a_push_under_a_lease_is_told_only_after_the_lease_check() -> None:
    """No WRITE of a push under a lease carries a native note, posted at once or later: the
    decode learns "written" only from the prefill's side channel, after finish_read."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    notes: list[Any] = []
    try:
        tcp = prefill.transports["tcp"]
        post: Callable[..., Any] = tcp.post

        def recording(*args: Any, **kw: Any) -> Any:
            notes.append(args[4] if len(args) > 4 else kw.get("notify"))
            return post(*args, **kw)

        tcp.post = recording  # type: ignore[method-assign]
        for i in range(3):
            req = f"r{i}"
            key = push_held(prefill, decode, req, [1 + i], [6])
            assert outcome(prefill, key, 10)[0]
            assert outcome(decode, req, 10)[0]
        assert len(notes) == 3 and notes == [None] * 3
    finally:
        prefill.close()
        decode.close()


def test_connector_push_mode_counts_no_refused_note() -> None:
    """The connector's PullWorkers (the vLLM integration, no vLLM engine): two pushes."""
    from test_vllm_e2e import _pair, _remote_r1, _Steps

    from kvlink.demo.run import free_port_range
    from kvlink.integrations.vllm.metadata import RecvReq, SendReq, StepPlan

    port, dport = free_port_range(1), free_port_range(1)
    prod, cons, src, dst = _pair({"side_channel_port": port},
                                 {"side_channel_port": dport, "mode": "push"})
    try:
        steps = _Steps(prod, cons)
        for n, (held, into) in enumerate((((1, 3), (4, 0)), ((2, 0), (5, 1)))):
            remote_ = dataclasses.replace(_remote_r1(port, list(held)), request_id=f"r{n}")
            prod.start(StepPlan(send=[SendReq(f"r{n}", held)]))
            cons.start(StepPlan(recv=[RecvReq(f"d{n}", remote_, into, 64, push=True)]))
            res = steps.recv()
            assert res.finished_recving == {f"d{n}"} and not res.failed_recving
            steps.wait_sent(f"r{n}")
            for s_t, d_t in zip(src, dst):
                assert all(d_t[d].equal(s_t[s]) for s, d in zip(held, into))
        # an idle connector does not poll its KVWorker: take the answers to its reports here
        # (nothing is in flight any more, so no result of poll() is the connector's)
        assert prod.worker is not None and cons.worker is not None
        settle(prod.worker, cons.worker)
        for w in (prod.worker, cons.worker):
            assert w.reports_failed == 0 and w.refusals["written"] == 0, w.config.engine_id
    finally:
        prod.close()
        cons.close()
