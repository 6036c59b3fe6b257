"""What a NIXL notification costs the transfers after it, and whether NIXL's threading options
work, between two processes on this machine (kvlink's nixl transport on both sides).

Run:  .venv/bin/python bench/nixl_notify_wait.py [--out FILE]

1. ``after_notification``: a target that progresses its UCX worker only every 0.2 s (kvlink's
   transport with ``progress_interval`` 0.2); 64 KiB READs in sequence: four without a
   notification, four with one, then four without again. Per READ: wall time post -> DONE and
   NIXL's telemetry (``postDuration``, ``xferDuration``; equal when the READ was DONE inside
   the post call). The baseline is the first group: READs on the same endpoint without any
   notification.
2. ``options``: the same transport options on both sides (``progress_thread``, ``num_threads``,
   both), four READs alternating without and with a notification, target at the default
   cadence: do they complete, and how long they take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from _common import write_result  # noqa: E402

N = 64 << 10


def reads(opts: dict[str, Any], peer_opts: dict[str, Any],
          pattern: list[bool]) -> list[dict[str, float]]:
    """READs of N bytes, each with a notification where ``pattern`` says, one at a time."""
    from test_nixl_transport import OPTS, TIMEOUT, Peer

    from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
    from kvlink_transports.nixl import NixlTransport

    t = NixlTransport(TransportContext(agent_name=f"wait-{uuid.uuid4().hex[:6]}"),
                      {**OPTS, **opts, "telemetry": True})
    buf = np.zeros(16 * N, np.uint8)
    peer = Peer(f"peer-{uuid.uuid4().hex[:6]}", 16 * N, seed=9, opts={**opts, **peer_opts})
    out = []
    try:
        t.register([Region(buf.ctypes.data, buf.nbytes)])
        t.connect(peer.name, peer.descriptor)
        assert peer.call("connect", t.ctx.agent_name, t.descriptor()) == "ok"
        warm = t.post(Op.READ, peer.name, make_extents(buf.ctypes.data, 4096),
                      make_extents(peer.addr, 4096))  # UCX wire-up, not counted
        assert t.wait(warm, TIMEOUT).status is XferStatus.DONE
        t.release(warm)
        ref = peer.reference()
        for i, notify in enumerate(pattern):
            at = (i % 16) * N
            t0 = time.perf_counter()
            h = t.post(Op.READ, peer.name, make_extents(buf.ctypes.data, N),
                       make_extents(peer.addr + at, N), b"n%d" % i if notify else None)
            state = t.wait(h, TIMEOUT)
            wall = time.perf_counter() - t0
            tel = t.xfer_telemetry(h) if state.status is XferStatus.DONE else []
            t.release(h)
            if state.status is not XferStatus.DONE:
                raise RuntimeError(f"READ {i} with {opts}: {state.reason}")
            if not np.array_equal(buf[:N], ref[at:at + N]):
                raise RuntimeError(f"READ {i} with {opts}: bytes differ")
            out.append({"notification": float(notify), "wall_ms": wall * 1e3,
                        "post_us": sum(e["post_us"] for e in tel),
                        "xfer_us": sum(e["xfer_us"] for e in tel)})
    finally:
        peer.stop()
        t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    groups = [False] * 4 + [True] * 4 + [False] * 4
    seq = reads({}, {"progress_interval": 0.2}, groups)
    names = ["before"] * 4 + ["with"] * 4 + ["after"] * 4
    summary: dict[str, dict[str, Any]] = {}
    for name in ("before", "with", "after"):
        rows = [r for r, n in zip(seq, names) if n == name]
        summary[name] = {"wall_ms": [round(r["wall_ms"], 3) for r in rows],
                         "done_at_post": sum(r["xfer_us"] == r["post_us"] for r in rows)}
        print(f"{name:7s} wall ms {summary[name]['wall_ms']}")
    base = statistics.median(summary["before"]["wall_ms"])
    ratios = {f"{n}_p50_over_before": statistics.median(summary[n]["wall_ms"]) / base
              for n in ("with", "after")}
    print(ratios)

    options: dict[str, Any] = {}
    for label, opts in (("default", {}), ("progress_thread", {"progress_thread": True}),
                        ("num_threads_4", {"num_threads": 4}),
                        ("both", {"progress_thread": True, "num_threads": 4})):
        rows = reads(opts, {}, [False, True, False, True])
        options[label] = {"options": opts, "wall_ms": [round(r["wall_ms"], 3) for r in rows]}
        print(f"{label:16s} wall ms {options[label]['wall_ms']}")

    write_result("nixl_notify_wait", {
        "description": __doc__.split("\n\n")[0],
        "read_bytes": N,
        "after_notification": {"target_progress_interval_s": 0.2, "groups": summary,
                               "ratios": ratios, "raw": seq},
        "options": options,
    }, args.out)


if __name__ == "__main__":
    main()
