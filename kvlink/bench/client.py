"""The bench client: the control connection to a server (:class:`BenchPeer`) and the sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import math
import os
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

import msgspec
import numpy as np

from kvlink.bench import wire
from kvlink.bench.baselines import (
    DEVICE_COPY_HOW,
    MEMCPY_HOW,
    device_copy_seconds,
    memcpy_seconds,
    perftest_client,
    rdma_baseline,
    timed,
)
from kvlink.bench.facts import MiB, buffer, start_versions, versions
from kvlink.demo.proc import describe
from kvlink.errors import AuthError, HandshakeError, PeerUnreachable, TransferError, WireError
from kvlink.hostid import host_id
from kvlink.sockets import keepalive
from kvlink.transport import (
    Op,
    Region,
    Transport,
    TransportContext,
    XferStatus,
    create_transport,
    make_extents,
    registered_transports,
)

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
M = TypeVar("M", bound=wire.Message)


@dataclasses.dataclass
class SweepConfig:
    sizes: list[int] = dataclasses.field(default_factory=lambda: list(SIZES))
    transports: list[str] = dataclasses.field(default_factory=lambda: ["tcp", "nixl"])
    ops: list[str] = dataclasses.field(default_factory=lambda: ["read", "write"])
    total: int = 256 * MiB  # the buffer on each side; a point moves min(total, max_extents*size)
    max_extents: int = 16384
    reps: int = 3  # timed posts per point
    warmup: int = 1  # untimed posts per point before them
    memory: str = "dram"  # or "vram": buffers on cuda:0, baseline = device copy
    perftest: bool = True  # run the ucx_perftest baselines


class BenchPeer:
    """The client's end: the server's descriptors, and its half of each ucx_perftest."""

    def __init__(self, host: str, port: int, timeout: float,
                 secret: bytes | None = None) -> None:
        self.host, self.port, self.where = host, port, f"{host}:{port}"
        self.secret = secret
        deadline = time.monotonic() + timeout
        while True:  # a server still starting refuses: try again until the deadline
            try:
                sock = socket.create_connection(
                    (host, port), timeout=max(0.05, deadline - time.monotonic()))
                keepalive(sock, wire.KEEPALIVE_S)  # (a server host that vanishes mid-sweep)
                break
            except (ConnectionRefusedError, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise PeerUnreachable(
                        f"no kvlink bench server at {self.where} within {timeout:g}s "
                        f"({describe(exc)}); start one there: kvlink bench --server "
                        f"--port {port}") from None
                time.sleep(0.05)  # retry interval of a refused connect, not a synchronisation
            except OSError as exc:  # no such host, no route: no use retrying
                raise PeerUnreachable(f"cannot reach a kvlink bench server at {self.where}: "
                                      f"{describe(exc)}") from None
        self.conn = wire.Conn(sock, self.where, wire.SERVER_FRAME_BYTES)
        self.timeout = timeout

    def _authenticate(self) -> None:
        """Answer the server's challenge (with a secret: prove ours, check theirs)."""
        ch = self._answer(wire.Challenge, 30.0, late=" (an older kvlink bench there? run the "
                          "same kvlink version on both hosts)")
        if ch.nonce and self.secret is None:
            raise AuthError(f"the bench server at {self.where} requires a shared secret: give "
                            "this client the server's --secret (or KVLINK_SECRET)")
        if not ch.nonce and self.secret is not None:
            raise AuthError(f"the bench server at {self.where} has no secret, this client "
                            "one: give both sides the same --secret or KVLINK_SECRET (or "
                            "neither)")
        if self.secret is None:
            return
        if not 8 <= len(ch.nonce) <= 64:
            raise AuthError(f"the bench server at {self.where} sent a challenge of "
                            f"{len(ch.nonce)} B (8-64 expected)")
        mine = secrets.token_bytes(16)
        self.conn.send(wire.Auth(v=wire.PROTOCOL, nonce=mine, mac=wire.proof(
            self.secret, wire.CLIENT_LABEL, ch.nonce, mine)))

        def refused(message: str) -> Exception:
            return AuthError(f"bench server at {self.where} refused this client: {message}")

        welcome = self._answer(wire.Welcome, 30.0, refused)
        if not hmac.compare_digest(welcome.mac, wire.proof(
                self.secret, wire.SERVER_LABEL, mine, ch.nonce)):
            raise AuthError(f"the bench server at {self.where} could not prove it holds the "
                            "same secret")

    def hello(self, cfg: SweepConfig, names: list[str]) -> wire.Ready:
        self._authenticate()
        memory = cast("Literal['dram', 'vram']", cfg.memory)  # the server checks it
        self.conn.send(wire.Hello(v=wire.PROTOCOL, total=cfg.total, memory=memory,
                                  transports=names))

        def failed(message: str) -> Exception:
            return HandshakeError(f"bench server failed at start-up ({self.where}): {message}")

        return self._answer(wire.Ready, 300.0, failed)  # the server allocates, registers first

    def _answer(self, kind: type[M], timeout: float,
                failed: Callable[[str], Exception] | None = None, late: str = "") -> M:
        try:
            msg = self.conn.recv(timeout)
        except TimeoutError:
            raise TransferError(f"bench server at {self.where}: no {kind.__name__.lower()} "
                                f"within {timeout:g} s{late}") from None
        except (EOFError, OSError) as exc:
            raise TransferError(f"bench server at {self.where}: {describe(exc)}") from None
        if isinstance(msg, wire.Error):
            raise (failed(msg.message) if failed is not None else HandshakeError(
                f"bench server failed ({self.where}): {msg.message}"))
        if not isinstance(msg, kind):
            raise WireError(f"bench server at {self.where}: {type(msg).__name__.lower()}, not "
                            f"{kind.__name__.lower()}")
        return msg

    def perftest(self, test: str, size: int, iters: int) -> dict[str, Any]:
        """``ucx_perftest -t test`` from here to the server's host; ``error`` says why not."""
        from kvlink_transports import _ucx

        path = _ucx.ucx_perftest_path()
        if path is None:
            return {"error": "ucx_perftest not found (pip install --no-deps libucx-cu12)"}
        try:
            ready = self._perftest_start()
        except HandshakeError as exc:
            return {"error": str(exc)}
        try:
            res = perftest_client(path, self.host, ready.port, test, size, iters)
        finally:
            self.conn.send(wire.PerftestEnd(v=wire.PROTOCOL))
            self._answer(wire.PerftestEnded, 60.0)
        return {"server_command": ready.command, **res}

    def _perftest_start(self) -> wire.PerftestReady:
        self.conn.send(wire.PerftestStart(v=wire.PROTOCOL, args=[]))
        return self._answer(wire.PerftestReady, 60.0)

    def bye(self) -> None:
        """Tell the server we are done (it frees the session at once); a server already gone
        is no error here: the figures are in."""
        with contextlib.suppress(TransferError, HandshakeError, WireError, OSError):
            self.conn.send(wire.Bye(v=wire.PROTOCOL))
            self._answer(wire.Bye, 10.0)

    def close(self) -> None:
        self.conn.close()


