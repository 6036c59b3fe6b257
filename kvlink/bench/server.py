"""The bench server: per client a buffer, its transports' descriptors, and its half of each
``ucx_perftest``; one client after the other (:mod:`kvlink.bench` says the protocol)."""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import logging
import multiprocessing as mp
import os
import queue
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from kvlink.bench import wire
from kvlink.bench.facts import buffer, human, machine, start_versions, versions
from kvlink.demo.proc import child_main, describe, exit_reason
from kvlink.errors import AuthError, ConfigError, HandshakeError, TransferError, WireError
from kvlink.hostid import host_id
from kvlink.sidechannel import is_loopback
from kvlink.sockets import keepalive
from kvlink.transport import Region, Transport, TransportContext, create_transport

log = logging.getLogger("kvlink.bench")

HELLO_TIMEOUT = 30.0  # seconds a server waits for a connected client's auth, then its hello


def _die_with_us() -> None:
    """preexec_fn of ucx_perftest's server: it dies with the bench server, even on SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    """Whether something listens on host:port: a bind with SO_REUSEADDR fails only then (a
    connect would be taken for ucx_perftest's client)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _await_listener(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float) -> None:
    """Until ``proc`` listens on the port (or exits, or the timeout passes: the client's
    retries and its error say the rest)."""
    deadline = time.monotonic() + timeout
    while not _listening(host, port) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # polling interval: the condition is what we wait on


class _Session:
    """One client's buffer, transports and ucx_perftest server, on the server's side."""

    def __init__(self, conn: wire.Conn, bind: str, command: str, say: Callable[[str], None],
                 secret: bytes | None) -> None:
        self.conn, self.bind, self.command, self.say = conn, bind, command, say
        self.secret = secret
        self.transports: list[Transport] = []
        self.perftest: subprocess.Popen[bytes] | None = None
        self._keep: Any = None

    def _authenticate(self) -> wire.Message:
        """The challenge, and with a secret the client's proof and ours; the next message."""
        nonce = secrets.token_bytes(16) if self.secret is not None else b""
        self.conn.send(wire.Challenge(v=wire.PROTOCOL, nonce=nonce))
        msg = self.conn.recv(HELLO_TIMEOUT)
        if self.secret is None:
            return msg
        if not isinstance(msg, wire.Auth):
            raise AuthError(
                f"this bench server requires a shared secret, and {self.conn.peer} sent "
                f"{type(msg).__name__.lower()} instead: give the client the server's --secret "
                "(or KVLINK_SECRET)")
        if not 8 <= len(msg.nonce) <= 64 or not hmac.compare_digest(
                msg.mac, wire.proof(self.secret, wire.CLIENT_LABEL, nonce, msg.nonce)):
            raise AuthError(
                f"authentication of {self.conn.peer} failed: its secret is not this server's "
                "(give both sides the same --secret or KVLINK_SECRET)")
        self.conn.send(wire.Welcome(v=wire.PROTOCOL, mac=wire.proof(
            self.secret, wire.SERVER_LABEL, msg.nonce, nonce)))
        return self.conn.recv(HELLO_TIMEOUT)

    def run(self) -> None:
        hello = self._authenticate()
        if not isinstance(hello, wire.Hello):
            raise WireError(f"{self.conn.peer} sent {type(hello).__name__.lower()} where its "
                            "hello belongs")
        total, memory, names = hello.total, hello.memory, hello.transports
        try:
            self._keep, addr, device = buffer(total, memory, 1)
        except Exception as exc:  # MemoryError, no torch or GPU: the client says it
            self.conn.send(wire.error(describe(exc)))
            return
        local = self.conn.sock.getsockname()[0]  # the address this client reached us at
        offers: dict[str, wire.Offer] = {}
        for name in names:
            try:
                t = create_transport(name, TransportContext(
                    f"bench-server-{name}-{os.getpid()}-{time.monotonic_ns()}", host=self.bind,
                    advertise_host=local, host_id=host_id()))
            except Exception as exc:
                offers[name] = wire.Offer(error=describe(exc))
                continue
            self.transports.append(t)
            try:
                t.register([Region(addr, total, device)])
                offers[name] = wire.Offer(descriptor=t.descriptor(), addr=addr)
            except Exception as exc:
                offers[name] = wire.Offer(error=describe(exc))
        self.say(f"client {self.conn.peer}: {', '.join(names)}, {human(total)} "
                 f"{memory.upper()}")
        self.conn.send(wire.Ready(
            v=wire.PROTOCOL, transports=offers, versions=_versions(),
            machine=msgspec.convert(machine(), wire.Machine), command=self.command,
            host_id=host_id()))
        while True:
            msg = self.conn.recv(None)  # the client sweeps; we only serve
            if isinstance(msg, wire.PerftestStart):
                self._perftest_start(list(msg.args))
            elif isinstance(msg, wire.PerftestEnd):
                self.conn.send(wire.PerftestEnded(v=wire.PROTOCOL, rc=self._perftest_end()))
            elif isinstance(msg, wire.Bye):
                self.conn.send(wire.Bye(v=wire.PROTOCOL))
                return
            else:
                self.conn.send(wire.error(f"unexpected message {type(msg).__name__.lower()} "
                                          "from a client"))

    def _perftest_start(self, args: list[str]) -> None:
        from kvlink_transports import _ucx

        self._perftest_end()
        path = _ucx.ucx_perftest_path()
        if path is None:
            self.conn.send(wire.error("ucx_perftest not found on the server host "
                                      "(pip install --no-deps libucx-cu12)"))
            return
        port = _free_port(self.bind)
        cmd = [path, "-p", str(port), *args]
        self.perftest = subprocess.Popen(cmd, env=_ucx.ucx_env(path), stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=_die_with_us)
        _await_listener(self.perftest, self.bind, port, 10.0)  # the client's first try works
        self.conn.send(wire.PerftestReady(v=wire.PROTOCOL, port=port, command=shlex.join(cmd)))

    def _perftest_end(self) -> int | None:
        proc, self.perftest = self.perftest, None
        if proc is None:
            return None
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its client never came: it waits forever
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        if self.perftest is not None:
            self.perftest.kill()
            self.perftest.wait()
            self.perftest = None
        for t in self.transports:
            with contextlib.suppress(Exception):
                t.close()
        self.transports.clear()
        self._keep = None


def _versions() -> dict[str, Any]:
    """This host's versions as the ready message types them (a doctor that changed its
    answer's shape costs the record, not the run)."""
    try:
        found: dict[str, Any] = msgspec.convert(versions(), wire.Versions)
    except msgspec.ValidationError as exc:
        found = {"error": f"kvlink doctor's versions do not fit the bench protocol: {exc}"}
    return found


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM/SIGHUP stop the server like Ctrl-C: cleanly


def _print(line: str) -> None:
    print(line, flush=True)


def check_bind(bind: str, secret: bytes | None, insecure: bool) -> None:
    """Refuse an unauthenticated server on a non-loopback address unless told the network is
    trusted (as kvlink's side channel does); warn, one line, when told."""
    if secret is not None or is_loopback(bind):
        return
    if not insecure:
        raise ConfigError(
            f"--bind {bind}: refusing an unauthenticated bench server on a non-loopback "
            "address (anyone who reaches it could read and write its buffer): give a shared "
            "secret (--secret or KVLINK_SECRET, the same on the client), or --insecure on a "
            "network you trust")
    log.warning("UNAUTHENTICATED bench server on %s (--insecure): anyone who reaches it can "
                "read and write its buffer; set KVLINK_SECRET on both hosts instead", bind)


def serve(bind: str, port: int, once: bool = False, command: str = "kvlink bench --server",
          ready: Callable[[str, int], None] | None = None,
          say: Callable[[str], None] = _print, secret: bytes | None = None,
          insecure: bool = False) -> int:
    """Serve bench clients on ``bind:port`` one after the other (``once``: the first only).

    A non-loopback ``bind`` needs ``secret`` (clients then authenticate) or ``insecure``.
    The listening socket is closed however this ends (Ctrl-C, SIGTERM, SIGHUP: a KeyboardInterrupt
    here; an error), and every ucx_perftest it started is killed, so the port is free at once.
    A client that sends a bad frame (over the bound, cut, malformed, another protocol) or the
    wrong secret is answered an error naming it and closed; the next one is served.
    """
    check_bind(bind, secret, insecure)
    listener = socket.create_server((bind, port), backlog=8)  # SO_REUSEADDR on POSIX
    actual = int(listener.getsockname()[1])
    start_versions()  # every ready message carries them: found before a client asks
    try:
        if ready is not None:
            ready(bind, actual)
        while True:
            sock, addr = listener.accept()
            keepalive(sock, wire.KEEPALIVE_S)
            conn = wire.Conn(sock, f"{addr[0]}:{addr[1]}", wire.CLIENT_FRAME_BYTES)
            session = _Session(conn, bind, command, say, secret)
            try:
                session.run()
                say(f"client {conn.peer}: done")
            except (WireError, AuthError) as exc:  # garbage (the stream cannot resync), a
                conn.refuse(str(exc))  # wrong secret: say what to the client, then close
                say(f"client {conn.peer}: ended ({describe(exc)})")
            except (EOFError, OSError) as exc:  # the client left
                say(f"client {conn.peer}: ended ({describe(exc)})")
            finally:
                session.close()
                conn.close()
            if once:
                return 0
    finally:
        listener.close()


def run_server(bind: str, port: int, once: bool, command: str, secret: bytes | None = None,
               insecure: bool = False) -> int:
    """``kvlink bench --server``: :func:`serve`, saying where it listens (the line a script or
    test waits for), with SIGTERM and SIGHUP ending it like Ctrl-C."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)

    def said(host: str, actual: int) -> None:
        print(f"kvlink bench server: listening on {host}:{actual} (clients: kvlink bench HOST "
              f"--port {actual}; Ctrl-C stops it)", flush=True)

    return serve(bind, port, once, command, said, secret=secret, insecure=insecure)


def _local_server(q: Any, command: str, secret: bytes) -> None:
    """The one-host run's server child: 127.0.0.1, a free port, one client (its parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it (and it dies with it)
    serve("127.0.0.1", 0, True, command, lambda host, port: q.put(("listening", port)),
          log.debug, secret=secret)  # the parent's stdout is the table's


def _first_message(q: Any, proc: Any, timeout: float) -> Any:
    """The server's first message; its death or failure ends the wait at once, saying why."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.1)
        except queue.Empty:
            if proc.exitcode is not None:
                try:
                    msg = q.get(timeout=0.1)
                except queue.Empty:
                    raise TransferError(f"bench server {exit_reason(proc.exitcode)} before "
                                        "it was ready") from None
            elif time.monotonic() > deadline:
                proc.kill()
                raise TransferError(f"bench server not ready within {timeout:.0f}s") from None
            else:
                continue
        if isinstance(msg, tuple) and msg[:1] == ("failed",):
            proc.join(10)
            raise HandshakeError(f"bench server failed at start-up: {msg[2]}")
        return msg


@contextlib.contextmanager
def local_server(command: str, secret: bytes) -> Iterator[int]:
    """A bench server child on 127.0.0.1 for the one-host run: its port. It serves one client
    (who must know ``secret``: no other local user can take its place) and dies with this
    process (PR_SET_PDEATHSIG) whatever happens to it."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=child_main, args=(
        _local_server, logging.getLogger().getEffectiveLevel(), os.getpid(), q, 0, q, command,
        secret), name="kvlink-bench-server")
    proc.start()
    try:
        _kind, port = _first_message(q, proc, 120.0)
        yield int(port)
    finally:
        proc.join(30)  # it ends once our control connection closes
        if proc.exitcode is None:
            proc.kill()
            proc.join()
