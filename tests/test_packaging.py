"""kvlink as a user installs it: from its wheel, not from this checkout.

The C helpers (``kvlink.native``) are compiled from sources shipped inside the package on first
use; a source the wheel leaves out fails that build, and the installed kvlink then runs every
path they serve in Python (tcp's serving without the GIL, fingerprints, the lane launcher) —
slower, with one warning in the log. The wheel once left ``_digest.c`` out.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _wheel(tmp: Path) -> Path:
    """This checkout's wheel, built offline with the interpreter's own setuptools from a copy
    of what the build reads (no build/ left in the checkout)."""
    if importlib.util.find_spec("setuptools") is None:
        why = "setuptools is not installed here (the wheel is built offline)"
        print(f"\nskipping the installed-wheel test: {why}")
        pytest.skip(why)
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("kvlink", "kvlink_transports"):
        shutil.copytree(ROOT / pkg, src / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(out)], check=True,
                   capture_output=True, timeout=120)
    (wheel,) = out.glob("kvlink-*.whl")
    return wheel


def test_the_wheel_ships_every_source_the_c_helpers_are_built_from(tmp_path: Path) -> None:
    from kvlink import native

    wheel = _wheel(tmp_path)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"kvlink/{p.name}" for p in (native._SOURCE, *native._WITH)}
    assert needed <= shipped, f"the wheel lacks {sorted(needed - shipped)}"
    # and installed from it (its own directory first on the path), kvlink builds them
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True,
                   timeout=120)
    probe = ("import kvlink, kvlink.native as n, sys; "
             f"assert kvlink.__file__.startswith({str(site)!r}), kvlink.__file__; "
             "m = n.load(); print('built' if m is not None else 'none: ' + n.why_not())")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site),
                               "KVLINK_CACHE_DIR": str(tmp_path / "cache"),
                               "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "built", done.stdout + done.stderr[-2000:]