def _pctl(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (of few samples: p99 of 3 is the slowest)."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def _spread(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    return {"gbps": nbytes / statistics.median(seconds) / 1e9,
            "gbps_min": nbytes / max(seconds) / 1e9, "gbps_max": nbytes / min(seconds) / 1e9}


def run_sweep(cfg: SweepConfig, host: str, port: int, timeout: float = 10.0,
              progress: bool = True, secret: bytes | None = None) -> dict[str, Any]:
    """The client's sweep against a bench server at host:port (table rows in ``points``)."""
    names = [n for n in cfg.transports if n in registered_transports()]
    skipped = {n: "not registered" for n in cfg.transports if n not in names}
    start_versions()  # ~1 s, meanwhile
    peer = BenchPeer(host, port, timeout, secret)
    clients: dict[str, tuple[Transport, int]] = {}
    try:
        ready = peer.hello(cfg, names)
        _keep, laddr, device = buffer(cfg.total, cfg.memory, 0)
        me = peer.conn.sock.getsockname()[0]  # where the server reaches us (mooncake asks)
        for name in names:
            d = ready.transports.get(name, wire.Offer(error="the server did not answer for it"))
            if d.error is not None:
                skipped[name] = f"server: {d.error}"
                continue
            try:
                t = create_transport(name, TransportContext(
                    f"bench-client-{name}-{os.getpid()}", host=me, host_id=host_id()))
            except Exception as exc:
                skipped[name] = describe(exc)
                continue
            try:
                t.register([Region(laddr, cfg.total, device)])
                t.connect("server", d.descriptor)
            except Exception as exc:
                t.close()
                skipped[name] = describe(exc)
                continue
            clients[name] = (t, d.addr)
        points = _points(cfg, peer, clients, laddr, progress)
        peer.bye()
    finally:
        for t, _ in clients.values():
            t.close()
        peer.close()
    local = ready.host_id == host_id()  # same boot and IPC namespace: one host
    return {
        "points": points, "skipped_transports": skipped, "rdma_baseline": rdma_baseline(),
        "config": dataclasses.asdict(cfg),
        "server": {"address": f"{host}:{port}", "command": ready.command,
                   "machine": msgspec.to_builtins(ready.machine), "same_host": local},
        "versions": {"client": versions(), "server": ready.versions},
        "baselines": {
            "ucx_perftest": ("host-to-host (127.0.0.1 in the one-host run): its server on "
                             "the bench server's host (started there), its client here, to "
                             "server.address's host; one block-size message per iteration "
                             "from one buffer (ucx_perftest has no working-set option), as "
                             "many bytes as the point's timed posts; -t ucp_get for READ, "
                             "ucp_put_bw for WRITE; commands per point"),
            "memcpy": MEMCPY_HOW if cfg.memory == "dram" else DEVICE_COPY_HOW,
            "ib_write_bw": rdma_baseline()}}


