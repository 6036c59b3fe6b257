"""Worker side: register memory, handshake, post READ/WRITE, poll, report.

Never decides policy (that is the scheduler's): it is told which blocks to move and reports
which requests finished or failed. Only handshakes run on helper threads (a slow peer never
blocks the caller); everything per request — planning, posting, polling, the read report and
its verdict — runs on the caller's thread inside :meth:`KVWorker.read` / :meth:`KVWorker.poll`,
over one kept-open session per peer (:mod:`kvlink.channel`), so a caller that polls in a tight
loop starves nothing the request waits for.

Block ownership (the invariant: a block is reused only when no peer can still touch it):

- **Pull, validate after read.** A producer holds a request's blocks in :attr:`KVWorker.leases`
  (:class:`kvlink.leases.BlockLeases`). A reader told the hold's generation (with the block
  ids, as a router passes them) posts its READ at once and reports ``ReadDone`` (generation,
  block ids) after: intact only if that generation still holds those blocks, which — the
  generation minted before any reader knew it — means held for the whole READ. Otherwise the
  reader first sends a ``ReadIntent`` (the block ids
  it will read, the producer incarnation it handshook with) and gets a ``ReadGrant`` (the
  lease's generation and how long it holds). It does not post past that deadline. After its
  READ is DONE it sends ``ReadDone`` with the generation and gets a ``ReadVerdict``: only
  "intact" makes the request finished; a lease that ended under the READ makes it failed. A
  READ that fails (or is never posted) sends ``ReadDone(ok=False)``, releasing the producer at
  once. Unread replicas (heterogeneous TP) are released the same way, finished or failed.
- **Push, cancel and ack** (:mod:`kvlink.push`): a push carries an id and a time to live; the
  prefill never posts after either runs out or a cancel arrives; a decode that timed out
  cancels and frees its blocks only on an answer, or once its transport fenced the prefill off.
- **Incarnation.** Every handshake answer carries the producer's random incarnation; intents
  and done reports carry it back. A restarted producer answers "stale", and the reader
  handshakes again instead of reading through old mappings or keys. Peers are cached by engine
  id *and* address, so two engines sharing an id are never mixed up.
- **Transport contract** (:mod:`kvlink.transport`): FAILED means no byte can still land, so a
  failed part is safe to report. A failed transfer does not tear down the peer: other
  requests' transfers to it keep going.

:meth:`KVWorker.close` returns within ``close_timeout`` whatever the peers do: queued reports
get until then, the rest are cancelled.

The jobs are split by module, bottom to top, each importing only those below it: ``config``
(:class:`WorkerConfig`), ``records`` (what is kept per request, part and push), ``ledger``
(what callers read back about ended transfers, written off the reporting poll), ``peering``
(the side channel both ways: handshakes, kept-open sessions, our handshake answer), ``holds``
(producer side of a pull: holds, leases, grants, the answers to readers), ``parts`` (one part
of a transfer, handshake to verdict), ``requests`` (a request begun, stepped and reported),
``decode_push`` and ``prefill_push`` (the two sides of push mode), and ``engine``
(:class:`KVWorker`: its state, setup, the poll loop, close). This face hands on the names the
rest of kvlink imports from here.
"""

from kvlink.peers import RemoteEngine
from kvlink.worker.config import DEFAULT_POLL_GRACE_US, WorkerConfig
from kvlink.worker.engine import KVWorker
from kvlink.worker.records import Phases, Transfer

__all__ = ["DEFAULT_POLL_GRACE_US", "KVWorker", "Phases", "RemoteEngine", "Transfer",
           "WorkerConfig"]
