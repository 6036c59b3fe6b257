"""A peer whose host vanishes without closing (powered off, cut off) gives its connection back
(kvlink.sockets.keepalive): the tcp owner a reader's kept-open connection (the tcp option
``keepalive_s``), the bench server a client's control connection
(``kvlink.bench.wire.KEEPALIVE_S``), the side channel a peer's session (``keepalive_s``).

Real TcpTransports, bench server and side channel over real sockets, in a network namespace
of their own (``unshare --net``, this file run as a script), whose loopback is taken down once
the connection is up: from then on no packet of it arrives anywhere and neither side closes it
— a vanished host as the server sees it, which no process on this machine can otherwise
produce on demand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
from procgroup import unshare_or_skip
from test_transport_contract import wait_until

from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink_transports.tcp import TcpTransport

SIZE = 1 << 20


def _loopback(state: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", state], check=True)


def _read(reader: TcpTransport, owner: TcpTransport, theirs: np.ndarray) -> Any:
    mine = np.zeros(4096, dtype=np.uint8)
    reader.register([Region(mine.ctypes.data, mine.nbytes)])
    reader.connect("owner", owner.descriptor())
    h = reader.post(Op.READ, "owner", make_extents(mine.ctypes.data, mine.nbytes),
                    make_extents(theirs.ctypes.data, mine.nbytes))
    state = reader.wait(h, 10.0)
    return state.status is XferStatus.DONE and bool(np.array_equal(mine, theirs[:4096]))


def _scenario() -> dict[str, Any]:
    """In the namespace: an owner with room for one connection, reader A's READ, A's host gone
    (the loopback down), then reader B's READ once the loopback is back."""
    _loopback("up")
    theirs = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    ctx = TransportContext(agent_name="owner", host="127.0.0.1")
    owner = TcpTransport(ctx, {"max_connections": 1, "keepalive_s": 1.0})
    owner.register([Region(theirs.ctypes.data, theirs.nbytes)])
    out: dict[str, Any] = {}
    a = TcpTransport(TransportContext(agent_name=f"a-{uuid.uuid4().hex[:6]}", host="127.0.0.1"),
                     {"keepalive_s": 0})  # (the reader's own probes: not what is tested)
    out["a_read"] = _read(a, owner, theirs)
    out["a_connections"] = len(owner._inbound)
    _loopback("down")
    t0 = time.monotonic()
    ended = wait_until(lambda: not owner._inbound, 20.0)
    out["ended_after_s"] = round(time.monotonic() - t0, 2) if ended else None
    _loopback("up")
    b = TcpTransport(TransportContext(agent_name=f"b-{uuid.uuid4().hex[:6]}", host="127.0.0.1"),
                     {"keepalive_s": 0})
    out["b_read"] = _read(b, owner, theirs)
    for t in (b, owner):
        t.close()
    return out


def _bench_scenario() -> dict[str, Any]:
    """In the namespace: a bench server for one client; the client's hello and ready, then
    its host gone (the loopback down): the server's session must end."""
    from kvlink.bench import wire
    from kvlink.bench.client import BenchPeer, SweepConfig
    from kvlink.bench.server import serve

    _loopback("up")
    wire.KEEPALIVE_S = 1.0  # (the test's setting: 30 s would take a minute)
    port: list[int] = []
    said: list[str] = []
    server = threading.Thread(target=serve, args=("127.0.0.1", 0, True),
                              kwargs={"ready": lambda _h, p: port.append(p),
                                      "say": said.append}, daemon=True)
    server.start()
    assert wait_until(lambda: bool(port), 30.0), "the bench server did not start"
    peer = BenchPeer("127.0.0.1", port[0], 30.0)
    peer.hello(SweepConfig(total=4096, transports=["tcp"], perftest=False), ["tcp"])
    _loopback("down")
    t0 = time.monotonic()
    ended = wait_until(lambda: not server.is_alive(), 20.0)
    _loopback("up")
    return {"ended_after_s": round(time.monotonic() - t0, 2) if ended else None, "said": said}


