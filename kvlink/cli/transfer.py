"""``kvlink demo``, ``serve`` and ``pull``: prefill and decode ranks moving KV caches, every
byte verified — their shared options, the checks of those options against this machine, the
plan the ranks run, and the report printed at the end."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any

import click

from kvlink.cli.options import (
    _CONTEXT,
    _POS_FLOAT,
    _POS_INT,
    _TP,
    CUDA_TRANSPORTS,
    F,
    _bad,
    _bindable_host,
    _opt,
    _port_range,
    _resolvable_host,
    _setup_logging,
    _verbosity,
    _writable_file,
    device_problem,
    memory_problem,
    transport_problem,
)
from kvlink.errors import KVLinkError
from kvlink.sampling import SAMPLE_EVERY


def _geometry(f: F) -> F:
    """Geometry, requests and placement options shared by demo, serve and pull."""
    opts = [
        _opt("--layers", type=_POS_INT, default=32, help="Transformer layers (KV caches)."),
        _opt("--kv-heads", type=_POS_INT, default=8, help="KV heads in total, over all TP ranks."),
        _opt("--head-dim", type=_POS_INT, default=128,
             help="Elements per head (with --mla: the latent width), bf16."),
        _opt("--block-size", type=_POS_INT, default=16, help="Tokens per KV block."),
        _opt("--layout", type=click.Choice(["NHD", "HND"]), default="NHD",
             help="Block layout: tokens before heads (NHD) or heads before tokens (HND)."),
        _opt("--mla", is_flag=True, help="One latent per token (MLA); --kv-heads is ignored."),
        _opt("--requests", type=_POS_INT, default=8, help="Requests to move."),
        _opt("--tokens", type=_POS_INT, default=1024, help="Tokens per request."),
        _opt("--prefill-tp", type=_TP, default=1,
             help="Prefill TP ranks (processes); must divide --kv-heads or be a multiple."),
        _opt("--decode-tp", type=_TP, default=1,
             help="Decode TP ranks (processes); must divide --kv-heads or be a multiple."),
        _opt("--transport", default=None, metavar="NAME[,NAME...]",
             show_default="tcp; with --device cuda: " + ",".join(CUDA_TRANSPORTS),
             help="A registered transport (tcp, nixl, mooncake, cuda_ipc, or a plugin), or a "
                  "comma-separated list tried in order per peer. The default list on CUDA "
                  "skips those whose library is missing."),
        _opt("--device", default="cpu", metavar="cpu|cuda[:N]",
             help="Where the KV cache lives: host memory, or torch tensors on GPU N (data "
                  "filled and verified there). demo: both prefill and decode."),
        _opt("--mode", type=click.Choice(["pull", "push"]), default="pull",
             help="pull: decode READs (NIXL style); push: prefill WRITEs (Mooncake style)."),
        _opt("--integrity", type=click.Choice(["off", "sample", "full"]), default="off",
             help="Check the KV that landed against the prefill's digests (pull and push): "
                  f"sample = about 1 block in {SAMPLE_EVERY} per request and its last, "
                  "full = every block."),
        _opt("--cache-gib", type=_POS_FLOAT, default=1.0,
             help="KV cache per instance, GiB (split over its ranks)."),
        _opt("--timeout", type=_POS_FLOAT, default=60.0,
             help="Seconds per request: a run gives up after S x --requests in all."),
        _opt("--handshake-timeout", type=_POS_FLOAT, default=10.0,
             help="Seconds to reach a peer before giving up on it."),
        _opt("--json", "json_path", metavar="PATH", default=None,
             help="Also write the results as JSON to PATH."),
        _opt("--no-progress", is_flag=True,
             help="Nothing on stderr but logs and errors: no phase lines, no progress bar."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@dataclasses.dataclass
class _Args:
    """The parsed options of demo/serve/pull, as the plan wants them."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    layout: str
    mla: bool
    requests: int
    tokens: int
    prefill_tp: int
    decode_tp: int
    transport: str | None
    device: str
    mode: str
    integrity: str
    cache_gib: float
    timeout: float
    handshake_timeout: float
    json_path: str | None
    no_progress: bool
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    decode_device: str | None = None


