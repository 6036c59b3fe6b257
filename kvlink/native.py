"""kvlink's C helpers (``_native.c``), built on first use with the host's C compiler.

Steps that are cheaper in C than through numpy, ctypes or CPython's socket calls, each by
tens of microseconds on a request's path, cold (bench/results/gpu_checks_61d7f7e_stamps):

- a cuda_ipc lane's launch (``post``: the ids into its parameters, the order after the
  caller's stream, the kernel, its completion event) and the look at its end (``lane_end``:
  the end word, and once it shows, the status and check words);
- the fingerprint of a block-id list (``fingerprint``, what the hold board compares;
  :func:`kvlink.holdboard.fingerprint` computes the same in numpy where this is not built);
- the hold board's after-check (``board_shows``), with its alive word (``sentinel_arm``:
  a word the kernel marks when the producer dies, read where a flock was a system call);
- tcp's bytes between registered memory and a socket (``move_extents``: sendmsg/readv over
  the extent array, the GIL released; bench/results/tcp_native_mover), a READ's answer sent
  and taken with them and its landing marked for poll(), and a request's header read
  (``recv_frame``) — each one call, so tcp's threads take the GIL back once where each
  socket call did (bench/results/tcp_busy_peers);
- tcp's grant gate and the owner's serving loop (``_gate.c``: ``gate_*``, ``serve_frames``;
  the notifications it queues, ``_notes.c``: ``notes_*``) and the initiator's inbox
  (``_reader.c``: ``inbox_*``, ``run_inbox``): a plain READ or WRITE served and run, with
  no Python on either side's thread, so neither waits for the GIL, which a
  busy process's own Python holds for a switch interval or, giving it up and taking it back
  in a loop, for seconds (bench/results/tcp_busy_peers_c);
- the bounds check of an extent array against sorted ranges (``inside``: registered regions,
  a grant's window), which both sides of a tcp READ make before a byte moves;
- a request's plan on the RUNS path (``plan_runs``: :meth:`kvlink.plan.PlanTable.plan` in one
  call where numpy's ~25 cost a 16-block request ~70 us cold; bench/results/plan_native);
- the integrity digest of host planes (``_digest.c``: ``digest``, every plane in one call,
  without the GIL, where numpy gathered and summed plane by plane).

The module is built the way Triton builds its launchers: at first use, with the compiler
Python was built with (``sysconfig``'s ``CC``) and Python's headers, into a cache keyed by the
source and the interpreter (``$KVLINK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvlink``, else
``~/.cache/kvlink``), so a process after the first only imports it. Where it cannot be built
(no compiler, no headers, a read-only cache) :func:`load` says why once and returns None:
lanes then launch through ctypes, the fingerprint is numpy's, the after-check is Python's
(the flock only), tcp moves bytes through memoryviews and serves and takes every request in
Python (grants in :class:`kvlink.grants.Grants`' Python form), bounds checks and plans are
numpy's.
``KVLINK_NATIVE=0`` turns it off (an A/B, or a suspect build).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("kvlink.gpu")

_SOURCE = Path(__file__).with_name("_native.c")
#: compiled with it into the one module: its shared declarations, tcp's grant gate and serving
#: loop (``gate_*``, ``serve_frames``), tcp's initiator inbox (``inbox_*``, ``run_inbox``), the
#: owner's queue of notifications (``notes_*``) and the integrity digest of host planes
#: (``digest``)
_WITH = tuple(Path(__file__).with_name(n)
              for n in ("_native.h", "_gate.c", "_reader.c", "_notes.c", "_digest.c"))
_NAME = "_kvlink_native"  # PyInit__kvlink_native
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def cache_dir() -> Path:
    """Where built launchers are kept."""
    own = os.environ.get("KVLINK_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvlink"


def enabled() -> bool:
    """Whether the C helpers may be used (``KVLINK_NATIVE=0`` says no)."""
    return os.environ.get("KVLINK_NATIVE", "1").strip().lower() not in ("0", "false", "no",
                                                                          "off")


def why_not() -> str:
    """Why :func:`load` returned None (empty if it did not, or was not called)."""
    return _why.get("launch", "")


def load() -> ModuleType | None:
    """The built module (``bind``/``post``/``fingerprint``/``board_shows``/``move_extents``,
    see ``_native.c``), or None (said once, in the log): the Python paths are taken."""
    with _lock:
        if "launch" in _loaded:
            return _loaded["launch"]
        mod: ModuleType | None = None
        if not enabled():
            _why["launch"] = "KVLINK_NATIVE=0"
        else:
            try:
                mod = _import(_build())
            except (OSError, ImportError, subprocess.SubprocessError, RuntimeError) as exc:
                _why["launch"] = f"{type(exc).__name__}: {exc}"
                log.warning("kvlink's C helpers are unavailable (%s); falling back to "
                            "Python: lanes launch through ctypes, fingerprints are numpy's, "
                            "tcp moves bytes through memoryviews (slower)", _why["launch"])
        _loaded["launch"] = mod
        return mod


def _build() -> Path:
    """The shared object for this source and interpreter, built now if it is not cached.
    Built to a temporary name and renamed: processes that build at once each end with a
    whole file."""
    source = b"".join(p.read_bytes() for p in (_SOURCE, *_WITH))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(source + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    out = cache_dir() / f"{_NAME}-{key}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"no Python.h under {include} (install the Python headers)")
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        sources = [str(p) for p in (_SOURCE, *_WITH) if p.suffix == ".c"]
        cmd = [*cc, "-O2", "-shared", "-fPIC", "-pthread", "-I", include, *sources, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
