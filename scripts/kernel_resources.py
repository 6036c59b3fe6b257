"""Compile the cuda_ipc copy kernels (``kvlink.gpu.move.SOURCE``) with a local ``nvcc`` in the
forms the lanes launch, and print each kernel's registers, spills and shared memory.

    python scripts/kernel_resources.py [--arch sm_90] [--source kvlink/gpu/move.py]

Why: a GPU host is thirty minutes a session, and a kernel change that does not compile, or
that makes the digest kernel spill under its launch bound (``__launch_bounds__(KV_T,
KV_MINB)``: 64 registers a thread), is found here on a machine with the CUDA toolkit and no
GPU. ``--source`` takes another tree's ``move.py`` (the source is read as text, not
imported), to compare a variant with the tree's. This says nothing of speed: the GPU checks
and benches do (``scripts/gpu_checks.sh``).
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlink.gpu.move import kernel_defines  # noqa: E402  (this tree's, on the path above)

Shape = tuple[int, int, int]  # (threads a block, threads per part, vectors in flight)


class Source(NamedTuple):
    """What of a move.py the compilations need, read from its text (not imported: another
    tree's file is compiled as it is)."""

    code: str  # SOURCE
    small: Shape  # SMALL_SHAPE
    large: Shape  # LARGE_SHAPE
    digest: Shape  # DIGEST_SHAPE
    min_blocks: int  # DIGEST_MIN_BLOCKS
    dmax: int  # DIGEST_MAX
    words: int  # the largest of PARAM_WORDS: a table passed with its launch

    @classmethod
    def read(cls, path: Path) -> Source:
        names = {"SOURCE", "SMALL_SHAPE", "LARGE_SHAPE", "DIGEST_SHAPE", "DIGEST_MIN_BLOCKS",
                 "DIGEST_MAX", "PARAM_WORDS"}
        v: dict[str, Any] = {}
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names):
                v[node.targets[0].id] = ast.literal_eval(node.value)
        missing = names - v.keys()
        if missing:
            raise SystemExit(f"{path}: no {', '.join(sorted(missing))} at module level")
        return cls(v["SOURCE"], v["SMALL_SHAPE"], v["LARGE_SHAPE"], v["DIGEST_SHAPE"],
                   v["DIGEST_MIN_BLOCKS"], v["DIGEST_MAX"], max(v["PARAM_WORDS"]))


class Form(NamedTuple):
    """One compilation of the source (kvlink.gpu.move.kernel_defines' arguments) and the
    kernels launched in that form."""

    label: str
    kernels: tuple[str, ...]
    shape: Shape
    words: int  # the table passed by value (0: a pointer)
    ids: bool  # KV_IDS: a lane's block-id form
    board: bool  # KV_BOARD: a digest lane's, reading the producer's hold board


_PLAIN = ("kv_move", "kv_move_runs")


def forms(src: Source) -> list[Form]:
    """What the lanes and the general path launch (kvlink.gpu.lane, kvlink.gpu.copy)."""
    return [
        Form("plain lane, small units", ("kv_move_runs",), src.small, src.words, True, False),
        Form("plain lane, large units", ("kv_move_runs",), src.large, src.words, True, False),
        Form("digest lane (hold board)", ("kv_move_digest",), src.digest, src.words, True,
             True),
        Form("general, table with the launch", _PLAIN, src.small, src.words, False, False),
        Form("general, table in memory", _PLAIN, src.small, 0, False, False),
        Form("general, large extents", _PLAIN, src.large, 0, False, False),
        Form("digest, rows given", ("kv_move_digest",), src.digest, src.words, False, False),
    ]


def compile_form(nvcc: str, arch: str, src: Source, form: Form) -> str:
    """ptxas' resource report of ``form`` (raises CalledProcessError with nvcc's output)."""
    defines = kernel_defines(form.shape, form.words, form.ids, form.board, src.dmax,
                             src.min_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "kv_move.cu"
        cu.write_text(defines + src.code)
        done = subprocess.run([nvcc, f"-arch={arch}", "-c", "-o", str(cu.with_suffix(".o")),
                               str(cu), "--resource-usage", "-w"],
                              capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def report(text: str) -> dict[str, tuple[int, int, int, int]]:
    """kernel -> (registers, spill stores, spill loads, shared memory bytes)."""
    got: dict[str, tuple[int, int, int, int]] = {}
    kernel, spill = "", (0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            kernel, spill = m.group(1), (0, 0)
        elif (m := _SPILL.search(line)) and kernel:
            spill = (int(m.group(1)), int(m.group(2)))
        elif (m := _REGS.search(line)) and kernel:
            got[kernel] = (int(m.group(1)), *spill, int(m.group(2) or 0))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90", help="nvcc's -arch (default sm_90: H100, H200)")
    ap.add_argument("--source", type=Path, default=ROOT / "kvlink" / "gpu" / "move.py",
                    help="the move.py whose kernels to compile (default: this tree's)")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("no nvcc on PATH: this check needs the CUDA toolkit (not a GPU)", file=sys.stderr)
        return 2
    src = Source.read(args.source)
    print(f"{args.source} for {args.arch}: registers, spill stores / loads (bytes), static "
          "shared memory (bytes)")
    bad = 0
    for form in forms(src):
        try:
            kernels = report(compile_form(nvcc, args.arch, src, form))
        except subprocess.CalledProcessError as exc:
            print(f"  {form.label}: does not compile\n{exc.stdout}{exc.stderr}")
            bad += 1
            continue
        for name in form.kernels:
            if name in kernels:
                regs, stores, loads, smem = kernels[name]
                flag = "  SPILLS" if stores or loads else ""
                print(f"  {form.label:32s} {name:15s} {regs:3d} registers, spills "
                      f"{stores} / {loads}, smem {smem}{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