def _args(kw: dict[str, Any]) -> _Args:
    names = {f.name for f in dataclasses.fields(_Args)}
    return _Args(**{k: v for k, v in kw.items() if k in names})


def _check(a: _Args) -> None:
    """Every value of demo/serve/pull, before anything is spawned."""
    from kvlink.errors import IncompatibleSpecError
    from kvlink.headmap import check_tp

    if not a.mla:
        for opt, tp in (("--prefill-tp", a.prefill_tp), ("--decode-tp", a.decode_tp)):
            try:
                check_tp(a.kv_heads, tp, opt[2:])
            except IncompatibleSpecError:
                raise click.UsageError(
                    f"{opt} {tp} and --kv-heads {a.kv_heads}: {a.kv_heads} KV heads cannot be "
                    f"split over {tp} ranks (one must divide the other)") from None
    if a.cache_gib * (1 << 30) < 1:
        raise _bad("--cache-gib", a.cache_gib, "less than a byte")
    _fits_cache(a)
    _writable_file("--json", a.json_path)
    _bindable_host("--host", a.host)
    if a.advertise_host is not None:
        _resolvable_host("--advertise-host", a.advertise_host)
    for opt in ("--device", "--decode-device"):
        value = getattr(a, opt[2:].replace("-", "_"))
        if value is None:
            continue
        norm, why = device_problem(value)
        if why is not None:
            raise _bad(opt, value, why)
        setattr(a, opt[2:].replace("-", "_"), norm)
    a.transport = _transports(a)


