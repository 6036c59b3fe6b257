"""``kvlink bench``: bandwidth vs block size per transport, on one host or two (``--server``
on one, ``HOST`` on the other). Its options are checked here; the sweep, the server and the
report are :mod:`kvlink.bench`'s, imported only when the command runs."""

from __future__ import annotations

import os
from pathlib import Path

import click

from kvlink.cli.options import (
    _CONTEXT,
    _POS_FLOAT,
    _POS_INT,
    _names,
    _opt,
    _port_range,
    _setup_logging,
    _sizes,
    _verbosity,
)

_ARGV: list[str] = []  # this command line, for the records (bench JSON)


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


@click.command(context_settings=_CONTEXT)
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
    from kvlink.bench.facts import human

    total = total_mib << 20
    for s in sizes:
        if s > total:
            raise click.UsageError(f"--sizes {human(s)}: larger than --total-mib {total_mib} "
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
