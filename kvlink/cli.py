"""The ``kvlink`` command: demo, serve, pull, bench, probe, doctor (docs/cli.md).

Every value is checked here, in the parent, before a process is spawned: a bad one ends the
command with one line, ``kvlink: error: ...`` naming it, and exit code 2. ``-v``/``-q`` are
taken anywhere on the line (before or after the command) and reach the child processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvlink import __version__
from kvlink.errors import KVLinkError

F = TypeVar("F", bound=Callable[..., Any])
_VERBOSITY = "kvlink.verbosity"
MAX_TP = 4096  # kvlink.wire.MAX_TP (not imported here: keeps --help fast)
#: a transport's library, imported in the parent to tell "not installed" before spawning
_TRANSPORT_NEEDS = {"nixl": "nixl._api", "mooncake": "mooncake.engine", "cuda_ipc": "torch"}
_CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True,
            "max_content_width": 100}


# ----------------------------------------------------------------------------- verbosity
def _count(ctx: click.Context, param: click.Parameter, value: int) -> None:
    if value:
        meta = ctx.find_root().meta
        meta[_VERBOSITY] = meta.get(_VERBOSITY, 0) + (value if param.name == "verbose"
                                                      else -value)


def _verbosity(f: F) -> F:
    """-v/-q on the group and on every command: accepted before or after the command name."""
    f = click.option("-q", "--quiet", count=True, expose_value=False, callback=_count,
                     help="Less log output: -q errors only, -qq nothing below critical.")(f)
    f = click.option("-v", "--verbose", count=True, expose_value=False, callback=_count,
                     help="More log output: -v info, -vv debug (child processes too).")(f)
    return f


def log_level(ctx: click.Context | None = None) -> int:
    ctx = ctx or click.get_current_context()
    v = int(ctx.find_root().meta.get(_VERBOSITY, 0))
    return min(logging.CRITICAL, max(logging.DEBUG, logging.WARNING - 10 * v))


def _setup_logging() -> None:
    from kvlink.demo.proc import setup_logging

    setup_logging(log_level())


# ----------------------------------------------------------------------------- values
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``1M``, ``64MB`` -> bytes (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M, G: 4K, 1M)")
    return int(m.group(1)) * _UNIT[m.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, each at least 1 byte."""
    out = []
    for part in text.split(","):
        n = parse_size(part)
        if n < 1:
            raise ValueError(f"{part.strip()!r} is not a positive size")
        out.append(n)
    return out


def _bad(option: str, value: object, why: str) -> click.UsageError:
    """A bad value found after parsing: the one line names the option and the value."""
    return click.UsageError(f"{option} {value}: {why}")


def _port_range(option: str, port: int, n: int, allow_zero: bool) -> None:
    if allow_zero and port == 0:
        return
    if not 1 <= port <= 65535 - (n - 1):
        top = 65535 - (n - 1)
        raise _bad(option, port, f"must be 1..{top}" + (" or 0 (pick free ports)" if allow_zero
                                                         else "")
                   + (f" (rank r uses {option[2:]} + r, {n} ranks)" if n > 1 else ""))


def transport_problem(name: str) -> str | None:
    """Why ``name`` cannot be used on this machine (not registered, its library missing), or
    None. Imports the transport's library: the children would, a moment later."""
    from kvlink.transport import load_transport

    try:
        load_transport(name)
    except KVLinkError as exc:
        return str(exc)
    mod = _TRANSPORT_NEEDS.get(name)
    if mod is None:
        return None
    try:
        importlib.import_module(mod)
    except Exception as exc:  # ImportError, or a library that fails to load (OSError)
        return (f"transport {name!r} needs the {mod.split('.')[0]} package, which failed to "
                f"import ({type(exc).__name__}: {exc}); README's transport table names it")
    if name == "cuda_ipc":
        import torch

        if not torch.cuda.is_available():
            return "transport 'cuda_ipc' needs a CUDA device; torch sees none"
    return None


_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d{1,4}))?$")
#: the transports a CUDA cache tries, in this order, per peer (the first that reaches the pair
#: of memories is used): CUDA IPC on one host, then NIXL, then tcp (staged through host memory)
CUDA_TRANSPORTS = ("cuda_ipc", "nixl", "tcp")


