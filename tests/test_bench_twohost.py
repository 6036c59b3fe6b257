"""`kvlink bench` as a two-host tool: ``kvlink bench --server`` in one process, ``kvlink bench
HOST`` in another (real processes on 127.0.0.1, the tcp transport), against the one-host run.

Why each test is here: the two-shell run must print the table the one-host run prints (same
rows and columns) and record the commands and versions of both sides; a client pointed at a
closed port must end within its timeout with one line naming host:port; a server stopped by
Ctrl-C, SIGTERM or even SIGKILL must leave no port bound (its ucx_perftest child included).
The control protocol (kvlink.bench.wire): a bad frame (over its bound, malformed, JSON, another
version, cut) is answered with an error naming it and closed, and the server serves the next
client; a server on a non-loopback address needs a secret or --insecure; with a secret a client
must prove it (a wrong or missing one is refused, saying so).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from procgroup import OWN_GROUP, kill_group

from kvlink.bench import wire
from kvlink.errors import WireError, WireVersionError

KVLINK = [sys.executable, "-m", "kvlink.cli"]
#: the environment of every process here: no KVLINK_SECRET from the caller's (a test gives one)
ENV = {k: v for k, v in os.environ.items() if k != "KVLINK_SECRET"}
#: a small sweep: two block sizes, tcp only, READ (WRITE takes the same path: one more
#: ucx_perftest of ~1 s per size); the ucx_perftest baselines stay in
SWEEP = ["--transports", "tcp", "--ops", "read", "--sizes", "4K,16K", "--total-mib", "1",
         "--reps", "2"]
FAST = 5.0  # seconds: a refused client, a stopped server
START = 60.0  # seconds: ucx_perftest's start-up (about 1 s idle; over 15 s seen on 2 loaded cores)


def _port_free(port: int) -> bool:
    """Whether a server could listen on the port now: SO_REUSEADDR, as every server sets it
    (ours too), so the TIME_WAIT of a closed session's connection does not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_free(port: int, what: str) -> None:
    deadline = time.monotonic() + FAST
    while not _port_free(port):
        assert time.monotonic() < deadline, f"{what}: port {port} still bound after {FAST} s"
        time.sleep(0.02)  # polling interval (the condition is what we wait on)


class Lines:
    """A process's stdout line by line, each waited for with a deadline (select on the pipe,
    our own buffer: a buffered readline would hide a second line from select)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), b""

    def next(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while b"\n" not in self.buf:
                left = deadline - time.monotonic()
                assert left > 0 and sel.select(timeout=left), f"no line within {timeout} s"
                chunk = os.read(self.fd, 65536)
                assert chunk, f"stdout closed; stderr: {self._stderr()}"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        self.proc.kill()
        return self.proc.stderr.read().decode()


@contextlib.contextmanager
def _serving(*args: str, env: dict[str, str] | None = None,
             host: str = "127.0.0.1") -> Iterator[tuple[subprocess.Popen[bytes], int, Lines]]:
    """``kvlink bench --server --port 0 ARGS``, ready: its listening line says the port. Killed
    with its session whatever the outcome."""
    proc = subprocess.Popen([*KVLINK, "bench", "--server", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            **OWN_GROUP, env=env or ENV)
    out = Lines(proc)
    try:
        line = out.next(60)
        assert line.startswith(f"kvlink bench server: listening on {host}:"), line
        port = int(line.split(f"{host}:", 1)[1].split()[0])
        assert not _port_free(port)
        yield proc, port, out
    finally:
        kill_group(proc)


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[bytes], int, Lines]]:
    """``kvlink bench --server`` with no --bind (127.0.0.1 by default) and no secret."""
    with _serving() as served:
        yield served


def _connect(port: int) -> wire.Conn:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return wire.Conn(sock, f"127.0.0.1:{port}", wire.SERVER_FRAME_BYTES)


def _session(port: int, transports: list[str], secret: bytes | None = None
             ) -> tuple[wire.Conn, wire.Ready]:
    """A client's start, by hand: the challenge (answered with ``secret``), hello, ready."""
    conn = _connect(port)
    ch = conn.recv(30)
    assert isinstance(ch, wire.Challenge) and bool(ch.nonce) == (secret is not None), ch
    if secret is not None:
        mine = secrets.token_bytes(16)
        conn.send(wire.Auth(v=wire.PROTOCOL, nonce=mine,
                            mac=wire.proof(secret, wire.CLIENT_LABEL, ch.nonce, mine)))
        welcome = conn.recv(30)
        assert isinstance(welcome, wire.Welcome), welcome
        assert welcome.mac == wire.proof(secret, wire.SERVER_LABEL, mine, ch.nonce)
    conn.send(wire.Hello(v=wire.PROTOCOL, total=4096, memory="dram", transports=transports))
    ready = conn.recv(30)
    assert isinstance(ready, wire.Ready), ready
    return conn, ready