def _fits_cache(a: _Args) -> None:
    """One request must fit each rank's share of --cache-gib (requests move in waves of what
    fits; a request larger than the cache was allocated whole, past the limit)."""
    from kvlink.demo.data import Geometry

    geo = Geometry(layers=a.layers, kv_heads=1 if a.mla else a.kv_heads,
                   head_dim=a.head_dim, block_size=a.block_size, layout=a.layout, mla=a.mla)
    blocks = -(-a.tokens // a.block_size)
    for side, tp in (("prefill", a.prefill_tp), ("decode", a.decode_tp)):
        need = blocks * geo.block_bytes(tp)
        if a.cache_gib * (1 << 30) / tp < need:
            raise _bad("--cache-gib", a.cache_gib,
                       f"one request of --tokens {a.tokens} takes {need / 2**20:.3g} MiB on each "
                       f"of the {side}'s {tp} rank(s): --cache-gib "
                       f"{need * tp / 2**30:.3g} at least")


def _transports(a: _Args) -> str:
    """The transport list, checked: an explicit one must be usable as given; the default one
    (tcp; on CUDA cuda_ipc, nixl, tcp) keeps what is usable here, in order."""
    kinds = {d.split(":")[0] for d in (a.device, a.decode_device or a.device)}
    explicit = a.transport is not None
    if a.transport is not None:
        names = [n.strip() for n in a.transport.split(",") if n.strip()]
        if not names:
            raise _bad("--transport", repr(a.transport), "name at least one transport")
    else:
        names = list(CUDA_TRANSPORTS) if "cuda" in kinds else ["tcp"]
    usable, skipped = [], []
    for n in names:
        try:  # the memory kinds first: cuda_ipc on a CPU cache is wrong on any machine
            why = memory_problem(n, kinds)
        except KVLinkError:  # unknown, or its library is missing: said next
            why = None
        why = why or transport_problem(n)
        if why is None:
            usable.append(n)
        elif explicit:
            raise click.UsageError(f"--transport {n}: {why}")
        else:
            skipped.append(f"{n}: {why}")
    if not usable:
        raise _bad("--device", a.device, "no transport of the default list is usable: "
                   + "; ".join(skipped))
    for why in skipped:
        logging.getLogger("kvlink.cli").info("default transport skipped: %s", why)
    return ",".join(usable)


def _plan(a: _Args, port: int) -> Any:
    from kvlink.demo.data import Geometry
    from kvlink.demo.roles import DemoPlan

    geo = Geometry(layers=a.layers, kv_heads=1 if a.mla else a.kv_heads, head_dim=a.head_dim,
                   block_size=a.block_size, layout=a.layout, mla=a.mla)
    return DemoPlan(
        geo=geo, requests=a.requests, tokens=a.tokens, prefill_tp=a.prefill_tp,
        decode_tp=a.decode_tp, transport=a.transport or "tcp", host=a.host,
        advertise_host=a.advertise_host, port=port, cache_bytes=int(a.cache_gib * (1 << 30)),
        timeout=a.timeout, mode=a.mode, integrity=a.integrity,
        handshake_timeout=a.handshake_timeout, device=a.device, decode_device=a.decode_device,
    )


def _report(result: dict[str, Any], json_path: str | None) -> int:
    """Print only figures that were collected: a rank that did not report is said so."""
    n, got = result["decode_tp"], result.get("decode_reported", result["decode_tp"])
    missing = "not collected (no decode rank reported)" if got == 0 else None
    part = f" ({got} of {n} decode ranks reported)" if 0 < got < n else ""
    tried = result.get("transports") or [result["transport"]]
    used = result["transport"]
    rows = [
        ("transport", used + (f" (tried in order: {', '.join(tried)})" if len(tried) > 1
                              else "")),
        ("device (prefill -> decode)", f"{result.get('device', 'cpu')} -> "
                                       f"{result.get('decode_device', 'cpu')}"),
        ("tp (prefill -> decode)", f"{result['prefill_tp']} -> {result['decode_tp']}"),
        ("requests", f"{result['requests']} x {result['tokens']} tokens"),
    ]
    if missing:
        rows.append(("bytes, descriptors, seconds", missing))
    else:
        rows += [
            ("requests verified", f"{result.get('requests_verified', 0)} of "
                                  f"{result['requests'] * n}"
                                  + (f" ({result['requests']} x {n} decode ranks)" if n > 1
                                     else "") + part),
            ("bytes", f"{result['bytes']:,} ({result['bytes'] / 2**20:.1f} MiB){part}"),
        ]
        desc_from = "prefill" if result.get("mode") == "push" else "decode"
        if desc_from == "prefill" and result.get("prefill_reported", 0) == 0:
            rows.append(("descriptors", "not collected (no prefill rank reported)"))
        else:
            rows += [("descriptors before coalescing", f"{result['raw_descriptors']:,}"),
                     ("descriptors after coalescing", f"{result['descriptors']:,}")]
        rows += [("seconds", f"{result['seconds']:.3f}"), ("GB/s", f"{result['gbps']:.2f}")]
        if result.get("integrity", "off") != "off":
            rows.append(("integrity", f"{result['integrity']}: "
                                      f"{result['integrity_checked_blocks']:,} blocks' digests "
                                      "match"))
    rows.append(("verified", "yes, every byte" if result["verified"] else "NO"))
    if "leaks" in result:
        leaks = result["leaks"]
        rows.append(("prefill blocks still held", str(leaks) if leaks is not None else
                     f"not collected ({result.get('prefill_reported', 0)} of "
                     f"{result['prefill_tp']} prefill ranks reported)"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    for name, reason in sorted(result.get("rank_failures", {}).items()):
        print(f"  FAILED {name}: {reason}")
    by_reason: dict[str, list[str]] = {}
    for req in sorted(result.get("failed", {}), key=_req_key):
        by_reason.setdefault(result["failed"][req], []).append(req)
    for reason, reqs in list(by_reason.items())[:10]:
        names = ", ".join(reqs[:3]) + (f" and {len(reqs) - 3} more" if len(reqs) > 3 else "")
        print(f"  FAILED {names}: {reason}")
    if len(by_reason) > 10:
        print(f"  ... and {len(by_reason) - 10} more reasons (--json has every request)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["verified"] else 1


def _req_key(req: str) -> tuple[int, str]:
    num = req.removeprefix("req-")
    return (int(num), req) if num.isdecimal() else (1 << 62, req)


@click.command(context_settings=_CONTEXT)
@_geometry
@_opt("--host", default="127.0.0.1", help="Address every rank binds (side channel, data).")
@_opt("--port", type=int, default=0,
      help="Prefill side-channel base port: rank r listens on PORT + r (0: pick free ports).")
@_opt("--decode-device", default=None, metavar="cpu|cuda[:N]",
      help="Where the decode's KV cache lives (default: --device).")
@_verbosity
def demo(port: int, **kw: Any) -> int:
    """Prefill and decode ranks as processes on this machine, every byte verified.

    The prefill fills its KV cache with data derived from (layer, K|V, block, token, head);
    the decode pulls (or is pushed) every request into a fragmented cache and checks it.
    With --device cuda the caches are torch tensors on the GPU, filled and verified there.
    Exit code 0: every byte verified; 1: a failure (printed); 2: a bad value.
    """
    a = _args(kw)
    _setup_logging()  # (first: the checks log the default transports they skip)
    _check(a)
    _port_range("--port", port, a.prefill_tp, allow_zero=True)
    from kvlink.demo.run import free_port_range, run_demo

    base = port or free_port_range(a.prefill_tp, a.host)
    return _report(run_demo(_plan(a, base), not a.no_progress), a.json_path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops serving like Ctrl-C: the ranks are stopped too


@click.command(context_settings=_CONTEXT)
@_geometry
@_opt("--host", default="127.0.0.1", help="Bind address (0.0.0.0 for other hosts).")
@_opt("--advertise-host", default=None, help="Address peers dial (default: --host).")
@_opt("--port", type=int, default=5600,
      help="Side-channel base port: rank r listens on PORT + r.")
@_opt("--lease-seconds", type=_POS_FLOAT, default=120.0,
      help="How long each request stays held for its reader (a READ after it is refused).")
@_verbosity
def serve(port: int, lease_seconds: float, **kw: Any) -> int:
    """The prefill half: fill a KV cache and serve it until every request was read.

    Stops on Ctrl-C or SIGTERM; its ranks die with it even on SIGKILL (Linux). Exit code 1
    when a rank died (an exception, a signal) or had to be killed.
    """
    import signal

    a = _args(kw)
    _setup_logging()  # (first: the checks log the default transports they skip)
    _check(a)
    _port_range("--port", port, a.prefill_tp, allow_zero=False)
    from kvlink.demo.progress import Display
    from kvlink.demo.run import Serving

    signal.signal(signal.SIGTERM, _interrupt)
    plan = dataclasses.replace(_plan(a, port), lease_seconds=lease_seconds)
    display = Display(not a.no_progress)
    serving = Serving(plan, display)
    try:
        try:
            serving.wait_ready(timeout=300)
        finally:
            display.close("prefill ranks ready")
        print(f"serving {a.prefill_tp} prefill rank(s) on {a.host}:{port}"
              f"..{port + a.prefill_tp - 1}; waiting for readers (Ctrl-C stops)", flush=True)
        stats = serving.wait_served(timeout=a.timeout * max(1, a.requests) + 600)
        print(json.dumps({"prefill_leases": stats}))
        if a.json_path:
            with open(a.json_path, "w") as f:
                json.dump({"prefill_leases": stats}, f, indent=2)
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
    dead = serving.failures()
    reasons = {serving.procs[r].name: why for r, why in serving.reasons.items()}
    for name, code in sorted(dead.items()):
        why = f" ({reasons[name]})" if name in reasons else ""
        print(f"kvlink: error: {name} exited with code {code}{why}", file=sys.stderr)
    return 1 if dead else 0


@click.command(context_settings=_CONTEXT)
@_geometry
@_opt("--host", default="127.0.0.1", help="Local bind address.")
@_opt("--remote-host", default="127.0.0.1", help="Host of the `kvlink serve` to pull from.")
@_opt("--remote-port", type=int, default=5600, help="Its side-channel base port.")
@_verbosity
def pull(remote_host: str, remote_port: int, **kw: Any) -> int:
    """The decode half: pull every request from a `kvlink serve` and verify it.

    Use the same geometry options as the serve (a mismatch fails at the handshake, naming
    both values). A prefill that cannot be reached is given up on once, after
    --handshake-timeout seconds.
    """
    a = _args(kw)
    _setup_logging()  # (first: the checks log the default transports they skip)
    _check(a)
    _port_range("--remote-port", remote_port, a.prefill_tp, allow_zero=False)
    _resolvable_host("--remote-host", remote_host)
    from kvlink.demo.run import run_pull

    plan = dataclasses.replace(_plan(a, remote_port), advertise_host=remote_host,
                               decode_device=a.device, told_generations=False)
    result = run_pull(plan, not a.no_progress)
    result["device"] = "remote"  # the serve's: not known here
    return _report(result, a.json_path)