def device_problem(device: str) -> tuple[str, str | None]:
    """``device`` normalised (``cuda`` -> ``cuda:0``), and why it cannot be used here (torch
    missing or CPU-only, no CUDA device, no device N), or None."""
    m = _DEVICE.match(device.strip())
    if not m or (m.group(1) == "cpu" and m.group(2)):
        return device, "not a device: cpu, cuda or cuda:N"
    if m.group(1) == "cpu":
        return "cpu", None
    idx = int(m.group(2) or 0)
    norm = f"cuda:{idx}"
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install (OSError loading libs)
        return norm, (f"needs torch with CUDA, and torch failed to import "
                      f"({type(exc).__name__}: {' '.join(str(exc).split())})")
    ver = getattr(torch, "__version__", "?")
    cuda_ver = getattr(torch.version, "cuda", None)
    if cuda_ver is None and getattr(torch.version, "hip", None) is None:
        return norm, (f"this torch ({ver}) is a CPU-only build (torch.version.cuda is None); "
                      "install a CUDA build of torch")
    if not torch.cuda.is_available():
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        return norm, (f"torch {ver} (CUDA {cuda_ver}) sees no CUDA device "
                      "(torch.cuda.is_available() is False"
                      + (f"; CUDA_VISIBLE_DEVICES={vis!r}" if vis is not None else "") + ")")
    count = int(torch.cuda.device_count())
    if idx >= count:
        have = "cuda:0" if count == 1 else f"cuda:0..cuda:{count - 1}"
        return norm, (f"no device {idx}: torch sees {count} CUDA device"
                      + ("s" if count != 1 else "") + (f" ({have})" if count else ""))
    return norm, None


def memory_problem(name: str, kinds: set[str]) -> str | None:
    """Why transport ``name`` cannot move memory of these kinds ("cpu", "cuda"), or None."""
    from kvlink.transport import load_transport

    have = load_transport(name).capabilities.memory_kinds
    missing = sorted(kinds - set(have))
    if missing:
        return (f"transport {name!r} cannot move {'/'.join(missing)} memory (it moves "
                f"{', '.join(sorted(have))} memory)"
                + ("; --device cuda puts the caches on a GPU" if "cpu" in missing else ""))
    return None


