"""The ``kvlink`` command: demo, serve, pull, doctor."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvlink.errors import KVLinkError


def _geometry_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("geometry (default: Llama-3-8B-like)")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8, help="total KV heads across TP ranks")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16, help="tokens per block")
    g.add_argument("--layout", choices=["NHD", "HND"], default="NHD")
    g.add_argument("--mla", action="store_true", help="one latent per token (head-dim = latent)")
    r = p.add_argument_group("requests and placement")
    r.add_argument("--requests", type=int, default=8)
    r.add_argument("--tokens", type=int, default=1024, help="tokens per request")
    r.add_argument("--prefill-tp", type=int, default=1)
    r.add_argument("--decode-tp", type=int, default=1)
    r.add_argument("--transport", default="tcp", help="any registered transport")
    r.add_argument("--mode", choices=["pull", "push"], default="pull",
                   help="pull: decode READs (NIXL style); push: prefill WRITEs (Mooncake style)")
    r.add_argument("--integrity", choices=["off", "sample", "full"], default="off",
                   help="check the KV that landed against the prefill's digests (pull mode): "
                        "sample = about 1 block in 32 per request, full = every block")
    r.add_argument("--cache-gib", type=float, default=1.0, help="KV cache per instance")
    r.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    r.add_argument("--json", metavar="PATH", help="write the results as JSON")
    r.add_argument("--no-progress", action="store_true")


def _plan(args: argparse.Namespace, port: int) -> Any:
    from kvlink.demo.data import Geometry
    from kvlink.demo.roles import DemoPlan
    from kvlink.transport import load_transport

    load_transport(args.transport)  # unknown names fail here, listing the registered ones
    if args.integrity != "off" and args.mode == "push":
        raise SystemExit("kvlink: error: --integrity covers pull mode only (a push's "
                         "'written' carries no digest yet)")
    geo = Geometry(layers=args.layers, kv_heads=1 if args.mla else args.kv_heads,
                   head_dim=args.head_dim, block_size=args.block_size, layout=args.layout,
                   mla=args.mla)
    return DemoPlan(
        geo=geo, requests=args.requests, tokens=args.tokens, prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp, transport=args.transport, host=args.host,
        advertise_host=getattr(args, "advertise_host", None), port=port,
        cache_bytes=int(args.cache_gib * (1 << 30)), timeout=args.timeout, mode=args.mode,
        integrity=args.integrity,
    )


def _report(result: dict[str, Any], json_path: str | None) -> int:
    rows = [
        ("transport", result["transport"]),
        ("tp (prefill -> decode)", f"{result['prefill_tp']} -> {result['decode_tp']}"),
        ("requests", f"{result['requests']} x {result['tokens']} tokens"),
        ("bytes", f"{result['bytes']:,} ({result['bytes'] / 2**20:.1f} MiB)"),
        ("descriptors before coalescing", f"{result['raw_descriptors']:,}"),
        ("descriptors after coalescing", f"{result['descriptors']:,}"),
        ("seconds", f"{result['seconds']:.3f}"),
        ("GB/s", f"{result['gbps']:.2f}"),
        ("verified", "yes, every byte" if result["verified"] else "NO"),
    ]
    if result.get("integrity", "off") != "off":
        rows.append(("integrity", f"{result['integrity']}: "
                                  f"{result['integrity_checked_blocks']:,} blocks' digests match"))
    if "leaks" in result:
        rows.append(("prefill blocks still held", str(result["leaks"])))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    for req, reason in sorted(result.get("failed", {}).items()):
        print(f"  FAILED {req}: {reason}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["verified"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlink.demo.run import free_port_range, run_demo

    port = args.port or free_port_range(args.prefill_tp, args.host)
    return _report(run_demo(_plan(args, port), not args.no_progress), args.json)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops serving like Ctrl-C: the ranks are stopped too


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until every request was read (or Ctrl-C / SIGTERM). Exits 1 when a rank died
    (an exception, a signal) or had to be killed: its traceback is above, in its log."""
    import signal

    from kvlink.demo.run import Serving

    signal.signal(signal.SIGTERM, _interrupt)
    serving = Serving(_plan(args, args.port))
    try:
        serving.wait_ready(timeout=300)
        print(f"serving {args.prefill_tp} prefill rank(s) on {args.host}:{args.port}"
              f"..{args.port + args.prefill_tp - 1}; waiting for readers (Ctrl-C stops)",
              flush=True)
        stats = serving.wait_served(timeout=args.timeout * max(1, args.requests) + 600)
        print(json.dumps({"prefill_leases": stats}))
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
    dead = serving.failures()
    for name, code in sorted(dead.items()):
        print(f"kvlink: error: {name} exited with code {code}", file=sys.stderr)
    return 1 if dead else 0


def cmd_pull(args: argparse.Namespace) -> int:
    import dataclasses

    from kvlink.demo.run import run_pull

    plan = dataclasses.replace(_plan(args, args.remote_port), advertise_host=args.remote_host)
    return _report(run_pull(plan, not args.no_progress), args.json)


def cmd_doctor(args: argparse.Namespace) -> int:
    from kvlink.doctor import run_doctor

    return run_doctor(json_out=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvlink.benchsweep import main as bench_main

    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvlink", description="KV-cache transfer between "
                                 "prefill and decode instances")
    ap.add_argument("-v", "--verbose", action="count", default=0)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="prefill + decode processes on this machine, bytes verified")
    _geometry_args(d)
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=0, help="side channel base port (0: pick free)")
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("serve", help="the prefill half: fill a KV cache and serve it")
    _geometry_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for other hosts)")
    s.add_argument("--advertise-host", default=None, help="address peers dial (default --host)")
    s.add_argument("--port", type=int, default=5600, help="side channel base port")
    s.set_defaults(func=cmd_serve)
    p = sub.add_parser("pull", help="the decode half: pull from a `kvlink serve` and verify")
    _geometry_args(p)
    p.add_argument("--host", default="127.0.0.1", help="local bind address")
    p.add_argument("--remote-host", default="127.0.0.1")
    p.add_argument("--remote-port", type=int, default=5600)
    p.set_defaults(func=cmd_pull)
    b = sub.add_parser("bench", help="bandwidth sweep vs ucx_perftest/memcpy (see --help)",
                       add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    sub.add_parser("probe", help="achieved bandwidth of a decode server from its /metrics",
                   add_help=False)
    doc = sub.add_parser("doctor", help="what this machine can do: RDMA, CUDA IPC, UCX, NIXL")
    doc.add_argument("--json", metavar="PATH")
    doc.set_defaults(func=cmd_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser: every option passes through untouched
        from kvlink.benchsweep import main as bench_main

        logging.basicConfig(level=logging.WARNING)
        return bench_main(argv[1:])
    if argv[:1] == ["probe"]:
        from kvlink.probe import main as probe_main

        return probe_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except KVLinkError as exc:
        print(f"kvlink: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
