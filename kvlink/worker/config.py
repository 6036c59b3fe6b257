"""A worker's options (:class:`WorkerConfig`), checked when it is made.

Separate because it is what a caller writes before anything runs, and what every other module
of the worker reads: it depends on nothing of the worker's, so a newcomer can read the options
without reading the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from kvlink import wire
from kvlink.errors import ConfigError
from kvlink.integrity import Level

#: default of ``poll_grace_us``: one request's copy on one H200 (0.09-0.27 ms for the e2e
#: bench's 70B TP8-rank and 8B requests), so a poll that comes right after its post waits for
#: it and a caller that sleeps between polls sees it at its end: the 8B request polled that
#: way 0.624 -> 0.419 ms against 100 us, the 70B request's (polled, sleeping, 8 in flight)
#: unchanged (bench/results/gpu_grace_300/)
DEFAULT_POLL_GRACE_US = 300.0


@dataclasses.dataclass
class WorkerConfig:
    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    transports: list[str] = dataclasses.field(default_factory=lambda: ["tcp"])
    transport_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"  # bind address of side channel and data plane
    advertise_host: str | None = None
    side_port: int = 0  # base port; rank r listens on side_port + r (0: ephemeral)
    handshake_timeout: float = 10.0
    serve: bool = True  # run a side channel server (producers, and consumers in push mode)
    secret: str | None = None  # shared side-channel secret (default: env KVLINK_SECRET)
    allow_insecure: bool = False  # bind an unauthenticated side channel on a non-loopback host
    lease_seconds: float = 120.0  # producer: how long a held request waits for its readers
    read_seconds: float = 30.0  # producer: a granted READ extends its lease this far (a hint)
    #: producer: readers' renewals (KVWorker.renew) keep a hold at most this long after it began
    renew_limit: float = 600.0
    intent_timeout: float = 10.0  # reader: how long to retry a request not held (yet)
    close_timeout: float = 2.0  # close() returns within this, cancelling what it cannot send
    #: least privilege on the data plane (docs/security.md): a transport that can enforce it
    #: serves a peer's transfer only inside what this worker granted for it — a reader the
    #: blocks of a hold it was told the generation of, READ only; a pushing prefill the
    #: blocks reserved for that push, WRITE only, until the push ends. False: any peer that
    #: passed the handshake may touch all registered memory
    grants: bool = True
    #: prefill in push mode: take decodes' push requests (push_requests()); False: refuse them
    #: ("this rank serves pulls"), so nothing queues on a rank that never takes them
    serve_pushes: bool = False
    #: end-to-end KV integrity (kvlink.integrity, docs/integrity.md): "off", "sample" (about
    #: one block in 64 of every request, kvlink.sampling.SAMPLE_EVERY, and its last) or
    #: "full". A producer sends its digests with every "intact" verdict; a reader with it on
    #: fails a receive whose landed KV differs, or that came without digests (fail closed)
    integrity: str = "off"
    #: same-host readers validate READs in shared memory instead of asking us after each one
    #: (kvlink.holdboard): a producer publishes its holds there; a reader uses the boards
    #: it is offered. False: every READ is validated by a round trip
    hold_board: bool = True
    #: same-host pushes end without a message (kvlink.landing): a decode offers a slot of its
    #: landing board per push; a prefill's transport that can moves its flag once the bytes
    #: landed. False: every push ends by the prefill's "written" note
    landing_board: bool = True
    #: microseconds a poll may wait for a copy its transport expects to end within them
    #: (cuda_ipc: by the bytes left on its stream at the rate its copies ran), so the
    #: request is reported by this poll, not the next — a sleep or a scheduler step later.
    #: At most this long in all per poll; 0: never waits
    poll_grace_us: float = DEFAULT_POLL_GRACE_US

    def __post_init__(self) -> None:
        _check_types(self)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.tp_size > wire.MAX_TP:
            raise ConfigError(f"tp_size {self.tp_size} exceeds {wire.MAX_TP}")
        wire.check_id(self.engine_id, "engine_id")
        if not self.transports:
            raise ConfigError("transports must name at least one transport")
        top = 65535 - (self.tp_size - 1)  # (rank r listens on side_port + r)
        if not 0 <= self.side_port <= top:
            raise ConfigError(f"side_port must be 0 (any free port) to {top} (tp_size "
                              f"{self.tp_size}), got {self.side_port!r}")
        Level.parse(self.integrity, "integrity")
        for key in ("handshake_timeout", "lease_seconds", "read_seconds", "intent_timeout",
                    "close_timeout", "renew_limit"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)!r}")
        if not 0 <= self.poll_grace_us <= 1e6:
            raise ConfigError(f"poll_grace_us must be 0 to 1e6 (a second), got "
                              f"{self.poll_grace_us!r}")


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(WorkerConfig)


def _check_types(config: WorkerConfig) -> None:
    """Each field of the type it is declared with, else a ConfigError naming it (a string
    where a number goes was a TypeError from a comparison, or a failure much later)."""
    hints = _hints()
    for f in dataclasses.fields(WorkerConfig):
        value, tp = getattr(config, f.name), hints[f.name]
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        origins = {typing.get_origin(m) or m for m in (typing.get_args(tp) if union else (tp,))}
        if value is None and type(None) in origins:
            continue
        if float in origins:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif int in origins:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, tuple(o for o in origins if isinstance(o, type)))
        if ok and list in origins:
            ok = all(isinstance(x, str) for x in value)
        if not ok:
            want = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
            raise ConfigError(f"WorkerConfig.{f.name}: expected {want}, got {value!r}")
