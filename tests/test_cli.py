"""The ``kvlink`` command line, run as a real process (issue 25).

Every bad value ends the command within 5 s with one line, ``kvlink: error: ...``, naming it;
a child that dies ends its parent's wait at once, saying why; ``kvlink serve``'s ranks die
with it; ``kvlink pull`` gives up on a dead prefill after one handshake timeout. Nothing here
sleeps to synchronise: every wait polls a condition (an exit, a line, a free port) against a
deadline.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from procgroup import OWN_GROUP, kill_group

from kvlink.demo.run import free_port_range
from kvlink.doctor import cuda_section
from kvlink.sampling import SAMPLE_EVERY

KVLINK = [sys.executable, "-m", "kvlink.cli"]
SMALL = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "64"]
FAST = 5.0  # seconds: every bad value, every dead child, every killed parent


def kvlink(*args: str, timeout: float = FAST, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run([*KVLINK, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    return proc, time.monotonic() - t0


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvlink: error: "), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def _hide(tmp: Path, package: str) -> dict[str, str]:
    """An environment where ``import <package>`` fails, as on a machine without it."""
    d = tmp / f"hide-{package}"
    (d / package).mkdir(parents=True)
    (d / package / "__init__.py").write_text(
        f"raise ImportError({f'No module named {package} (hidden by the test)'!r})\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(d), *filter(None, [os.environ.get("PYTHONPATH")])])}


BAD_VALUES = [
    (["demo", "--tokens", "0"], ["--tokens", "0"]),
    (["demo", "--block-size", "0"], ["--block-size", "0"]),
    (["demo", "--layers", "0"], ["--layers", "0"]),
    (["demo", "--prefill-tp", "3"], ["--prefill-tp 3", "--kv-heads 8"]),
    (["demo", "--decode-tp", "3", "--kv-heads", "4"], ["--decode-tp 3", "--kv-heads 4"]),
    (["demo", "--requests", "0"], ["--requests", "0"]),
    (["demo", "--cache-gib", "0"], ["--cache-gib", "0"]),
    (["demo", "--cache-gib", "-1"], ["--cache-gib", "-1"]),
    (["demo", "--timeout", "0"], ["--timeout", "0"]),
    (["demo", "--timeout", "nan"], ["--timeout", "not a finite number"]),
    (["pull", "--handshake-timeout", "inf"], ["--handshake-timeout", "not a finite number"]),
    (["bench", "127.0.0.1", "--connect-timeout", "nan"], ["--connect-timeout", "finite"]),
    (["demo", "--handshake-timeout", "0"], ["--handshake-timeout", "0"]),
    (["demo", "--port", "70000"], ["--port 70000"]),
    (["demo", "--transport", "warp"], ["--transport warp", "unknown transport 'warp'", "tcp"]),
    (["demo", "--json", "/nonexistent-dir/r.json"], ["--json", "/nonexistent-dir"]),
    (["demo", "--json", "/tmp"], ["--json /tmp", "is a directory"]),
    (["demo", "--host", "nonexistent.invalid"], ["--host nonexistent.invalid", "resolve"]),
    (["demo", "--host", "10.255.255.1"], ["--host 10.255.255.1", "cannot be bound"]),
    (["serve", "--advertise-host", "nonexistent.invalid"], ["--advertise-host", "resolve"]),
    (["pull", "--remote-host", "nonexistent.invalid"], ["--remote-host", "resolve"]),
    (["demo", "--tokens", "1024", "--cache-gib", "0.01"],
     ["--cache-gib 0.01", "--tokens 1024", "128 MiB", "--cache-gib 0.125 at least"]),
    (["serve", "--port", "0"], ["--port 0"]),
    (["serve", "--lease-seconds", "0"], ["--lease-seconds", "0"]),
    (["serve", "--port", "65535", "--prefill-tp", "2"], ["--port 65535", "2 ranks"]),
    (["pull", "--remote-port", "70000"], ["--remote-port 70000"]),
    (["pull", "--tokens", "0"], ["--tokens", "0"]),
    (["bench", "--sizes", "4X"], ["--sizes", "4X"]),
    (["bench", "--sizes", "0"], ["--sizes", "0"]),
    (["bench", "--sizes", "1G", "--total-mib", "1"], ["--sizes 1 GiB", "--total-mib 1"]),
    (["bench", "--ops", "copy"], ["--ops", "copy"]),
    (["bench", "--transports", "foo"], ["--transports foo", "tcp"]),
    (["bench", "--reps", "0"], ["--reps", "0"]),
    (["bench", "--server", "--bind", "0.0.0.0"], ["--bind 0.0.0.0", "non-loopback", "--secret",
                                                  "KVLINK_SECRET", "--insecure"]),
    (["bench", "--insecure"], ["--insecure", "only with --server"]),
    (["bench", "--secret", "x"], ["--secret", "only with --server or HOST"]),
    (["probe", "not-a-url"], ["not-a-url"]),
    (["demo", "--no-such-option"], ["--no-such-option"]),
]


@pytest.mark.parametrize("args,named", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_value_is_one_line_exit_2(args: list[str], named: list[str]) -> None:
    proc, took = kvlink(*args)
    line = one_error_line(proc)
    assert proc.returncode == 2, (proc.returncode, line)
    for text in named:
        assert text in line, (text, line)
    assert took < FAST
    assert not proc.stdout  # nothing ran


def test_transport_library_missing_is_named_before_spawning(tmp_path: Path) -> None:
    """The real .venv has nixl: here it is hidden, as on a machine without it."""
    proc, _ = kvlink("demo", "--transport", "nixl", env=_hide(tmp_path, "nixl"))
    line = one_error_line(proc)
    assert proc.returncode == 2
    assert "--transport nixl" in line and "hidden by the test" in line, line


def test_vram_without_a_gpu_is_refused(tmp_path: Path) -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    except ImportError:
        pass
    proc, _ = kvlink("bench", "--memory", "vram", env=_hide(tmp_path, "torch"))
    line = one_error_line(proc)
    assert proc.returncode == 2 and "--memory vram" in line, line
    proc, _ = kvlink("bench", "--memory", "vram")  # with torch (CPU build): no device
    line = one_error_line(proc)
    assert proc.returncode == 2 and "--memory vram" in line, line


def test_probe_refused_url_is_one_line() -> None:
    port = free_port_range(1)  # nothing listens there
    url = f"http://127.0.0.1:{port}/metrics"
    proc, took = kvlink("probe", url)
    line = one_error_line(proc)
    assert proc.returncode != 0 and url in line and "refused" in line.lower(), line
    assert took < FAST


def test_version_and_help() -> None:
    proc, _ = kvlink("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "kvlink 0.1.0", proc.stdout
    proc, _ = kvlink("demo", "--help")
    assert proc.returncode == 0
    for text in ("--tokens", "Tokens per request", "default: 1024", "GiB", "-v, --verbose"):
        assert text in proc.stdout, text
    proc, _ = kvlink()
    assert proc.returncode == 2 and "demo" in proc.stderr


def test_integrity_help_says_how_much_sample_checks() -> None:
    """The help states the rate kvlink.sampling applies (it said one block in 32 while
    ``sample`` checked one in 64)."""
    proc, _ = kvlink("demo", "--help")
    text = " ".join(proc.stdout.split())
    assert f"about 1 block in {SAMPLE_EVERY} per request" in text, text


def test_verbosity_anywhere_reaches_the_ranks() -> None:
    """-vv after the command: the decode and prefill ranks (spawned) log at DEBUG/INFO in
    the parent's format; -q before it: not even their warnings."""
    proc, _ = kvlink("demo", *SMALL, "--requests", "2", "--no-progress", "-vv", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " kvlink-decode-0 kvlink.worker INFO " in proc.stderr, proc.stderr[-2000:]
    assert " kvlink-prefill-0 kvlink." in proc.stderr, proc.stderr[-2000:]
    port = free_port_range(1)
    quiet, _ = kvlink("-q", "pull", *SMALL, "--remote-port", str(port), "--no-progress",
                      "--handshake-timeout", "0.5", timeout=60)
    loud, _ = kvlink("pull", *SMALL, "--remote-port", str(port), "--no-progress",
                     "--handshake-timeout", "0.5", timeout=60)
    assert quiet.returncode == loud.returncode == 1
    assert "kvlink-decode-0 kvlink.worker WARNING" in loud.stderr, loud.stderr
    assert "WARNING" not in quiet.stderr, quiet.stderr


# ------------------------------------------------------------------- children that die
def test_rank_failing_at_startup_ends_demo_with_its_reason() -> None:
    """A real cause: the prefill's side-channel port is taken. The demo ends at once, in one
    line naming the rank, the port and why (before: a traceback, then 'not ready within
    300s')."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, took = kvlink("demo", *SMALL, "--port", str(port), "--no-progress")
    line = one_error_line(proc)
    assert proc.returncode == 1
    assert "kvlink-prefill-0 failed at start-up" in line and f":{port}" in line, line
    assert "in use" in line, line
    assert took < FAST


def _children(pid: int) -> list[int]:
    """Spawned children of ``pid`` (multiprocessing's ``spawn_main``), oldest first."""
    out = []
    for p in (int(x) for x in os.listdir("/proc") if x.isdigit()):
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmd:
            out.append((int(stat[19]), p))  # field 22: start time
    return [p for _, p in sorted(out)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_decode_rank_killed_at_startup_ends_demo_at_once() -> None:
    """The decode rank is SIGKILLed as soon as it exists (while it allocates its cache). The
    demo ends within 5 s, naming it and the signal."""
    proc = subprocess.Popen([*KVLINK, "demo", "--requests", "4", "--cache-gib", "0.5",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **OWN_GROUP)
    try:
        deadline = time.monotonic() + 120
        while len(kids := _children(proc.pid)) < 2:  # prefill first, then the decode
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the decode rank never started"
        os.kill(kids[-1], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        assert proc.returncode == 1, out + err
        assert "FAILED kvlink-decode-0: killed by SIGKILL" in out, out + err
        assert re.search(r"verified +NO", out), out
        assert took < FAST, took
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_bench_records_mask_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line goes into the JSON and the server's ready message: never a secret."""
    from kvlink.cli import bandwidth as cli

    monkeypatch.setattr(cli, "_ARGV", ["bench", "h", "--secret", "s1", "--secret=s2", "--port",
                                       "1"])
    assert cli._bench_command() == "kvlink bench h --secret *** --secret=*** --port 1"


def test_bench_server_dying_at_startup_ends_bench_at_once(tmp_path: Path) -> None:
    """A real cause: the server cannot allocate its buffer (95 TiB). Before: the bench waited
    300 s on the server's queue."""
    proc, took = kvlink("bench", "--transports", "tcp", "--sizes", "4K",
                        "--total-mib", "100000000", "--out", str(tmp_path), timeout=30)
    line = one_error_line(proc)
    assert proc.returncode == 1 and "bench server failed at start-up" in line, line
    assert "MemoryError" in line
    assert took < FAST


# ------------------------------------------------------------------- serve and pull
def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` again: bound as servers bind (SO_REUSEADDR,
    as socket.create_server and uvicorn set), so a listener holds it and a TIME_WAIT does not.
    A plain bind also fails for the 60 s TIME_WAIT of a connection the server closed (a health
    check's): the launcher's SIGTERM test failed in CI on exactly that, every process gone."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``kvlink serve`` with 2 prefill ranks, ready (its ``--json`` in tmp_path/serve.json);
    a process group of its own, so the test can clean up whatever is left whatever the
    outcome."""
    port = free_port_range(2)
    proc = subprocess.Popen([*KVLINK, "serve", *SMALL, "--prefill-tp", "2",
                             "--port", str(port), "--cache-gib", "0.01",
                             "--json", str(tmp_path / "serve.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **OWN_GROUP)
    assert proc.stdout is not None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=120), "kvlink serve not ready within 120 s"
        line = proc.stdout.readline()
        assert line.startswith("serving 2 prefill rank(s)"), (line, proc.stderr.read())
        assert not _port_free(port) and not _port_free(port + 1)
        yield proc, port
    finally:
        kill_group(proc)


def test_pull_reads_every_request_a_serve_holds(serve: tuple[subprocess.Popen[str], int],
                                                tmp_path: Path) -> None:
    """The two-host flow in its default mode (pull), on one host: every request verified, and
    the serve then ends by itself, its lease accounting in its --json file. A pull is a
    process of its own: it announces each READ and is told the hold's generation (before, it
    READ with generations of its own drawing, and every request failed: "the hold it was told
    ended before its READ"; and serve wrote no --json file)."""
    proc, port = serve
    out, _ = kvlink("pull", *SMALL, "--prefill-tp", "2", "--remote-port", str(port),
                    "--cache-gib", "0.01", "--no-progress", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "yes, every byte" in out.stdout and "FAILED" not in out.stdout, out.stdout
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    leases = json.loads((tmp_path / "serve.json").read_text())["prefill_leases"]
    assert leases, leases


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_serve_ranks_die_with_their_parent(serve: tuple[subprocess.Popen[str], int],
                                           sig: signal.Signals) -> None:
    """Only the parent is signalled (not its group): its ranks go too, and both ports are
    free within 5 s."""
    proc, port = serve
    ranks = _children(proc.pid)
    assert len(ranks) == 2
    os.kill(proc.pid, sig)
    t0 = time.monotonic()
    deadline = t0 + FAST
    while not (_port_free(port) and _port_free(port + 1)
               and not any(_alive(r) for r in ranks)):
        assert time.monotonic() < deadline, (
            f"after SIG{sig.name[3:]}: ports {port}, {port + 1} free: "
            f"{_port_free(port)}, {_port_free(port + 1)}; ranks alive: "
            f"{[r for r in ranks if _alive(r)]}")
        time.sleep(0.02)  # polling interval (the condition is what we wait on)
    proc.wait(timeout=FAST)


def test_pull_from_dead_prefill_gives_up_after_one_handshake_timeout() -> None:
    """24 requests in waves of 6 (a 0.1 MiB cache); nothing listens. Before: every wave
    waited out its own handshake timeout (4 x 10 s)."""
    port = free_port_range(1)
    hs = 2.0
    proc, took = kvlink("pull", *SMALL, "--requests", "24", "--cache-gib", "0.0001",
                        "--remote-port", str(port), "--handshake-timeout", str(hs),
                        "--no-progress", "-q", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"127.0.0.1:{port} within {hs}s" in proc.stdout, proc.stdout
    assert "not tried: gave up on the prefill" in proc.stdout, proc.stdout
    assert took < hs + 3.0, took  # one handshake timeout, plus interpreter and rank start-up


# ------------------------------------------------------------------- the report
def _result(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "verified": False, "transport": "tcp", "mode": "pull", "requests": 2, "tokens": 64,
        "bytes": 0, "seconds": 0.0, "gbps": 0.0, "raw_descriptors": 0, "descriptors": 0,
        "prefill_tp": 1, "decode_tp": 2, "decode_reported": 0, "requests_verified": 0,
        "integrity": "off", "integrity_checked_blocks": 0, "failed": {},
        "rank_failures": {"kvlink-decode-0": "killed by SIGKILL"},
        "leaks": None, "prefill_reported": 0}
    base.update(kw)
    return base


def test_report_prints_only_collected_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlink.cli import _report

    assert _report(_result(), None) == 1
    out = capsys.readouterr().out
    assert "not collected (no decode rank reported)" in out
    assert re.search(r"prefill blocks still held +not collected \(0 of 1 prefill ranks", out)
    assert "GB/s" not in out and "descriptors after" not in out
    assert "FAILED kvlink-decode-0: killed by SIGKILL" in out
    _report(_result(decode_reported=1, bytes=4096, seconds=1.0, requests_verified=2,
                    leaks=0, prefill_reported=1), None)
    out = capsys.readouterr().out
    assert "(1 of 2 decode ranks reported)" in out and re.search(r"still held +0\n", out)


# ------------------------------------------------------------------- bench output
def test_bench_writes_to_cwd_or_out_only(tmp_path: Path) -> None:
    """Sizes with units; the files land in the current directory (or --out), never in the
    source tree."""
    repo = Path(__file__).resolve().parents[1]
    before = {p: p.stat().st_mtime_ns for p in (repo / "bench" / "results").glob("*")}
    cwd = tmp_path / "here"
    cwd.mkdir()
    args = ["bench", "--transports", "tcp", "--ops", "read", "--sizes", "4K,8K",
            "--total-mib", "1", "--reps", "1"]
    proc, _ = kvlink(*args, cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((cwd / "bandwidth.json").read_text())
    assert [p["block_bytes"] for p in doc["points"]] == [4096, 8192]
    out = tmp_path / "elsewhere" / "deeper"
    proc, _ = kvlink(*args, "--out", str(out), "--json", "b.json", cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "b.json").is_file()
    after = {p: p.stat().st_mtime_ns for p in (repo / "bench" / "results").glob("*")}
    assert after == before


def test_demo_runs_without_torch(tmp_path: Path) -> None:
    """The core and `kvlink demo` over tcp need no torch (it is the `torch` extra)."""
    proc, _ = kvlink("demo", *SMALL, "--requests", "2", "--no-progress",
                     env=_hide(tmp_path, "torch"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "yes, every byte" in proc.stdout


def test_doctor_strict_exits_on_warnings_and_prints_json() -> None:
    """``--json -`` prints the report as JSON; ``--strict`` exits 1 exactly when it holds a
    warning (before, doctor exited 0 always)."""
    proc, _ = kvlink("doctor", "--no-probe", "--json", "-", timeout=60)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    strict, _ = kvlink("doctor", "--no-probe", "--strict", timeout=60)
    assert strict.returncode == (1 if rep["warnings"] else 0), strict.stdout[-2000:]
    assert "warnings" in strict.stdout


# ------------------------------------------------------------------- --device (issue 25)
def _fake_torch(tmp: Path, available: bool, count: int) -> dict[str, str]:
    """An environment whose ``torch`` is a CUDA build that sees ``count`` devices (or none):
    what the parent checks, without a GPU."""
    d = tmp / f"fake-torch-{available}-{count}"
    (d / "torch").mkdir(parents=True)
    (d / "torch" / "__init__.py").write_text(
        "import types\n__version__ = '2.11.0+cu130'\n"
        "version = types.SimpleNamespace(cuda='13.0', hip=None)\n"
        f"cuda = types.SimpleNamespace(is_available=lambda: {available}, "
        f"device_count=lambda: {count})\n")
    return {**os.environ, "PYTHONPATH": str(d)}


DEVICE_VALUES = [
    (["demo", "--device", "gpu"], ["--device gpu", "not a device", "cuda:N"]),
    (["demo", "--device", "cuda:x"], ["--device cuda:x", "not a device"]),
    (["demo", "--device", "cpu:0"], ["--device cpu:0", "not a device"]),
    (["serve", "--device", "tpu"], ["--device tpu", "not a device"]),
    (["demo", "--decode-device", "gpu"], ["--decode-device gpu", "not a device"]),
    (["demo", "--transport", "cuda_ipc"], ["--transport cuda_ipc", "cannot move cpu memory",
                                           "--device cuda"]),
    (["demo", "--transport", "tcp,warp"], ["--transport warp", "unknown transport 'warp'"]),
    (["demo", "--transport", ","], ["--transport", "name at least one"]),
]


@pytest.mark.parametrize("args,named", DEVICE_VALUES, ids=[" ".join(a) for a, _ in DEVICE_VALUES])
def test_bad_device_or_transport_list_is_one_line_exit_2(args: list[str],
                                                         named: list[str]) -> None:
    proc, took = kvlink(*args)
    line = one_error_line(proc)
    assert proc.returncode == 2, (proc.returncode, line)
    for text in named:
        assert text in line, (text, line)
    assert took < FAST and not proc.stdout


@pytest.mark.skipif(cuda_section()["available"], reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", ["demo", "serve", "pull"])
def test_device_cuda_without_cuda_is_one_line_naming_why(command: str, tmp_path: Path) -> None:
    """No CUDA here: the parent says why in one line within 5 s (before: no such option; a
    CUDA run needs the caches in VRAM, which the demo could not do)."""
    try:
        import torch  # noqa: F401

        proc, took = kvlink(command, "--device", "cuda")  # the CPU build of torch
        line = one_error_line(proc)
        assert proc.returncode == 2 and took < FAST, (proc.returncode, took)
        assert line.startswith("kvlink: error: --device cuda: ") and "CPU-only" in line, line
    except ImportError:
        pass
    proc, took = kvlink(command, "--device", "cuda:0", env=_hide(tmp_path, "torch"))
    line = one_error_line(proc)
    assert proc.returncode == 2 and took < FAST
    assert line.startswith("kvlink: error: --device cuda:0: "), line
    assert "torch failed to import" in line and "hidden by the test" in line, line


def test_verbose_says_which_default_transports_were_skipped(tmp_path: Path) -> None:
    """A CUDA build of torch (faked) without nixl: -v says the default list dropped it (the
    line was logged before logging was set up, and lost)."""
    env = _fake_torch(tmp_path, True, 1)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"],
                                         _hide(tmp_path, "nixl")["PYTHONPATH"]])
    proc, _ = kvlink("-v", "demo", "--device", "cuda", "--port", "70000", env=env)
    assert proc.returncode == 2  # (the bad port: nothing ran)
    assert "default transport skipped: nixl" in proc.stderr, proc.stderr


def test_device_n_missing_or_no_device_is_named(tmp_path: Path) -> None:
    """A CUDA build of torch (faked) that sees 1 device, or none."""
    one = _fake_torch(tmp_path, True, 1)
    proc, took = kvlink("demo", "--device", "cuda:1", env=one)
    line = one_error_line(proc)
    assert proc.returncode == 2 and took < FAST
    assert "--device cuda:1: no device 1: torch sees 1 CUDA device (cuda:0)" in line, line
    proc, _ = kvlink("demo", "--device", "cuda", "--decode-device", "cuda:3", env=one)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "--decode-device cuda:3: no device 3" in line, line
    proc, _ = kvlink("pull", "--device", "cuda:0", env=_fake_torch(tmp_path, False, 0))
    line = one_error_line(proc)
    assert proc.returncode == 2, line
    assert "--device cuda:0: torch 2.11.0+cu130 (CUDA 13.0) sees no CUDA device" in line, line


def test_default_transport_list_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the default list is cuda_ipc, nixl, tcp, keeping those usable here, in order;
    on the CPU it is tcp."""
    import kvlink.cli.transfer as cli

    def args(**kw: Any) -> Any:
        base = dict(layers=1, kv_heads=1, head_dim=1, block_size=1, layout="NHD", mla=False,
                    requests=1, tokens=1, prefill_tp=1, decode_tp=1, transport=None,
                    device="cpu", mode="pull", integrity="off", cache_gib=1.0, timeout=1.0,
                    handshake_timeout=1.0, json_path=None, no_progress=True)
        base.update(kw)
        return cli._Args(**base)  # type: ignore[arg-type]

    assert cli._transports(args()) == "tcp"
    # faked: this machine has nixl installed and no GPU; the list logic under test needs a
    # host where nixl does not import, which the real check cannot be made to say on demand
    monkeypatch.setattr(cli, "transport_problem",
                        lambda n: "its library failed to import" if n == "nixl" else None)
    assert cli._transports(args(device="cuda:0")) == "cuda_ipc,tcp"
    assert cli._transports(args(device="cuda:0", decode_device="cpu")) == "tcp"  # not cuda_ipc
    with pytest.raises(click.UsageError, match="--transport nixl: its library"):
        cli._transports(args(device="cuda:0", transport="cuda_ipc,nixl"))


def test_torch_fill_and_verify_match_numpy_bit_for_bit() -> None:
    """The GPU path (torch ops; run here on torch's CPU device) writes the very words the numpy
    path does, for every layout, and its verify counts every mismatching element."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from kvlink.demo import data

    for geo, tp, rank in [(data.Geometry(layers=3, kv_heads=4, head_dim=16, block_size=4), 2, 1),
                          (data.Geometry(layers=2, kv_heads=4, head_dim=8, block_size=4,
                                         layout="HND"), 1, 0),
                          (data.Geometry(layers=2, kv_heads=1, head_dim=64, block_size=8,
                                         mla=True), 1, 0)]:
        ref, ref_layers = data.allocate(geo, 12, tp, rank)
        data.fill(geo, ref_layers, tp, rank)
        buf, layers = data.allocate_torch(geo, 12, tp, rank, "cpu")
        data.fill(geo, layers, tp, rank)
        assert np.array_equal(ref, buf.numpy().view(np.uint16)), geo
        ids = np.array([5, 0, 11, 3], dtype=np.int64)
        assert data.verify(geo, layers, tp, rank, ids, ids) == 0
        swapped = ids[[1, 0, 2, 3]]
        bad = data.verify(geo, ref_layers, tp, rank, ids, swapped)
        assert bad > 0 and data.verify(geo, layers, tp, rank, ids, swapped) == bad
        buf.view(torch.uint8)[7] ^= 1  # one bit of one byte
        assert data.verify(geo, layers, tp, rank, np.arange(12), np.arange(12)) == 1
    blocks = np.array([0, 7, 2**20, 2**31 - 1, 4_000_000_000], dtype=np.int64)  # key wraps
    geo = data.Geometry(layers=64, kv_heads=8, head_dim=256)
    for layer, kv in [(0, 0), (63, 1), (2000, 1)]:
        got = data.pattern_torch(geo, layer, kv, torch.as_tensor(blocks), 3, 5)
        assert np.array_equal(got.numpy().view(np.uint16),
                              data.pattern(geo, layer, kv, blocks, 3, 5))


# ------------------------------------------------------------------- progress (issue 25)
def test_progress_lines_in_a_log_phases_then_landed_then_verify() -> None:
    """stderr is no terminal (a CI log): a line per start-up phase, then the transfer at every
    10 % as requests land, with GB/s — all before verification starts; --no-progress: none."""
    proc, _ = kvlink("demo", *SMALL, "--requests", "10", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert all(ln.startswith("kvlink: ") for ln in lines), lines
    text = "\n".join(lines)
    for phase in ("starting 1 prefill rank (cpu, tcp)", "prefill: allocating the KV cache",
                  "prefill: filling the KV cache", "prefill: registering the cache with tcp",
                  "starting 1 decode rank", "decode: handshake with the prefill at 127.0.0.1:"):
        assert phase in text, (phase, text)
    landed = [i for i, ln in enumerate(lines) if "requests landed" in ln]
    verify = [i for i, ln in enumerate(lines) if "verifying every byte" in ln]
    assert landed and verify and max(landed) < min(verify), text
    assert "10/10 requests landed" in lines[max(landed)] and "GB/s" in lines[max(landed)]
    assert len(landed) <= 11, text  # a line per 10 %, not per poll
    quiet, _ = kvlink("demo", *SMALL, "--requests", "2", "--no-progress", timeout=120)
    assert quiet.returncode == 0 and not quiet.stderr.strip(), quiet.stderr
    assert re.search(r"device \(prefill -> decode\) +cpu -> cpu", quiet.stdout), quiet.stdout


def test_progress_on_a_terminal_is_a_rich_bar() -> None:
    """On a terminal (rich): the phase on its own line, the bar advancing with requests and
    GB/s; the numbers are the decode ranks' totals."""
    import io

    pytest.importorskip("rich")
    from kvlink.demo.progress import Display

    out = io.StringIO()
    d = Display(True, total=4, stream=out, live=True)
    d.phase("starting 1 prefill rank (cpu, tcp)")
    d.rank_phase("decode", 0, 2, "registering the cache with tcp")
    d.landed(0, 1, 1 << 30, 0.5)
    d.landed(1, 2, 1 << 30, 1.0)
    d.close()
    text = out.getvalue()
    assert "decode: registering the cache with tcp [1/2 ranks]" in text, text
    assert "3/4" in text and "2.15 GB/s" in text, text  # 2 GiB over 1 s (the slower rank)
    plain = io.StringIO()
    d = Display(True, total=4, stream=plain, live=False)
    for n in range(1, 5):
        d.landed(0, n, n << 20, 0.1 * n)
    d.close()
    assert plain.getvalue().count("requests landed") == 4, plain.getvalue()
