"""dev.sh's set-up helpers, run by bash as dev.sh defines them (no network: a local wheel path).

Stop 61's CI ran with a venv pip had left half-installed — the disk was full, pip said "No
space left on device", and dev.sh's ``pipq`` swallowed it (``|| true``). Its import check then
passed inside the checkout, where ``kvlink/`` is on the path, so the failure showed only as six
subprocess tests that could not import kvlink. These pin what replaced it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(helper: str, call: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``call`` in bash with dev.sh's ``helper`` function defined and VENV this interpreter's
    venv (or prefix): the function's own text, not a copy."""
    script = (f'VENV={Path(sys.prefix)}; eval "$(sed -n \'/^{helper}() {{/,/^}}/p\' '
              f'{ROOT / "dev.sh"})"; {call}')
    return subprocess.run(["bash", "-c", script], cwd=tmp, capture_output=True, text=True,
                          timeout=120)


def test_a_failed_pip_install_stops_the_setup_with_pips_words(tmp_path: Path) -> None:
    """A failed install exits 1 (the old ``pipq`` returned 0) and shows pip's own error."""
    missing = tmp_path / "kvlink_missing-0.0.0-py3-none-any.whl"
    got = _run("pipq", f"pipq --no-index {missing}; echo survived", tmp_path)
    assert got.returncode == 1 and "survived" not in got.stdout, got
    assert "kvlink: pip install" in got.stderr and "failed" in got.stderr, got.stderr
    assert "trying once more" in got.stderr  # one retry: a registry hiccup is common
    assert str(missing.name) in got.stderr  # pip's own words about it


def test_the_setups_import_check_does_not_see_the_checkout(tmp_path: Path) -> None:
    """Inside a checkout, ``import kvlink`` finds ``./kvlink`` whether or not the venv has it:
    the check runs from ``/``. A package that exists only in the working directory fails it."""
    (tmp_path / "only_here_kvlink_probe").mkdir()
    (tmp_path / "only_here_kvlink_probe" / "__init__.py").write_text("")
    here = subprocess.run([sys.executable, "-c", "import only_here_kvlink_probe"], cwd=tmp_path,
                          capture_output=True)
    assert here.returncode == 0  # what the old check saw
    got = _run("venv_imports", "venv_imports only_here_kvlink_probe", tmp_path)
    assert got.returncode != 0 and "ModuleNotFoundError" in got.stderr, got
    assert _run("venv_imports", "venv_imports json", tmp_path).returncode == 0