def _refused(conn: wire.Conn) -> str:
    """The server's error for what we sent, and then the end of the connection."""
    msg = conn.recv(FAST)
    assert isinstance(msg, wire.Error), msg
    with pytest.raises((EOFError, ConnectionResetError)):
        conn.recv(FAST)
    conn.close()
    return msg.message


def _rows(stdout: str) -> tuple[str, list[tuple[str, ...]]]:
    """The table's header and each row's name (transport, op, block, batch, iterations)."""
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("transport "))
    rows = []
    for ln in lines[head + 1:]:
        if not ln.startswith(("tcp ", "nixl ", "mooncake ", "cuda_ipc ")):
            break
        cells = ln.split()
        assert len(cells) == len(lines[head].split()), ln
        rows.append(tuple(cells[:5]))
    return lines[head], rows


def test_two_processes_print_the_one_host_table(
        server: tuple[subprocess.Popen[bytes], int, Lines], tmp_path: Path) -> None:
    """The one-host run and the two-process run at once (they wait on UCX wire-up more than
    they compute; only the table's shape is compared, not its figures)."""
    _proc, port, out = server
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ENV)
            for cmd in ([*KVLINK, "bench", *SWEEP, "--out", str(tmp_path / "one")],
                        [*KVLINK, "bench", "127.0.0.1", "--port", str(port), *SWEEP,
                         "--out", str(tmp_path / "two")])]
    done = [(r, *r.communicate(timeout=120)) for r in runs]
    for r, stdout, stderr in done:
        assert r.returncode == 0, stdout + stderr
    one, two = (subprocess.CompletedProcess(r.args, r.returncode, o, e) for r, o, e in done)
    head1, rows1 = _rows(one.stdout)
    head2, rows2 = _rows(two.stdout)
    assert head1 == head2
    for col in ("block", "batch", "iters", "GB/s", "lat_avg_us", "lat_p99_us", "kmsg/s",
                "perftest", "memcpy"):
        assert col in head1.split(), head1
    assert rows1 == rows2 == [("tcp", "read", f"{size:,d}", str((1 << 20) // size), "2")
                              for size in (4096, 16384)]
    assert out.next(10).startswith("client 127.0.0.1:")  # the server saw the session
    assert out.next(10).endswith(": done")

    doc = json.loads((tmp_path / "two" / "bandwidth.json").read_text())
    assert doc["command"].startswith(f"kvlink bench 127.0.0.1 --port {port}")
    assert doc["server"]["address"] == f"127.0.0.1:{port}"
    assert doc["server"]["command"].startswith("kvlink bench --server")
    for side in ("client", "server"):
        assert {"nixl", "ucx_in_nixl", "ucx_libucx_wheel", "mooncake"} <= set(
            doc["versions"][side]), doc["versions"]
    for p in doc["points"]:
        assert p["iterations"] == 2 and len(p["iter_seconds"]) == 2 and p["warmup"] == 1
        assert p["gbps_min"] <= p["gbps"] <= p["gbps_max"]
        key = "ucx_perftest_get" if p["op"] == "read" else "ucx_perftest_put"
        pt = p[key]
        if "error" not in pt:  # ucx_perftest ran between the two processes: its commands
            assert " 127.0.0.1 -p " in pt["client_command"], pt
            assert pt["server_command"].split()[0].endswith("ucx_perftest"), pt
            assert f"-s {p['block_bytes']}" in pt["client_command"]
    assert "local only" in doc["baselines"]["memcpy"]


def test_client_to_a_closed_port_fails_within_its_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    proc = subprocess.run([*KVLINK, "bench", "127.0.0.1", "--port", str(port),
                           "--connect-timeout", "1", *SWEEP], capture_output=True, text=True,
                          timeout=30, env=ENV)
    took = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kvlink: error: "), proc.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "Traceback" not in proc.stderr
    assert took < 1 + FAST, took


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_stopped_server_frees_its_port(server: tuple[subprocess.Popen[bytes], int, Lines],
                                       sig: signal.Signals) -> None:
    """Stopped in the middle of a session (a client connected, tcp registered): it says so,
    exits 130, and its control port is free at once."""
    proc, port, _out = server
    conn, ready = _session(port, ["tcp"])
    try:
        offer = ready.transports["tcp"]
        assert offer.error is None and offer.descriptor and offer.addr, offer
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=FAST) == 130
    finally:
        conn.close()
    assert proc.stderr is not None and b"kvlink: interrupted" in proc.stderr.read()
    _wait_free(port, f"after SIG{sig.name[3:]}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_killed_server_takes_its_perftest_with_it(
        server: tuple[subprocess.Popen[bytes], int, Lines]) -> None:
    """SIGKILL (no clean-up runs): the ucx_perftest server it started for a client must not
    outlive it holding its port."""
    proc, port, _out = server
    conn, _ready = _session(port, [])
    with contextlib.closing(conn):
        conn.send(wire.PerftestStart(v=wire.PROTOCOL, args=[]))
        msg = conn.recv(30)
        if isinstance(msg, wire.Error):
            pytest.skip(msg.message)  # no ucx_perftest here
        assert isinstance(msg, wire.PerftestReady), msg
        perf = msg.port
        deadline = time.monotonic() + START
        while _port_free(perf):  # ucx_perftest's server is listening
            assert time.monotonic() < deadline, f"ucx_perftest never listened on {perf}"
            time.sleep(0.02)  # polling interval (the condition is what we wait on)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=FAST)
    _wait_free(perf, "ucx_perftest after its bench server's SIGKILL")
    _wait_free(port, "bench server after SIGKILL")


def test_cli_default_port_is_the_servers() -> None:
    """cli.py keeps its own copy (importing kvlink.bench would slow --help down)."""
    from kvlink.bench import DEFAULT_PORT
    from kvlink.cli import _BENCH_PORT

    assert _BENCH_PORT == DEFAULT_PORT


# ------------------------------------------------------------------- the control protocol
def _frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return wire.FRAME.pack(len(body)) + body


_HELLO = {"type": "hello", "v": wire.PROTOCOL, "total": 4096, "memory": "dram",
          "transports": ["tcp"]}
#: (what a client sends after the challenge, what the server's error must say)
BAD_FRAMES = [
    (wire.FRAME.pack(1 << 20), f"control frame of {1 << 20} B"),  # only the length: no hang
    (wire.FRAME.pack(5) + b"\xc1\xc1\xc1\xc1\xc1", "malformed control frame"),  # not msgpack
    (_frame({**_HELLO, "total": "4096"}), "`$.total`"),
    (_frame({**_HELLO, "memory": "hbm"}), "`$.memory`"),
    (_frame({**_HELLO, "shell": "rm -rf /"}), "unknown field `shell`"),
    (_frame({"type": "launch", "v": wire.PROTOCOL}), "`$.type`"),
    (_frame({**_HELLO, "v": 99}), "protocol 99, this side"),
    (_frame({k: v for k, v in _HELLO.items() if k != "v"}), "no version field"),
    (b'{"kind": "hello", "protocol": 1, "total": 4096}\n', "looks like JSON"),  # kvlink <= 1
]


def test_bad_frames_are_named_and_the_next_client_is_served(
        server: tuple[subprocess.Popen[bytes], int, Lines]) -> None:
    """Each bad frame: an error naming it, the connection closed at once (an oversized length
    is refused before its body: nothing waits for 1 MiB that never comes); then a good client
    gets its ready and a clean bye."""
    _proc, port, out = server
    for raw, named in BAD_FRAMES:
        t0 = time.monotonic()
        conn = _connect(port)
        assert isinstance(conn.recv(30), wire.Challenge)
        conn.sock.sendall(raw)
        message = _refused(conn)
        assert named in message, (named, message)
        assert time.monotonic() - t0 < FAST
        line = out.next(FAST)
        assert "ended (Wire" in line and named in line, line  # WireError, WireVersionError
    conn, ready = _session(port, ["tcp"])
    with contextlib.closing(conn):
        assert ready.transports["tcp"].error is None, ready.transports
        conn.send(wire.Bye(v=wire.PROTOCOL))
        assert isinstance(conn.recv(FAST), wire.Bye)
    assert out.next(FAST).endswith(": tcp, 4 KiB DRAM")
    assert out.next(FAST).endswith(": done")


def test_control_messages_decode_strictly_and_frames_are_bounded() -> None:
    ready = wire.Ready(v=wire.PROTOCOL, transports={"tcp": wire.Offer(b"\x00\xff", 4096)},
                       versions={"nixl": {"nixl": "1.5"}, "torch": None, "kvlink": "0.1"},
                       machine=wire.Machine("h", "linux", "x86_64", 2, "cpu", {}),
                       command="kvlink bench --server", host_id="h1")
    assert wire.decode(wire.encode(ready)[wire.FRAME.size:], "peer") == ready
    doc = msgspec.to_builtins(ready)
    doc["transports"]["tcp"]["descriptor"] = "AP8="  # base64 in a string: not a descriptor
    with pytest.raises(WireError, match=r"malformed control frame from peer.*descriptor"):
        wire.decode(msgspec.msgpack.encode(doc), "peer")
    with pytest.raises(WireVersionError, match="protocol 1, this side"):
        wire.decode(msgspec.msgpack.encode({**doc, "v": 1}), "peer")

    a, b = socket.socketpair()
    with contextlib.closing(a), contextlib.closing(b):
        conn = wire.Conn(b, "peer", bound=100, frame_timeout=0.2)
        a.sendall(wire.FRAME.pack(101))
        with pytest.raises(WireError, match="control frame of 101 B from peer exceeds the 100 B"):
            conn.recv(FAST)
    a, b = socket.socketpair()
    with contextlib.closing(a), contextlib.closing(b):
        conn = wire.Conn(b, "peer", bound=100, frame_timeout=0.2)
        a.sendall(wire.FRAME.pack(10)[:2])  # a frame started, never finished
        t0 = time.monotonic()
        with pytest.raises(WireError, match=r"not complete within 0.2 s \(2 of 4 B\)"):
            conn.recv(FAST)
        assert time.monotonic() - t0 < 1
        a.sendall(wire.FRAME.pack(10)[2:] + b"abc")
    a, b = socket.socketpair()
    with contextlib.closing(b):
        conn = wire.Conn(b, "peer", bound=100)
        a.sendall(wire.FRAME.pack(10) + b"abc")
        a.close()
        with pytest.raises(WireError, match="cut after 3 of 10 B"):
            conn.recv(FAST)


def test_insecure_non_loopback_bind_warns_once() -> None:
    """(Without --insecure it is refused: tests/test_cli.py's BAD_VALUES.)"""
    with _serving("--bind", "0.0.0.0", "--insecure", host="0.0.0.0") as (proc, _port, _out):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stderr is not None
        lines = [ln for ln in proc.stderr.read().decode().splitlines() if ln.strip()]
    assert len(lines) == 1 and "UNAUTHENTICATED bench server on 0.0.0.0" in lines[0], lines


def test_a_secret_server_refuses_a_wrong_or_missing_secret(tmp_path: Path) -> None:
    """The server's secret from KVLINK_SECRET, on 127.0.0.1: a client with the wrong one (a real
    ``kvlink bench HOST``) and one without are refused, each saying why, and the server serves
    the next; the right one runs the sweep, and no record holds the secret."""
    from kvlink.bench import BenchPeer, SweepConfig
    from kvlink.errors import AuthError

    with _serving(env={**ENV, "KVLINK_SECRET": "right-one"}) as (_proc, port, out):
        bad = subprocess.run([*KVLINK, "bench", "127.0.0.1", "--port", str(port), "--secret",
                              "wrong-one", *SWEEP, "--out", str(tmp_path)], capture_output=True,
                             text=True, timeout=60, env=ENV)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 1 and len(lines) == 1, bad.stdout + bad.stderr
        assert lines[0].startswith(f"kvlink: error: bench server at 127.0.0.1:{port} refused "
                                   "this client: authentication of 127.0.0.1:"), lines[0]
        assert "its secret is not this server's" in lines[0], lines[0]
        assert "ended (AuthError: authentication of" in out.next(FAST)

        peer = BenchPeer("127.0.0.1", port, FAST)  # no secret
        with contextlib.closing(peer), pytest.raises(AuthError, match="requires a shared secr"):
            peer.hello(SweepConfig(total=4096, transports=[]), [])
        assert "ended (EOFError" in out.next(FAST)
        conn = _connect(port)  # by hand: a hello where the proof belongs
        assert isinstance(conn.recv(FAST), wire.Challenge)
        conn.send(wire.Hello(v=wire.PROTOCOL, total=4096, memory="dram", transports=[]))
        assert "requires a shared secret" in _refused(conn)
        assert "ended (AuthError" in out.next(FAST)

        good = subprocess.run([*KVLINK, "bench", "127.0.0.1", "--port", str(port), "--secret",
                               "right-one", *SWEEP, "--no-perftest", "--sizes", "4K", "--out",
                               str(tmp_path)], capture_output=True, text=True, timeout=120,
                              env=ENV)
        assert good.returncode == 0, good.stdout + good.stderr
        record = (tmp_path / "bandwidth.json").read_text()
        assert "right-one" not in record and "wrong-one" not in record
        assert json.loads(record)["command"].startswith(
            f"kvlink bench 127.0.0.1 --port {port} --secret *** ")


def test_a_secret_client_refuses_a_server_without_one(
        server: tuple[subprocess.Popen[bytes], int, Lines]) -> None:
    from kvlink.bench import BenchPeer, SweepConfig
    from kvlink.errors import AuthError

    peer = BenchPeer("127.0.0.1", server[1], FAST, b"a-secret")
    with contextlib.closing(peer), pytest.raises(AuthError, match="has no secret, this client"):
        peer.hello(SweepConfig(total=4096, transports=[]), [])
