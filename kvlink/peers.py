"""Handshake state of the remote ranks a worker talks to: one cached handshake per address.

Why its own module: which peer a transfer goes to is half of block ownership. A cached
handshake (agent name, KV layout, transport descriptors) is keyed by engine id *and* address,
so two live engines that share an id are never mixed up (a READ announced to one must not run
against the other's memory). It carries the producer's *incarnation*: a caller that learns the
peer restarted (a "stale" answer, or a newer incarnation in a push request) drops the old
state and handshakes again, never reading through a dead process's mappings or keys. A new
engine answering at an address an old one used replaces the old one's state.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

from kvlink import wire
from kvlink.compat import WIRE_VERSION, check_compatible, compat_hash
from kvlink.errors import ConfigError, HandshakeError, IncompatibleSpecError, KVLinkError
from kvlink.holdboard import BoardView
from kvlink.hostid import host_id
from kvlink.layout import KVCacheSpec
from kvlink.transport import Transport

log = logging.getLogger("kvlink.worker")

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


@dataclasses.dataclass(frozen=True)
class RemoteEngine:
    """How to reach a remote instance: the keys vLLM's kv_transfer_params carry. Checked
    when made (a caller's values, or a router's): a port or TP size that cannot be failed
    later, as a peer that never answers."""

    engine_id: str
    host: str
    port: int  # side channel base port (rank r at port + r)
    tp_size: int = 1

    def __post_init__(self) -> None:
        if type(self.tp_size) is not int or not 1 <= self.tp_size <= wire.MAX_TP:
            raise ConfigError(f"remote {self.engine_id!r}: tp_size must be an integer 1.."
                              f"{wire.MAX_TP}, got {self.tp_size!r}")
        if type(self.port) is not int or not 0 < self.port <= 65536 - self.tp_size:
            raise ConfigError(f"remote {self.engine_id!r}: port must be an integer 1.."
                              f"{65536 - self.tp_size} (rank r at port + r, {self.tp_size} "
                              f"rank(s)), got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"remote {self.engine_id!r}: host must be a name or an address, "
                              f"got {self.host!r}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError(f"remote engine id must be a non-empty string, got "
                              f"{self.engine_id!r}")
        wire.check_id(self.engine_id, "remote engine id")


@dataclasses.dataclass
class Peer:
    """One remote rank after a successful handshake."""

    agent: str
    spec: KVCacheSpec
    transport: Transport
    tp_size: int
    endpoint: tuple[str, int]
    incarnation: int
    #: the producer's hold board, where it is on our host (kvlink.holdboard): READs of it are
    #: validated there; None: by asking
    board: BoardView | None = None


class Call(Protocol):
    """A blocking side-channel call (kvlink.sidechannel.request's shape)."""

    def __call__(self, host: str, port: int, msg: wire._Msg, timeout: float | None = None,
                 live_only: bool = False) -> wire._Msg: ...


Submit = Callable[[Callable[[RemoteEngine, int], Peer], RemoteEngine, int], "cf.Future[Peer]"]


class PeerTable:
    """Handshakes (on the caller's pool, via ``submit``) and caches them per address."""

    def __init__(self, engine_id: str, agent_name: str, tp_rank: int, tp_size: int,
                 spec: Callable[[], KVCacheSpec], transports: Mapping[str, Transport],
                 call: Call, submit: Submit) -> None:
        self._me = (engine_id, agent_name, tp_rank, tp_size)
        self._spec, self._transports = spec, transports
        self._call, self._submit = call, submit
        self._peers: dict[tuple[str, str, int], cf.Future[Peer]] = {}
        self._lock = threading.Lock()
        #: bumped whenever a cached handshake is added, replaced or dropped: what was bound to
        #: the cached ones (a worker's routes) is still theirs while it is unchanged
        self.epoch = 0

    @staticmethod
    def _key(remote: RemoteEngine, rank: int) -> tuple[str, str, int]:
        return (remote.engine_id, remote.host, remote.port + rank)

    def get(self, remote: RemoteEngine, rank: int, incarnation: int | None = None,
            live: bool = False) -> cf.Future[Peer]:
        """The handshake with ``remote``'s ``rank``, started if none is cached (or the cached
        one failed); ``incarnation``: what the peer says it is now, older state is dropped.
        ``live``: the caller knows ``remote`` was serving (it answered with the params the
        caller is about to READ by, or asked the caller for a push), so a handshake this
        starts fails at once where nobody listens there: that process is gone (a decode's
        first READ of a SIGKILLed vLLM prefill waited out ``handshake_timeout``, 10 s)."""
        key = self._key(remote, rank)
        with self._lock:
            fut = self._peers.get(key)
            stale = (fut is not None and incarnation is not None and _ok(fut)
                     and fut.result().incarnation != incarnation)
            if fut is None or stale or (fut.done() and fut.exception() is not None):
                if stale:
                    self._peers.pop(key)
                    _disconnect(fut, "it restarted")
                fut = self._submit(functools.partial(self._handshake, live=live), remote, rank)
                self._peers[key] = fut
                self.epoch += 1
            return fut

    def forget(self, engine_id: str, rank: int) -> None:
        """Drop ``engine_id``'s ``rank`` at every address."""
        with self._lock:
            keys = [k for k, f in self._peers.items() if k[0] == engine_id and _ok(f)
                    and f.result().spec.tp_rank == rank]
            futs = [self._peers.pop(k) for k in keys]
            self.epoch += 1
        for fut in futs:
            _disconnect(fut, "forgotten")

    def forget_stale(self, remote: RemoteEngine, rank: int, fut: cf.Future[Peer]) -> None:
        """The peer behind ``fut`` restarted: drop it (unless already replaced)."""
        with self._lock:
            if self._peers.get(self._key(remote, rank)) is fut:
                del self._peers[self._key(remote, rank)]
            self.epoch += 1
        _disconnect(fut, "it restarted")

    def live(self) -> list[Peer]:
        """The peers of the cached handshakes that succeeded."""
        with self._lock:
            futs = list(self._peers.values())
        return [f.result() for f in futs if _ok(f)]

    def connected(self) -> list[str]:
        """Agent names of peers with live handshake state."""
        with self._lock:
            futs = list(self._peers.values())
        return sorted(f.result().agent for f in futs if _ok(f))

    def _drop_replaced(self, endpoint: tuple[str, int], engine_id: str) -> None:
        with self._lock:
            keys = [k for k in self._peers if k[0] != engine_id and (k[1], k[2]) == endpoint]
            futs = [self._peers.pop(k) for k in keys]
            self.epoch += 1
        for fut in futs:
            log.warning("the engine at %s:%d was replaced by %s; dropping its metadata",
                        *endpoint, engine_id)
            _disconnect(fut, "replaced")

    def _handshake(self, remote: RemoteEngine, rank: int, live: bool = False) -> Peer:
        engine_id, agent_name, tp_rank, tp_size = self._me
        spec = self._spec()
        where = f"{remote.host}:{remote.port + rank}"
        reply = self._call(remote.host, remote.port + rank, wire.HandshakeRequest(
            v=WIRE_VERSION, engine_id=engine_id, agent_name=agent_name, tp_rank=tp_rank,
            tp_size=tp_size, host_id=host_id(), compat=compat_hash(spec.geometry())),
            live_only=live)
        if not isinstance(reply, wire.HandshakeResponse):
            raise HandshakeError(f"{where} answered {type(reply).__name__} to a handshake")
        if reply.engine_id != remote.engine_id or reply.tp_rank != rank:
            raise HandshakeError(f"{where} is engine {reply.engine_id!r} rank {reply.tp_rank}, "
                                 f"expected {remote.engine_id!r} rank {rank}")
        if reply.tp_size != remote.tp_size:  # (its heads were mapped over remote.tp_size)
            raise IncompatibleSpecError(
                f"engine {remote.engine_id!r} at {where} runs {reply.tp_size} TP rank(s), but "
                f"it was named with tp_size {remote.tp_size} (RemoteEngine.tp_size; vLLM: "
                "the kv_transfer_params' tp_size)")
        rspec = reply.spec.to_spec()
        check_compatible(spec.geometry(), rspec.geometry(), tp_size, reply.tp_size)
        same_host = reply.host_id == host_id()
        reasons = []
        for name, transport in self._transports.items():
            desc = reply.transports.get(name)
            if desc is None:
                reasons.append(f"{name}: not offered by the peer")
                continue
            why = transport.unreachable_reason(desc, same_host)
            kind = rspec.device.split(":")[0]
            if why is None and kind not in transport.capabilities.memory_kinds:
                why = f"{name} cannot reach peer memory on {rspec.device}"
            if why is not None:
                reasons.append(f"{name}: {why}")
                continue
            try:
                transport.connect(reply.agent_name, desc)
            except KVLinkError as exc:
                reasons.append(f"{name}: {exc}")
                continue
            log.info("peer %s rank %d (%s, %s host): transport %s", remote.engine_id, rank,
                     reply.agent_name, "same" if same_host else "other", name)
            if (same_host and name != "cuda_ipc" and spec.device.startswith("cuda")
                    and rspec.device.startswith("cuda")):
                _warn_once(f"same-host GPU peer {remote.engine_id} is served by {name}, not "
                           "cuda_ipc: one-sided READs of VRAM can fall back to a TCP lane "
                           "(measured 0.46 GB/s with NIXL on one H200); put 'cuda_ipc' first "
                           "in the transports list")
            endpoint = (remote.host, remote.port + rank)
            self._drop_replaced(endpoint, remote.engine_id)
            board = (BoardView.open(reply.board.name, reply.board.token)
                     if same_host and reply.board is not None else None)
            return Peer(reply.agent_name, rspec, transport, reply.tp_size, endpoint,
                        reply.incarnation, board)
        raise HandshakeError(f"no transport reaches {remote.engine_id} rank {rank}: "
                             + "; ".join(reasons))


def _ok(fut: cf.Future[Peer]) -> bool:
    return fut.done() and fut.exception() is None


def _disconnect(fut: cf.Future[Peer] | None, why: str) -> None:
    """Tear down a dropped peer's data path (its transfers turn FAILED once quiescent), and
    let its hold board's mapping go: a transport that registered it for its device (cuda_ipc,
    with integrity on: 66 MiB pinned) unregisters it once no copy of ours can read it, or a
    producer that restarts leaves one more registration behind each time."""
    if fut is not None and _ok(fut):
        peer = fut.result()
        log.info("dropping handshake state of %s (%s:%d): %s", peer.agent, *peer.endpoint, why)
        peer.transport.disconnect(peer.agent)
        forget = getattr(peer.transport, "forget_host_region", None)
        if peer.board is not None and forget is not None:
            forget(peer.board.region)
