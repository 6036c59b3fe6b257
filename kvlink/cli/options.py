"""What the commands share: -v/-q anywhere on the line, option shorthands, values parsed and
checked before anything is spawned (sizes like 4K and 1M, ports, devices, transports, writable
paths) and the one line ``kvlink: error: ...`` a failure ends with."""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

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


def _bindable_host(option: str, host: str) -> None:
    """A bind address this machine has: resolved, and bound once on an ephemeral port (the
    ranks bind it a moment later, in processes of their own)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise _bad(option, host, f"does not resolve ({exc})") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.bind(addr)
    except OSError as exc:
        raise _bad(option, host, f"cannot be bound here ({exc.strerror or exc})") from None


def _resolvable_host(option: str, host: str) -> None:
    """A host a peer will be dialled at: it must resolve."""
    try:
        socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise _bad(option, host, f"does not resolve ({exc})") from None


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
    if Path(path).expanduser().is_dir():
        raise _bad(option, path, "is a directory (name a file)")
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise _bad(option, path, f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise _bad(option, path, f"directory {parent} is not writable")

def _opt(*decls: str, **kw: Any) -> Callable[[F], F]:
    return click.option(*decls, **kw)


_POS_INT = click.IntRange(min=1)


class _PositiveFinite(click.FloatRange):
    """A number > 0 and finite: click's range lets NaN through (no comparison holds) and
    inf (no upper bound); a deadline of either never ended, or overflowed a timestamp."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        got = super().convert(value, param, ctx)
        if not math.isfinite(got):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return got


_POS_FLOAT = _PositiveFinite(min=0, min_open=True)
_TP = click.IntRange(1, MAX_TP)


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


def _fail(message: str) -> None:
    print(f"kvlink: error: {' '.join(message.split())}", file=sys.stderr)
