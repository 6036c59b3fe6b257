"""A caller that polls in a tight Python loop still takes what its peers send at once.

Each process here is real (a spawned prefill, this process the decode), over the real tcp
transport and side channel. The decode's loop is ``poll()`` and nothing else, with the
interpreter's switch interval raised to 1 s: a message that only the side channel's own thread
serves (it needs the GIL, which the loop gives up once per switch interval) then waits about a
second. The layer-wise push below sends 9 messages (8 "layers" notes, then "written"), so the
code before ``SideChannelServer.serve_ready`` (the caller's poll serving its own inbox) took 9 s
or more; it must take well under one interval each now.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback
from typing import Any

import numpy as np

from kvlink.demo import data
from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

GEO = data.Geometry(layers=8, kv_heads=2, head_dim=8, block_size=4)
HELD, LOCAL = [2, 3, 9], [5, 6, 7]
INTERVAL = 1.0  # the decode's switch interval, seconds


def _rank(engine: str, seed: int) -> tuple[KVWorker, Any]:
    buf, layers = data.allocate(GEO, 16, 1, 0)
    buf[:] = np.random.default_rng(seed).integers(1, 2**16, buf.shape, dtype=np.uint16)
    w = KVWorker(WorkerConfig(engine_id=engine, serve_pushes=True))
    w.register(data.spec_of(GEO, layers, 1, 0))
    return w, (buf, layers)


def _prefill(q: Any, go: Any) -> None:
    """Hold, wait for the decode's push request, push it layer by layer, keep polling."""
    try:
        w, keep = _rank("p", 1)
        w.hold("r0", HELD)
        q.put(("port", w.side_port, [np.asarray(keep[1][i])[:, HELD].tobytes()
                                     for i in range(GEO.layers)]))
        deadline = time.monotonic() + 30
        while not (msgs := w.push_requests()):
            assert time.monotonic() < deadline, "no push request came"
            time.sleep(0.001)
        (msg,) = msgs
        for i in range(GEO.layers):
            w.push(msg, HELD, lease="r0", layers=(i, i + 1))
        while go.empty():  # until the decode is done: our poll sends the notes
            w.poll()
            time.sleep(0.0005)
        w.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise


def test_a_tight_poll_loop_takes_a_layer_wise_push_without_switch_interval_waits() -> None:
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_prefill, args=(q, go), daemon=True)
    child.start()
    decode, keep = _rank("d", 2)
    old = sys.getswitchinterval()
    try:
        got = q.get(timeout=60)
        assert got[0] == "port", got[1]
        _, port, want = got
        decode.expect_push("r0", RemoteEngine("p", "127.0.0.1", port), LOCAL, timeout=30)
        sys.setswitchinterval(INTERVAL)
        t0 = time.monotonic()
        done: set[str] = set()
        failed: dict[str, str] = {}
        while "r0" not in done and "r0" not in failed and time.monotonic() - t0 < 30:
            d, f = decode.poll()  # and nothing else: a busy caller
            done |= d
            failed.update(f)
        took = time.monotonic() - t0
        sys.setswitchinterval(old)
        assert not failed, failed
        assert "r0" in done, "the push did not finish within 30 s"
        for i in range(GEO.layers):
            assert np.asarray(keep[1][i])[:, LOCAL].tobytes() == want[i], f"layer {i}"
        # 9 messages; before, each waited out about one interval (about 9 s in all)
        assert took < 3 * INTERVAL, f"took {took:.2f} s with a {INTERVAL} s switch interval"
    finally:
        sys.setswitchinterval(old)
        go.put("stop")
        child.join(10)
        if child.is_alive():
            child.kill()
        decode.close()
