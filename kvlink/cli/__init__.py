"""The ``kvlink`` command: demo, serve, pull, bench, probe, doctor (docs/cli.md).

Every value is checked here, in the parent, before a process is spawned: a bad one ends the
command with one line, ``kvlink: error: ...`` naming it, and exit code 2. ``-v``/``-q`` are
taken anywhere on the line (before or after the command) and reach the child processes.

The package, a module per job: :mod:`~kvlink.cli.options` (shared option helpers: verbosity,
sizes, ports, devices and transports checked against this machine, the one error line),
:mod:`~kvlink.cli.transfer` (``demo``, ``serve``, ``pull``), :mod:`~kvlink.cli.bandwidth`
(``bench``), :mod:`~kvlink.cli.diagnostics` (``doctor``, ``probe``). This face is the group and
:func:`main` (the ``kvlink`` entry point; ``python -m kvlink.cli`` runs it too). Nothing heavy
is imported before a command runs: ``--help`` stays fast.
"""

from __future__ import annotations

import sys

import click

from kvlink import __version__
from kvlink.cli.bandwidth import _ARGV, _BENCH_PORT, bench
from kvlink.cli.diagnostics import doctor, probe
from kvlink.cli.options import (
    _CONTEXT,
    CUDA_TRANSPORTS,
    _fail,
    _verbosity,
    device_problem,
    log_level,
    memory_problem,
    parse_size,
    parse_sizes,
    transport_problem,
)
from kvlink.cli.transfer import _report, demo, pull, serve
from kvlink.errors import KVLinkError

__all__ = ["CUDA_TRANSPORTS", "_BENCH_PORT", "_report", "cli", "device_problem", "log_level",
           "main", "memory_problem", "parse_size", "parse_sizes", "transport_problem"]


@click.group(context_settings=_CONTEXT, no_args_is_help=True)
@click.version_option(__version__, "-V", "--version", prog_name="kvlink",
                      message="%(prog)s %(version)s")
@_verbosity
def cli() -> None:
    """KV-cache transfer between prefill and decode instances.

    Options -v/-q work before or after the command: kvlink -v demo, kvlink demo -v.
    Sizes take K, M, G (powers of 1024): 4K, 1M, 64M. docs/cli.md has examples.
    """


for _command in (demo, serve, pull, doctor, bench, probe):
    cli.add_command(_command)


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
