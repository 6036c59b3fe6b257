"""Bytes that land in a READ's destination after the transport reported it FAILED, where the
peer hung (SIGSTOP) and then resumed (SIGCONT): mooncake against tcp as the control.

    .venv/bin/python bench/mooncake_resume.py [--cases a,b,c,d] [--out FILE]

Why: the transport contract's first rule (kvlink/transport.py) is that FAILED means quiescent
— the caller reuses a FAILED READ's blocks at once, so a byte landing later corrupts someone
else's KV. A dead peer is safe (its connection is gone); a peer that stalls and resumes is the
case this measures. Cases, each ``timeout_s`` 2 and ``MC_TRANSFER_TIMEOUT=5``:

- ``a``: mooncake, one 64 MiB READ (one extent);
- ``b``: the same with ``MC_TCP_PROGRESS_TIMEOUT_SEC=2`` (the engine drops a stalled session);
- ``c``: mooncake, a READ of 1024 x 64 KiB extents (64 MiB, several of the engine's
  sub-batches), ``MC_TCP_PROGRESS_TIMEOUT_SEC=2``;
- ``d``: tcp, as ``a`` (the control: its FAILED must be quiescent, 0 bytes after the resume).

Each case runs in a fresh pair of processes (so the engine reads its env): a reader (this
script re-run with ``--one``) and a peer it spawns, which owns the 64 MiB source (a nonzero
pattern, so every landed byte is a nonzero byte). The reader connects with the real transport
(``create_transport``), warms the connection with a 4 KiB READ, SIGSTOPs the peer, posts the
READ into a zeroed destination, waits for FAILED (seconds from the post), counts the nonzero
bytes of the destination then, SIGCONTs the peer and polls the count until it has not grown
for ``--settle`` seconds (at most ``--resume-wait``): landed after FAILED is the difference.
Real processes and the real engines (Mooncake TE ``mooncake-transfer-engine-non-cuda`` over
tcp, metadata P2PHANDSHAKE). Writes bench/results/mooncake_resume/mooncake_resume.json
(command, machine, date).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, write_result  # noqa: E402

NBYTES = 64 << 20
WARM = 4096
TIMEOUT_S = 2.0
CASES: dict[str, dict[str, Any]] = {
    "a": {"transport": "mooncake", "extents": 1, "env": {"MC_TRANSFER_TIMEOUT": "5"}},
    "b": {"transport": "mooncake", "extents": 1,
          "env": {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_PROGRESS_TIMEOUT_SEC": "2"}},
    "c": {"transport": "mooncake", "extents": 1024,
          "env": {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_PROGRESS_TIMEOUT_SEC": "2"}},
    "d": {"transport": "tcp", "extents": 1, "env": {"MC_TRANSFER_TIMEOUT": "5"}},
}


def _pattern(n: int) -> Any:
    import numpy as np

    return (np.arange(n, dtype=np.uint32) % 255 + 1).astype(np.uint8)  # 1..255, never 0


def _peer_main(conn: Connection, transport: str, name: str) -> None:
    from kvlink.transport import Region, TransportContext, create_transport

    t = create_transport(transport, TransportContext(agent_name=name), {"timeout_s": TIMEOUT_S})
    buf = _pattern(NBYTES)
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    conn.send(("ready", t.descriptor(), buf.ctypes.data, os.getpid()))
    conn.recv()  # anything (or EOF): end
    t.close()


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise RuntimeError(f"peer {pid} did not stop within {timeout}s")


def one(case: str, settle: float, resume_wait: float) -> dict[str, Any]:
    """The reader of one case (run in a process of its own, the case's env already set)."""
    import numpy as np

    from kvlink.transport import (
        Op,
        Region,
        TransportContext,
        XferStatus,
        create_transport,
        make_extents,
    )

    spec = CASES[case]
    transport, n = spec["transport"], int(spec["extents"])
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    name = f"resume-peer-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_peer_main, args=(child, transport, name), daemon=True)
    proc.start()
    child.close()
    if not conn.poll(60):
        proc.kill()
        raise RuntimeError("peer did not start within 60 s")
    _, desc, raddr, pid = conn.recv()
    t = create_transport(transport, TransportContext(agent_name=f"resume-{uuid.uuid4().hex[:8]}"),
                         {"timeout_s": TIMEOUT_S})
    dst = np.zeros(NBYTES, dtype=np.uint8)
    warm = np.zeros(WARM, dtype=np.uint8)
    stopped = False
    try:
        t.register([Region(dst.ctypes.data, dst.nbytes), Region(warm.ctypes.data, warm.nbytes)])
        t.connect(name, desc)
        h = t.post(Op.READ, name, make_extents(warm.ctypes.data, WARM), make_extents(raddr, WARM))
        state = t.wait(h, 30.0)
        t.release(h)
        if state.status is not XferStatus.DONE or not warm.all():
            raise RuntimeError(f"warm-up READ: {state}")
        unit = NBYTES // n
        at = np.arange(n, dtype=np.uint64) * np.uint64(unit)
        local = make_extents(np.uint64(dst.ctypes.data) + at, unit)
        remote = make_extents(np.uint64(raddr) + at, unit)
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        _wait_stopped(pid)
        t0 = time.monotonic()
        h = t.post(Op.READ, name, local, remote)
        state = t.wait(h, 120.0)
        failed_after = time.monotonic() - t0
        at_failed = int(np.count_nonzero(dst))
        os.kill(pid, signal.SIGCONT)
        stopped = False
        t1 = time.monotonic()
        last, last_change, series = at_failed, t1, []
        while time.monotonic() - t1 < resume_wait and time.monotonic() - last_change < settle:
            time.sleep(0.1)
            now = int(np.count_nonzero(dst))
            if now != last:
                last, last_change = now, time.monotonic()
                series.append([round(last_change - t1, 2), now - at_failed])
        return {"case": case, "transport": transport, "env": spec["env"], "extents": n,
                "extent_bytes": unit, "bytes": NBYTES, "timeout_s": TIMEOUT_S,
                "status": state.status.value, "failed_after_s": round(failed_after, 2),
                "reason": state.reason, "landed_at_failed": at_failed,
                "landed_after_resume": last - at_failed,
                "last_landed_s_after_resume": round(last_change - t1, 2) if series else None,
                "resume_series": series, "watched_s": round(time.monotonic() - t1, 2)}
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        proc.join(10)
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="a,b,c,d", help="comma-separated, of a b c d")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds the landed count must not grow to call it settled")
    ap.add_argument("--resume-wait", type=float, default=20.0,
                    help="most seconds to watch the destination after SIGCONT")
    ap.add_argument("--out", default=str(RESULTS / "mooncake_resume" / "mooncake_resume.json"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the reader of one case
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.settle, args.resume_wait)), flush=True)
        return
    rows = []
    for case in args.cases.split(","):
        spec = CASES[case]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MC_TCP_PROGRESS")}
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        env.update(spec["env"])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, __file__, "--one", case, "--settle", str(args.settle),
               "--resume-wait", str(args.resume_wait)]
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            out = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            row = (json.loads(out[-1][7:]) if out else
                   {"case": case, "error": f"exit {run.returncode}: {run.stderr[-2000:]}"})
        except subprocess.TimeoutExpired as e:
            row = {"case": case, "error": f"reader did not end within {e.timeout} s"}
        rows.append(row)
        if "error" in row:
            print(f"  {case}: ERROR {row['error']}")
        else:
            print(f"  {case} {row['transport']:8} {row['extents']:5} extents "
                  f"{' '.join(f'{k}={v}' for k, v in row['env'].items())}: {row['status']} "
                  f"after {row['failed_after_s']} s, {row['landed_at_failed']} B landed then, "
                  f"{row['landed_after_resume']} B after the resume ({row['reason'][:80]})",
                  flush=True)
    write_result("mooncake_resume", {
        "what": "a 64 MiB READ from a peer SIGSTOPped after a warm-up READ: seconds from its "
                "post to FAILED, nonzero bytes in the zeroed destination then, and bytes that "
                "landed after SIGCONT (FAILED must be quiescent: 0)",
        "settle_s": args.settle, "resume_wait_s": args.resume_wait, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
