"""Scheduler side of the vLLM connector: what to pull, what to hold, what to tell the proxy.

Never touches memory. Requests and block lists are vLLM's objects, read duck-typed (this module
does not import vLLM). The lease itself lives with the worker that receives the readers'
notifications (see ``vllm_worker``); the scheduler only delays the free and says for how long.
"""

from __future__ import annotations

import logging
from typing import Any

from kvlink import localkey, wire
from kvlink.channel import Channels, Pending
from kvlink.compat import WIRE_VERSION
from kvlink.integrations.vllm_common import (
    GENERATION_PARAM,
    MODE_PARAM,
    MODES,
    RecvReq,
    SendReq,
    Settings,
    StepPlan,
    parse_remote,
)
from kvlink.scheduler import new_generation
from kvlink.sidechannel import secret_from_env

log = logging.getLogger("kvlink.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def _prompt_len(request: Any) -> int:
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    return int(getattr(request, "num_prompt_tokens", 0))


class PullScheduler:
    def __init__(self, settings: Settings, tp_size: int, block_size: int,
                 dp_rank: int = 0) -> None:
        self.s = settings
        self.tp_size = tp_size
        self.block_size = block_size
        self.side_port = settings.rank_port(dp_rank, tp_size)
        self._plan = StepPlan()
        self._loading: dict[str, tuple[int, tuple[int, ...]]] = {}  # req -> (tokens, blocks)
        self.counters: dict[str, float] = {}
        # producer: holds go to our own workers the moment the blocks are kept (wire.Hold)
        secret = secret_from_env(settings.secret)
        self._chan = Channels(secret) if settings.producer else None
        # holds are signed: a hold names the generation that lets a reader in (kvlink.grants)
        self._key = localkey.engine_key(settings.engine_id, secret) if settings.producer else b""
        self._sent: list[Pending] = []

    def _count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ decode side
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = getattr(request, "kv_transfer_params", None)
        if not self.s.consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if parse_remote(params) is None:
            return 0, False
        count = _prompt_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None)
        if not self.s.consumer or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        remote = parse_remote(params)
        if remote is None:
            log.warning("request %s: incomplete kv_transfer_params %s; computing locally",
                        request.request_id, {k: params.get(k) for k in params})
            return
        if num_external_tokens <= 0:
            # Full local prefix hit: nothing to read, but the prefill holds blocks for us.
            self._plan.release.append(remote)
            return
        if hasattr(blocks, "get_unhashed_block_ids"):
            local = tuple(blocks.get_unhashed_block_ids())
        else:
            local = tuple(blocks.get_block_ids()[0])
        push = self._push(request.request_id, params)
        self._plan.recv.append(RecvReq(request.request_id, remote, local, num_external_tokens,
                                       push))
        self._loading[request.request_id] = (num_external_tokens, local)

    def _push(self, req_id: str, params: dict[str, Any]) -> bool:
        """Pull or push for this request: the ``mode`` setting, unless the request's params
        name one (``kvlink_mode``). Push needs this consumer's side channel, which only runs
        with ``mode: push``; a request asking for push without it is pulled."""
        wanted = params.get(MODE_PARAM) or self.s.mode
        if wanted not in MODES:
            log.warning("request %s: %s=%r is not one of %s; using %s", req_id, MODE_PARAM,
                        wanted, list(MODES), self.s.mode)
            wanted = self.s.mode
        if wanted == "push" and not self.s.serves:
            log.warning("request %s asks for push but this consumer runs in pull mode (no side "
                        "channel for the prefill to write through); pulling", req_id)
            return False
        return bool(wanted == "push")

    # ------------------------------------------------------------------ prefill side
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any]
                                                                            | None]:
        params = getattr(request, "kv_transfer_params", None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: release the prefill's lease.
            params["do_remote_prefill"] = False
            remote = parse_remote(params)
            if remote is not None and self.s.consumer:
                self._plan.release.append(remote)
            return False, None
        if not params.get("do_remote_decode") or not self.s.producer:
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        if status not in _FINISHED_OK or not block_ids:
            return False, None  # aborted, or nothing computed: free now
        ids = tuple(int(b) for b in block_ids)
        # minted here, where the blocks are kept from now on: the decode READs them at once
        # and the worker's hold (next step) validates it after the READ
        generation = new_generation()
        self._plan.send.append(SendReq(request.request_id, ids, generation))
        self._hold_now(request.request_id, ids, generation)
        self._count("held_requests")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids)],
            "remote_engine_id": self.s.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.s.public_host,
            "remote_port": self.side_port,
            "tp_size": self.tp_size,
            "remote_num_tokens": int(getattr(request, "num_computed_tokens", 0)),
            "kvlink_block_size": self.block_size,
            GENERATION_PARAM: generation,
        }

    def _hold_now(self, req_id: str, ids: tuple[int, ...], generation: int) -> None:
        """Tell every local worker rank to hold now (the step's plan carries the same hold, for
        a worker that did not get this: whichever comes first holds). Never blocks."""
        if self._chan is None:
            return
        host = self.s.host if self.s.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        body = wire.hold_body(self.s.engine_id, req_id, list(ids), generation)
        msg = wire.Hold(v=WIRE_VERSION, engine_id=self.s.engine_id, req_id=req_id,
                        block_ids=list(ids), generation=generation,
                        mac=localkey.sign(self._key, body))
        self._sent += [self._chan.call(host, self.side_port + r, msg, 2.0)
                       for r in range(self.tp_size)]
        self._chan.flush()

    # ------------------------------------------------------------------ every step
    def build_plan(self) -> StepPlan:
        if self._chan is not None and self._sent:
            self._chan.pump()
            for p in [p for p in self._sent if p.done()]:
                self._sent.remove(p)
                if p.exception() is not None:
                    log.info("a hold did not reach its worker now (the step's plan carries "
                             "it): %s", p.exception())
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_output(self, finished_recving: set[str] | None, failed_recving: set[str] | None,
                      invalid_block_ids: set[int] | None) -> None:
        failed = set(failed_recving or ())
        bad = set(invalid_block_ids or ())
        for req in finished_recving or ():
            tokens, blocks = self._loading.pop(req, (0, ()))
            if req in failed or (bad and bad.intersection(blocks)):
                self._count("load_failed_requests")
                self._count("load_failed_tokens", tokens)
            else:
                self._count("loaded_requests")
                self._count("loaded_tokens", tokens)

    def take_counters(self) -> dict[str, float]:
        out, self.counters = self.counters, {}
        return out

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
