"""``kvlink doctor`` (what carries the bytes on this machine, and how to fix it) and
``kvlink probe`` (the KV bandwidth a running decode server achieves, from its metrics): option
checks here, the work in :mod:`kvlink.doctor` and :mod:`kvlink.probe`."""

from __future__ import annotations

import re

import click

from kvlink.cli.options import (
    _CONTEXT,
    _POS_FLOAT,
    _opt,
    _setup_logging,
    _verbosity,
    _writable_file,
)


@click.command(context_settings=_CONTEXT)
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


@click.command(context_settings=_CONTEXT)
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
