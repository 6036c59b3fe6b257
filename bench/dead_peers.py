"""What a dead or hung peer costs the transports' users, each against its baseline in the same run.

    .venv/bin/python bench/dead_peers.py --case mooncake [--out FILE]
    .venv/bin/python bench/dead_peers.py --case nixl-abort [--runs 8] [--out FILE]

``mooncake``: a peer stopped (SIGSTOP: alive, its port open, nothing answered) right after
``connect``; seconds from the post of a 4 KiB WRITE to its FAILED, with ``timeout_s`` 2 and
the engine's batch timeout 5 s. kvlink's default (``probe``: connect reads 64 bytes of the peer,
which opens the engine's data session) against ``probe`` off, where the transfer itself opens
the session and waits out the engine's own setup (what every transfer did before the probe
read; with the probe before that, the same: send_probe opens no data session).

``nixl-abort``: processes that died of SIGABRT out of ``--runs``, each running
tests/test_nixl_transport.py's two dead-peer tests four times (a peer killed under a READ, then
a peer killed after connect: the agent destroyed with an endpoint to it), with kvlink's default
(UCX's keepalive off) against ``UCX_KEEPALIVE_INTERVAL=20s`` (UCX's own default, set by the
user: kvlink keeps a user's value).

Real processes and the real engines (Mooncake TE over tcp, NIXL over UCX); the peers are the
tests' own (tests/test_mooncake_transport.py, tests/test_nixl_transport.py). Writes
bench/results/dead_peers_<case>.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))

from _common import write_result  # noqa: E402


def _mooncake_failed_after(probe: bool) -> dict[str, Any]:
    """One peer, stopped after connect; the WRITE's post -> FAILED."""
    import numpy as np
    from procgroup import stop
    from test_mooncake_transport import Peer, _ctx, kmc

    from kvlink.transport import Op, Region, make_extents

    p = Peer(f"hung-{uuid.uuid4().hex[:8]}", 1 << 20, seed=4)
    t = kmc.MooncakeTransport(_ctx(), {"timeout_s": 2.0, "probe": probe})
    buf = np.ones(1 << 20, dtype=np.uint8)
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(p.name, p.descriptor)
        stop(p.pid)
        t0 = time.monotonic()
        h = t.post(Op.WRITE, p.name, make_extents(buf.ctypes.data, 4096),
                   make_extents(p.addr, 4096))
        state = t.wait(h, 120.0)
        took = time.monotonic() - t0
        return {"probe": probe, "status": state.status.value, "reason": state.reason,
                "seconds_to_report": round(took, 2)}
    finally:
        p.kill()
        t.close()


def mooncake() -> dict[str, Any]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # (read by the engine each transport starts)
    rows = [_mooncake_failed_after(True), _mooncake_failed_after(False)]
    for r in rows:
        print(f"  probe {'on ' if r['probe'] else 'off'}: {r['status']} after "
              f"{r['seconds_to_report']} s ({r['reason'][:90]})")
    return {"what": "a 4 KiB WRITE to a mooncake peer stopped right after connect: seconds "
                    "from its post to FAILED, timeout_s 2, MC_TRANSFER_TIMEOUT 5",
            "rows": rows}


_NIXL_CODE = ("import gc, test_nixl_transport as t\n"
              "for _ in range(4):\n"
              "    t.test_peer_killed_mid_transfer_fails(); gc.collect()\n"
              "    t.test_dead_peer_default_transports(); gc.collect()\n"
              "print('survived', flush=True)\n")


def nixl_abort(runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {"what": "processes that aborted (SIGABRT) out of runs, each "
                                   "running the two nixl dead-peer tests four times",
                           "runs": runs, "settings": {}}
    for label, value in (("kvlink default (UCX keepalive off)", None),
                         ("UCX_KEEPALIVE_INTERVAL=20s (UCX's default)", "20s")):
        env = {k: v for k, v in os.environ.items() if k != "UCX_KEEPALIVE_INTERVAL"}
        if value is not None:
            env["UCX_KEEPALIVE_INTERVAL"] = value
        codes, asserted = [], 0
        for _ in range(runs):
            run = subprocess.run([sys.executable, "-c", _NIXL_CODE], cwd=TESTS, env=env,
                                 capture_output=True, text=True, timeout=600)
            codes.append(run.returncode)
            asserted += "ucs_arbiter_group_is_empty" in run.stderr
        aborted = sum(c != 0 for c in codes)
        out["settings"][label] = {"aborted": aborted, "arbiter_assertions": asserted,
                                  "exit_codes": codes}
        print(f"  {label}: {aborted} of {runs} processes aborted ({asserted} on UCX's "
              "arbiter assertion)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("mooncake", "nixl-abort"), required=True)
    ap.add_argument("--runs", type=int, default=8, help="nixl-abort: processes per setting")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    payload = mooncake() if args.case == "mooncake" else nixl_abort(args.runs)
    write_result(f"dead_peers_{args.case.replace('-', '_')}", payload, args.out)


if __name__ == "__main__":
    main()