def _writable_file(option: str, path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise _bad(option, path, f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise _bad(option, path, f"directory {parent} is not writable")


# ----------------------------------------------------------------------------- demo options
def _opt(*decls: str, **kw: Any) -> Callable[[F], F]:
    return click.option(*decls, **kw)


_POS_INT = click.IntRange(min=1)
_POS_FLOAT = click.FloatRange(min=0, min_open=True)
_TP = click.IntRange(1, MAX_TP)


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
                  "sample = about 1 block in 32 per request, full = every block."),
        _opt("--cache-gib", type=_POS_FLOAT, default=1.0,
             help="KV cache per instance, GiB (split over its ranks)."),
        _opt("--timeout", type=_POS_FLOAT, default=60.0, help="Seconds per request."),
        _opt("--handshake-timeout", type=_POS_FLOAT, default=10.0,
             help="Seconds to reach a peer before giving up on it."),
        _opt("--json", "json_path", metavar="PATH", default=None,
             help="Also write the results as JSON to PATH."),
        _opt("--no-progress", is_flag=True, help="No progress bar on stderr."),
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
    _writable_file("--json", a.json_path)
    for opt in ("--device", "--decode-device"):
        value = getattr(a, opt[2:].replace("-", "_"))
        if value is None:
            continue
        norm, why = device_problem(value)
        if why is not None:
            raise _bad(opt, value, why)
        setattr(a, opt[2:].replace("-", "_"), norm)
    a.transport = _transports(a)


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


# ----------------------------------------------------------------------------- commands
@click.group(context_settings=_CONTEXT, no_args_is_help=True)
@click.version_option(__version__, "-V", "--version", prog_name="kvlink",
                      message="%(prog)s %(version)s")
@_verbosity
def cli() -> None:
    """KV-cache transfer between prefill and decode instances.

    Options -v/-q work before or after the command: kvlink -v demo, kvlink demo -v.
    Sizes take K, M, G (powers of 1024): 4K, 1M, 64M. docs/cli.md has examples.
    """


@cli.command(context_settings=_CONTEXT)
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
    _check(a)
    _port_range("--port", port, a.prefill_tp, allow_zero=True)
    _setup_logging()
    from kvlink.demo.run import free_port_range, run_demo

    base = port or free_port_range(a.prefill_tp, a.host)
    return _report(run_demo(_plan(a, base), not a.no_progress), a.json_path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops serving like Ctrl-C: the ranks are stopped too


@cli.command(context_settings=_CONTEXT)
@_geometry
@_opt("--host", default="127.0.0.1", help="Bind address (0.0.0.0 for other hosts).")
@_opt("--advertise-host", default=None, help="Address peers dial (default: --host).")
@_opt("--port", type=int, default=5600,
      help="Side-channel base port: rank r listens on PORT + r.")
@_verbosity
def serve(port: int, **kw: Any) -> int:
    """The prefill half: fill a KV cache and serve it until every request was read.

    Stops on Ctrl-C or SIGTERM; its ranks die with it even on SIGKILL (Linux). Exit code 1
    when a rank died (an exception, a signal) or had to be killed.
    """
    import signal

    a = _args(kw)
    _check(a)
    _port_range("--port", port, a.prefill_tp, allow_zero=False)
    _setup_logging()
    from kvlink.demo.progress import Display
    from kvlink.demo.run import Serving

    signal.signal(signal.SIGTERM, _interrupt)
    plan = _plan(a, port)
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


@cli.command(context_settings=_CONTEXT)
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
    _check(a)
    _port_range("--remote-port", remote_port, a.prefill_tp, allow_zero=False)
    _setup_logging()
    from kvlink.demo.run import run_pull

    plan = dataclasses.replace(_plan(a, remote_port), advertise_host=remote_host,
                               decode_device=a.device)
    result = run_pull(plan, not a.no_progress)
    result["device"] = "remote"  # the serve's: not known here
    return _report(result, a.json_path)


@cli.command(context_settings=_CONTEXT)
@_opt("--json", "json_path", metavar="PATH", default=None,
      help="Also write the report as JSON here ('-': print JSON instead of the text).")
@click.option("--strict", is_flag=True, help="Exit 1 when any warning was raised.")
@click.option("--no-probe", is_flag=True,
              help="Skip the measured NIXL READ/WRITE between two processes (a few seconds).")
@_verbosity
def doctor(json_path: str | None, strict: bool, no_probe: bool) -> int:
    """What carries the bytes here, and how to fix it: versions, UCX settings and the lanes a
    measured NIXL probe used, a verdict per transport, RDMA/CUDA IPC/system checks."""
    if json_path != "-":
        _writable_file("--json", json_path)
    _setup_logging()
    from kvlink.doctor import run, run_doctor

    if json_path == "-":
        return run(as_json=True, strict=strict, probe=not no_probe)
    return run_doctor(json_out=json_path, strict=strict, probe=not no_probe)


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return parse_sizes(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value}: {exc}") from None


def _names(allowed: tuple[str, ...] | None) -> Callable[[click.Context, click.Parameter, str],
                                                       list[str]]:
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names:
            raise click.BadParameter(f"{value!r}: name at least one")
        for n in names:
            if allowed is not None and n not in allowed:
                raise click.BadParameter(f"{n!r} is not one of {', '.join(allowed)}")
        return names
    return parse


def _default_sizes() -> str:
    return "4K,16K,64K,256K,1M,4M,16M,64M"


#: bench options that shape the sweep: the client's to choose (a server serves any sweep)
_SWEEP_OPTIONS = ("transports", "ops", "sizes", "total_mib", "reps", "warmup", "memory",
                  "no_perftest", "out", "json_name", "png_name")
_BENCH_PORT = 13370  # kvlink.bench.DEFAULT_PORT (not imported here: keeps --help fast)


def _bench_command() -> str:
    """This command line for the records (the JSON, the server's ready message), its
    --secret masked."""
    args, hide = [], False
    for a in _ARGV:
        args.append("***" if hide else "--secret=***" if a.startswith("--secret=") else a)
        hide = a == "--secret"
    return " ".join(["kvlink", *args])


@cli.command(context_settings=_CONTEXT)
@click.argument("host", required=False)
@_opt("--server", is_flag=True,
      help="Serve bench clients (kvlink bench HOST on another host) until Ctrl-C or SIGTERM.")
@_opt("--port", type=int, default=_BENCH_PORT,
      help="Control port: the server listens on it (0: a free one, printed), a client dials it.")
@_opt("--bind", default="127.0.0.1",
      help="--server: the address to listen on (the data-plane listeners too); a "
           "non-loopback one needs --secret or --insecure.")
@_opt("--secret", default=None, metavar="TEXT",
      help="Shared secret authenticating the control connection, the same on both hosts "
           "(default: KVLINK_SECRET; visible in ps, so prefer that).")
@_opt("--insecure", is_flag=True,
      help="--server: serve a non-loopback --bind without a secret (a network you trust).")
@_opt("--once", is_flag=True, help="--server: exit after the first client.")
@_opt("--connect-timeout", type=_POS_FLOAT, default=10.0,
      help="Seconds a client tries to reach HOST:PORT (a refused connect is retried).")
@_opt("--transports", default="tcp,nixl", callback=_names(None),
      help="Comma-separated transports to measure (a registered one whose library is "
           "missing is skipped, saying why).")
@_opt("--ops", default="read,write", callback=_names(("read", "write")),
      help="Comma-separated operations: read, write.")
@_opt("--sizes", default=_default_sizes(), callback=_sizes,
      help="Comma-separated block (extent) sizes, bytes; K, M, G = KiB, MiB, GiB.")
@_opt("--total-mib", type=_POS_INT, default=256,
      help="Buffer on each side, MiB; a point moves min(buffer, 16384 blocks) per post.")
@_opt("--reps", type=_POS_INT, default=3,
      help="Timed posts per point (GB/s: median, min, max; latency: average, p99).")
@_opt("--warmup", type=click.IntRange(min=0), default=1,
      help="Untimed posts per point before the timed ones.")
@_opt("--memory", type=click.Choice(["dram", "vram"]), default="dram",
      help="Buffers in host memory, or on cuda:0 (needs torch and a GPU).")
@_opt("--no-perftest", is_flag=True, help="Skip the ucx_perftest baselines.")
@_opt("--out", type=click.Path(file_okay=False), default=".",
      help="Directory for the JSON and PNG (created if missing).")
@_opt("--json", "json_name", default="bandwidth.json",
      help="JSON file name, in --out unless absolute.")
@_opt("--png", "png_name", default="bandwidth.png",
      help="PNG plot file name, in --out unless absolute (needs matplotlib).")
@_verbosity
def bench(host: str | None, server: bool, port: int, bind: str, secret: str | None,
          insecure: bool, once: bool, connect_timeout: float, transports: list[str],
          ops: list[str], sizes: list[int], total_mib: int, reps: int, warmup: int, memory: str,
          no_perftest: bool, out: str, json_name: str, png_name: str) -> int:
    """Bandwidth vs block size per transport, beside same-run baselines.

    One host (no HOST): a server child on 127.0.0.1 and the sweep against it. Two hosts:
    `kvlink bench --server` on one, `kvlink bench HOST` on the other; the client's options
    choose the sweep, the server allocates and serves what it asks for. The server binds
    127.0.0.1 unless --bind says otherwise; a non-loopback address needs a shared secret
    (--secret or KVLINK_SECRET, the same on both hosts) or --insecure.

    Baselines: ucx_perftest get/put to the server's host, memcpy of the same extents (device
    copy for --memory vram; local); ib_write_bw only where an RDMA device exists. Writes the
    table to stdout, JSON and PNG to --out (default: the current directory).
    """
    ctx = click.get_current_context()
    if server:
        if host is not None:
            raise click.UsageError(f"HOST {host}: --server listens, it dials no host")
        given = [f"--{n.replace('_name', '').replace('_', '-')}" for n in _SWEEP_OPTIONS
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--server {' '.join(given)}: the client chooses the sweep "
                                   "(give these to kvlink bench HOST)")
        _port_range("--port", port, 1, allow_zero=True)
        _setup_logging()
        from kvlink.bench import run_server
        from kvlink.errors import ConfigError
        from kvlink.sidechannel import secret_from_env

        try:
            return run_server(bind, port, once, _bench_command(), secret_from_env(secret),
                              insecure)
        except ConfigError as exc:  # a non-loopback --bind, no secret, no --insecure: unbound
            raise click.UsageError(str(exc)) from None
        except OSError as exc:  # the port is taken, the address is not ours
            raise click.ClickException(f"--bind {bind} --port {port}: cannot listen: "
                                       f"{exc}") from None
    for name in ("bind", "once", "insecure"):
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name}: only with --server")
    if host is None and secret is not None:
        raise click.UsageError("--secret: only with --server or HOST (the one-host run "
                               "authenticates its own server with a secret of its own)")
    if host is not None:
        _port_range("--port", port, 1, allow_zero=False)
    from kvlink.transport import registered_transports

    known = registered_transports()
    for n in transports:
        if n not in known:
            raise click.UsageError(f"--transports {n}: unknown transport; registered: "
                                     f"{', '.join(known) or 'none'}")
    total = total_mib << 20
    for s in sizes:
        if s > total:
            raise click.UsageError(f"--sizes {s}: larger than --total-mib {total_mib} "
                                     f"({total:,} bytes)")
    if memory == "vram":
        try:
            import torch
        except ImportError as exc:
            raise click.UsageError(f"--memory vram: needs torch ({exc})") from None
        if not torch.cuda.is_available():
            raise click.UsageError("--memory vram: no CUDA device (torch.cuda.is_available() "
                                     "is False)")
    out_dir = Path(out)
    json_path, png_path = out_dir / json_name, out_dir / png_name
    try:
        for p in (json_path, png_path):
            p.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(p.parent, os.W_OK):
                raise click.UsageError(f"--out {out}: {p.parent} is not writable")
    except OSError as exc:
        raise click.UsageError(f"--out {out}: {exc}") from None
    _setup_logging()
    from kvlink.bench import SweepConfig, run_and_write
    from kvlink.sidechannel import secret_from_env

    cfg = SweepConfig(sizes=sizes, transports=transports, ops=ops, total=total, reps=reps,
                      warmup=warmup, memory=memory, perftest=not no_perftest)
    try:
        return run_and_write(cfg, str(json_path), str(png_path), _bench_command(), host, port,
                             connect_timeout, secret_from_env(secret))
    except (RuntimeError, OSError) as exc:  # a transfer failed, the server died: one line
        raise click.ClickException(str(exc)) from None


@cli.command(context_settings=_CONTEXT)
@click.argument("url")
@_opt("--interval", type=click.FloatRange(min=0), default=0.0,
      help="Seconds: scrape twice this far apart and report that window only (0: totals).")
@_opt("--nic-gbit", type=_POS_FLOAT, default=400.0, help="NIC line rate, Gb/s.")
@_opt("--baseline", default="bandwidth.json", metavar="PATH",
      help="A `kvlink bench` JSON measured on this machine.")
@_opt("--timeout", type=_POS_FLOAT, default=10.0, help="Seconds per scrape.")
@_verbosity
def probe(url: str, interval: float, nic_gbit: float, baseline: str, timeout: float) -> int:
    """Achieved KV bandwidth of a running decode server, from its Prometheus /metrics.

    URL: the server's metrics endpoint, e.g. http://host:8000/metrics.
    """
    if not re.match(r"^https?://[^/\s]+", url):
        raise click.UsageError(f"URL {url}: not an http:// or https:// address")
    _setup_logging()
    from kvlink.probe import ProbeError, run

    try:
        return run(url, interval=interval, nic_gbit=nic_gbit, baseline=baseline,
                   timeout=timeout)
    except ProbeError as exc:
        raise click.ClickException(str(exc)) from None


# ----------------------------------------------------------------------------- entry point
def _fail(message: str) -> None:
    print(f"kvlink: error: {' '.join(message.split())}", file=sys.stderr)


_ARGV: list[str] = []  # this command line, for the records (bench JSON)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = args
    if not args:  # `kvlink` alone: its help, as a usage error
        with click.Context(cli, info_name="kvlink") as ctx:
            click.echo(cli.get_help(ctx), err=True)
        return 2
    try:
        rv = cli.main(args=args, prog_name="kvlink", standalone_mode=False)
    except click.UsageError as exc:
        _fail(exc.format_message())
        return 2
    except click.ClickException as exc:
        _fail(exc.format_message())
        return exc.exit_code
    except click.Abort:
        print("kvlink: interrupted", file=sys.stderr)
        return 130
    except KVLinkError as exc:
        _fail(str(exc))
        return 1
    return int(rv or 0)


if __name__ == "__main__":
    sys.exit(main())
