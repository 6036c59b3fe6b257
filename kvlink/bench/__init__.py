"""`kvlink bench`: transfer bandwidth vs block size, each figure beside same-run baselines.

Two halves, one protocol, so that the one-host run and the two-host run are the same code:

* the **server** (``kvlink bench --server``, :mod:`kvlink.bench.server`) listens on a control
  port (default :data:`DEFAULT_PORT`). Per client it allocates the buffer the client asks for,
  registers it with every transport the client names, and answers with their descriptors; it
  then only serves (the transports move the bytes on their own threads) and starts its half of
  each ``ucx_perftest`` when the client asks. It serves one client after the other until Ctrl-C
  or SIGTERM (``--once``: the first only).
* the **client** (``kvlink bench HOST``, :mod:`kvlink.bench.client`) connects to HOST:PORT,
  registers a buffer of the same size, and runs the sweep: per block size, a batch of ``n``
  extents spread at random over the buffer, READ and WRITE, ``--warmup`` untimed posts then
  ``--reps`` timed ones (each post -> DONE is one latency sample).
* plain ``kvlink bench`` (no HOST) spawns a server on 127.0.0.1 (a free port, dying with its
  parent, under a random secret of this run's) and runs the client against it: the table is
  the one a two-shell run prints.

The control protocol (:mod:`kvlink.bench.wire`): versioned msgspec Structs, a tagged union,
strictly decoded, msgpack in length-prefixed frames, each bounded (64 KiB from a client, 16 MiB
from the server); descriptors are ``bytes`` fields, nothing is pickled. A frame over its bound,
cut, late, malformed or of another protocol version is answered with an error naming it and its
connection closed; the server then serves the next client.

Who may connect: anyone who reaches the control port gets descriptors to read and write the
server's scratch buffer (nothing else). So, as kvlink's side channel does, the server binds
127.0.0.1 by default, and a non-loopback ``--bind`` needs a shared secret (``--secret`` or
``KVLINK_SECRET``, the same on both hosts: each side then proves it with HMAC-SHA256 over the
other's fresh nonce, a wrong secret is refused naming it) or ``--insecure`` (a network you
trust; one warning line). The secret authenticates the control connection; it does not encrypt.

Baselines (:mod:`kvlink.bench.baselines`), measured in the same run (``baselines`` in the JSON
says where each ran and how): ``ucx_perftest`` host-to-host (its server started by the bench
server on the server's host, its client here, ``-t ucp_get`` for READ, ``ucp_put_bw`` for
WRITE), moving as many bytes as the timed kvlink posts of the point; memcpy of the same extents
in one process on the client host (local only: the single-host ceiling); ``ib_write_bw`` only
where an RDMA device exists (detected, never faked: the JSON says why it did not run). The
table, the JSON and the PNG: :mod:`kvlink.bench.report`.
"""

from __future__ import annotations

from kvlink.bench.client import SIZES, BenchPeer, SweepConfig, run_sweep
from kvlink.bench.facts import MiB, machine, versions
from kvlink.bench.report import COLUMNS, plot, run_and_write, table
from kvlink.bench.server import check_bind, local_server, run_server, serve
from kvlink.bench.wire import DEFAULT_PORT, PROTOCOL

__all__ = ["COLUMNS", "DEFAULT_PORT", "PROTOCOL", "SIZES", "BenchPeer", "MiB", "SweepConfig",
           "check_bind", "local_server", "machine", "plot", "run_and_write",
           "run_server", "run_sweep", "serve", "table", "versions"]