def _side_scenario() -> dict[str, Any]:
    """In the namespace: a side channel server with room for one connection, a worker's
    kept-open session (kvlink.channel) answered, its host gone, then a new peer's request."""
    from kvlink import sidechannel, wire
    from kvlink.channel import Channels
    from kvlink.compat import WIRE_VERSION

    _loopback("up")
    key = b"k" * 32
    srv = sidechannel.SideChannelServer("127.0.0.1", 0, lambda m: wire.Ack(v=WIRE_VERSION),
                                        secret=key, max_connections=1, keepalive_s=1.0)
    chan = Channels(key)
    note = wire.Notification(v=WIRE_VERSION, engine_id="a", req_id="r", tp_rank=0, tp_size=1)
    pending = chan.call("127.0.0.1", srv.port, note, 5.0)
    chan.flush()
    while not pending.done():  # the call's own deadline ends this
        chan.wait(0.05)
    out: dict[str, Any] = {"a_answered": isinstance(pending.result(), wire.Ack),
                           "a_connections": srv.stats()["connections"]}
    _loopback("down")
    t0 = time.monotonic()
    ended = wait_until(lambda: srv.stats()["connections"] == 0, 20.0)
    out["ended_after_s"] = round(time.monotonic() - t0, 2) if ended else None
    _loopback("up")
    hs = wire.HandshakeRequest(v=WIRE_VERSION, engine_id="b", agent_name="b/0", tp_rank=0,
                               tp_size=1, host_id="h", compat="")
    try:
        out["b"] = type(sidechannel.request("127.0.0.1", srv.port, hs, 5.0, key)).__name__
    except Exception as exc:
        out["b"] = f"{type(exc).__name__}: {exc}"
    srv.close()
    return out


def _in_a_network_namespace(scenario: str) -> dict[str, Any]:
    """This file's ``scenario`` run under ``unshare --net``; skipped where that cannot run."""
    unshare_or_skip("--net", "ip")
    run = subprocess.run(["unshare", "--net", sys.executable, __file__, scenario],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    print(got)
    return got


def test_a_vanished_readers_connection_ends_and_frees_its_place() -> None:
    """Old code (no keepalive): the owner's connection to a reader whose host vanished stayed
    open for good — its serving thread, its descriptor and one of ``max_connections`` — so
    with room for one connection every reader after it was refused. Now the kernel's probes
    end it within ~2x ``keepalive_s`` (1 s here: ~5 s), and the next reader is served."""
    got = _in_a_network_namespace("tcp")
    assert got["a_read"] and got["a_connections"] == 1, got
    assert got["ended_after_s"] is not None and got["ended_after_s"] < 15.0, got
    assert got["b_read"], got


def test_a_vanished_bench_client_does_not_hold_the_server() -> None:
    """Old code: the bench server, which serves one client after the other, waited for a
    vanished client's next message for good — every client behind it too. Now its session
    ends within ~2x the keepalive (1 s here) and the server goes on (here: returns, once)."""
    got = _in_a_network_namespace("bench")
    assert got["ended_after_s"] is not None and got["ended_after_s"] < 15.0, got
    assert any("ended" in line for line in got["said"]), got


def test_a_vanished_peers_side_channel_session_ends_and_frees_its_place() -> None:
    """Old code: a side channel session whose peer host vanished stayed open for good, and
    authenticated sessions are never evicted for a newcomer — with room for one (1024 by
    default: a prefill's after that many vanished decodes), every later peer was refused.
    Now it ends within ~2x the keepalive (1 s here) and the next peer is answered."""
    got = _in_a_network_namespace("side")
    assert got["a_answered"] and got["a_connections"] == 1, got
    assert got["ended_after_s"] is not None and got["ended_after_s"] < 15.0, got
    assert got["b"] == "Ack", got


if __name__ == "__main__":
    run = {"tcp": _scenario, "bench": _bench_scenario, "side": _side_scenario}[sys.argv[1]]
    print(json.dumps(run()), flush=True)