def _post(t: Transport, name: str, op: str, local: Any, remote: Any) -> None:
    """One timed sample: post the whole batch, wait for DONE."""
    h = t.post(Op(op), "server", local, remote)
    st = t.wait(h, 600)
    t.release(h)
    if st.status is not XferStatus.DONE:
        raise TransferError(f"{name} {op} {int(local['len'][0])} B x {len(local)}: {st.reason}")


def _points(cfg: SweepConfig, peer: BenchPeer, clients: dict[str, tuple[Transport, int]],
            laddr: int, progress: bool) -> list[dict[str, Any]]:
    points = []
    steps = len(cfg.sizes) * (1 + len(clients) * len(cfg.ops))
    done = 0
    for size in cfg.sizes:
        n = max(1, min(cfg.max_extents, cfg.total // size))
        nbytes = n * size
        idx = np.random.default_rng(size).permutation(cfg.total // size)[:n]
        copy = device_copy_seconds if cfg.memory == "vram" else memcpy_seconds
        mem = _spread(nbytes, copy(cfg.total, size, idx, cfg.warmup, cfg.reps))
        base: dict[str, Any] = {"memcpy_gbps": mem["gbps"], "memcpy_gbps_min": mem["gbps_min"],
                                "memcpy_gbps_max": mem["gbps_max"]}
        for op, test in (("read", "ucp_get"), ("write", "ucp_put_bw")):
            key = "ucx_perftest_get" if op == "read" else "ucx_perftest_put"
            if op not in cfg.ops:
                continue
            if cfg.memory == "vram":
                r: dict[str, Any] = {"error": "not run for VRAM (baseline: device copy)"}
            elif not cfg.perftest:
                r = {"error": "not run (--no-perftest)"}
            else:
                r = peer.perftest(test, size, max(10, n * cfg.reps))
            base[f"{key}_gbps"] = r.get("gbps", r.get("error"))
            base[key] = r
        done += 1
        offs = idx.astype(np.uint64) * np.uint64(size)
        for name, (t, raddr) in clients.items():
            for op in cfg.ops:
                post = functools.partial(_post, t, name, op, make_extents(laddr + offs, size),
                                         make_extents(raddr + offs, size))
                secs = timed(post, cfg.warmup, cfg.reps)
                avg = statistics.fmean(secs)
                ref = base["ucx_perftest_get_gbps" if op == "read" else "ucx_perftest_put_gbps"]
                sp = _spread(nbytes, secs)
                points.append({
                    "transport": name, "op": op, "memory": cfg.memory.upper(),
                    "block_bytes": size, "batch": n, "blocks": n, "bytes": nbytes,
                    "iterations": cfg.reps, "warmup": cfg.warmup, **sp,
                    "iter_seconds": secs, "lat_avg_us": avg * 1e6,
                    "lat_p99_us": _pctl(secs, 99) * 1e6, "msg_per_s": n / avg,
                    "pct_of_ucx_perftest": 100 * sp["gbps"] / ref if isinstance(ref, float)
                    else None,
                    "pct_of_memcpy": 100 * sp["gbps"] / mem["gbps"], **base})
                done += 1
                if progress:
                    print(f"[{done}/{steps}] {name:8s} {op:5s} {size:>9,d} B x {n:>6d}: "
                          f"{sp['gbps']:7.2f} GB/s", file=sys.stderr, flush=True)
    return points
