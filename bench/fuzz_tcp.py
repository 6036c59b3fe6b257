"""Fuzz the tcp data plane's framing against one live owner (issue 20: hostile and broken peers).

    .venv/bin/python bench/fuzz_tcp.py [--frames 100000] [--conns 8] [--seed 0] [--no-grants]

The owner is a real TcpTransport in a subprocess (this file with ``--serve``), with
``require_grants``, a READ grant over one window of its memory and a WRITE grant over another.
From here, raw sockets send it mutated frames of the real framing (4-byte length prefix +
msgpack header + WRITE payload): bit flips, truncations, length-prefix lies, wrong ops and
versions, random extents (in, across and outside the windows, wrapping lengths), random
tickets, splices and type markers, whole garbage — after a valid hello, before one, or in
place of one. A handful of connections take turns; when the owner closes one (as it must for
most garbage) the next frame goes on a new one.

Pass criterion: zero crashes — the owner process and its accept thread alive, no uncaught
exception in any of its threads and no ERROR from ``kvlink.tcp`` (its catch-all for bugs); a
legitimate READ (a real TcpTransport client, under the READ grant) served with verified bytes
every tenth of the run and at the end; the owner's memory outside the WRITE window unchanged
(no fuzzed WRITE landed outside its grant); no byte from outside the READ window ever sent
(the owner's memory there is ``SECRET`` bytes; no run of ``SECRET_RUN`` of them may arrive on
any fuzzing connection: a fuzzed READ served outside its grant); the owner's peak RSS within
50 MiB of its start.
"""

from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import json
import logging
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import numpy as np
from _common import write_result

from kvlink.transport import Op, Region, TransportContext, XferStatus, make_extents
from kvlink.wire import decode_versioned
from kvlink_transports import tcp
from kvlink_transports.tcp import TcpTransport

MiB = 1 << 20
SIZE = 4 * MiB  # the owner's registered memory
READ_AT, READ_LEN = 0, 256 << 10  # the READ window
WRITE_AT, WRITE_LEN = 1 * MiB, 256 << 10  # the WRITE window (fuzzed WRITEs may land here)
READ_TICKET, WRITE_TICKET = b"fuzz-read-ticket", b"fuzz-writeticket"
SEED_BYTES = 11
RSS_BOUND = 50 * MiB
OWNER_OPTIONS = {"timeout_s": 1.0, "hello_timeout_s": 1.0}
SECRET = 0xEE  # every owner byte outside the READ window: none may ever be sent
SECRET_RUN = bytes([SECRET]) * 64  # (in the window's random bytes: odds 2**-512)


def owner_bytes() -> np.ndarray:
    buf = np.random.default_rng(SEED_BYTES).integers(0, 256, SIZE, dtype=np.uint8)
    buf[: READ_AT] = SECRET
    buf[READ_AT + READ_LEN :] = SECRET
    return buf


def _outside_write_window(buf: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(buf[:WRITE_AT].tobytes())
    h.update(buf[WRITE_AT + WRITE_LEN :].tobytes())
    return h.hexdigest()


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------- the owner


class _Tally(logging.Handler):
    """Counts the owner's log records by message template (no output: the fuzz is noisy)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_template: collections.Counter[str] = collections.Counter()
        self.ended: collections.Counter[str] = collections.Counter()  # why connections ended
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.by_template[f"{record.levelname} {str(record.msg)[:60]}"] += 1
        if str(record.msg).startswith("tcp: connection from") and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            self.ended[" ".join(str(args[-1]).split()[:4])] += 1
        elif str(record.msg).startswith("tcp: closed connection from") and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            self.ended["before auth: " + " ".join(str(args[-1]).split()[:3])] += 1
        if record.levelno >= logging.ERROR and len(self.errors) < 20:
            self.errors.append(self.format(record))


def serve(grants: bool = True) -> None:
    """Subprocess: the owner. One JSON line out with what peers need; then it answers each
    ``status`` line on stdin with a JSON line; it ends when stdin closes. ``grants`` False:
    the control, an owner that serves any READ of its memory."""
    tally = _Tally()
    tally.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    for name in ("kvlink.tcp", "kvlink.transport"):
        lg = logging.getLogger(name)
        lg.addHandler(tally)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    uncaught: list[str] = []

    def hook(args: threading.ExceptHookArgs) -> None:
        uncaught.append(f"{args.thread.name if args.thread else '?'}: "
                        f"{args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    buf = owner_bytes()
    t = TcpTransport(TransportContext(agent_name="owner", require_grants=grants), OWNER_OPTIONS)
    t.register([Region(buf.ctypes.data, buf.nbytes)])
    t.grant(READ_TICKET, Op.READ, make_extents(buf.ctypes.data + READ_AT, READ_LEN))
    t.grant(WRITE_TICKET, Op.WRITE, make_extents(buf.ctypes.data + WRITE_AT, WRITE_LEN))
    intact = _outside_write_window(buf)
    print(json.dumps({"descriptor": t.descriptor().hex(), "addr": buf.ctypes.data}), flush=True)
    rss0 = _proc_status("VmRSS")
    notes = 0
    for line in sys.stdin:
        notes += len(t.notifications())
        if line.strip() == "reset":  # the fuzz starts: peak RSS from here
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss0 = _proc_status("VmRSS")
        print(json.dumps({
            "acceptor_alive": t._acceptor.is_alive(),
            "threads": threading.active_count(),
            "inbound": len(t._inbound),
            "pending_hellos": t._pending,
            "uncaught": uncaught[:20],
            "uncaught_count": len(uncaught),
            "errors": tally.errors,
            "error_count": sum(n for k, n in tally.by_template.items()
                               if k.startswith(("ERROR", "CRITICAL"))),
            "refused": t.stats.refused,
            "notifications": notes,
            "rss_start": rss0, "rss": _proc_status("VmRSS"), "rss_peak": _proc_status("VmHWM"),
            "intact_outside_write_window": _outside_write_window(buf) == intact,
            "log": dict(tally.by_template.most_common(25)),
            "connections_ended": dict(tally.ended.most_common(25)),
        }), flush=True)
    t.close()


class Owner:
    def __init__(self, grants: bool = True) -> None:
        serve = ["--serve"] + ([] if grants else ["--no-grants"])
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *serve],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        self.inp: IO[str] = self.proc.stdin  # type: ignore[assignment]
        info = json.loads(self.out.readline())
        self.descriptor = bytes.fromhex(info["descriptor"])
        self.addr: int = info["addr"]
        desc = decode_versioned(self.descriptor, tcp._Descriptor, tcp._VERSION, "owner")
        self.where = (desc.host, desc.port)
        self.token: bytes = desc.token

    def status(self, cmd: str = "status") -> dict[str, Any]:
        self.inp.write(cmd + "\n")
        self.inp.flush()
        line = self.out.readline()
        if not line:
            raise RuntimeError(f"the owner process died (exit {self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        self.inp.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------- frames


def frame(hdr: tcp._Hdr) -> bytes:
    body = tcp._enc.encode(hdr)
    return struct.pack("<I", len(body)) + body


class Frames:
    """Valid frames against the owner, and their mutations."""

    KINDS = ("bit_flips", "truncate", "length_lie", "wrong_op", "wrong_version",
             "random_extents", "random_ticket", "splice", "type_marker", "garbage")

    def __init__(self, rng: random.Random, owner: Owner) -> None:
        self.rng, self.addr, self.token = rng, owner.addr, owner.token

    def ext(self, at: int, n: int, count: int = 1) -> np.ndarray:
        size = max(n // count, 1)
        return make_extents(self.addr + at + np.arange(count, dtype=np.uint64) * size, size)

    def hello(self) -> bytes:
        return frame(tcp._Hdr(tcp._VERSION, "H", agent="fuzzer", token=self.token))

    def valid(self) -> tuple[tcp._Hdr, bytes]:
        """A valid request (header, payload): READ, WRITE or notification."""
        rng = self.rng
        k = rng.randrange(4)
        count = rng.choice([1, 2, 8, 64])
        if k == 0:  # READ under the READ grant
            n = rng.choice([64, 4096, 65536])
            ext = self.ext(READ_AT + rng.randrange(READ_LEN - n + 1), n, count)
            return tcp._Hdr(tcp._VERSION, "R", agent="fuzzer", extents=memoryview(ext.tobytes()),
                            ticket=READ_TICKET), b""
        if k == 1:  # WRITE under the WRITE grant, with a notification
            n = rng.choice([64, 4096])
            ext = self.ext(WRITE_AT + rng.randrange(WRITE_LEN - n + 1), n, count)
            payload = rng.randbytes(int(ext["len"].sum()))
            return tcp._Hdr(tcp._VERSION, "W", agent="fuzzer", extents=memoryview(ext.tobytes()),
                            notify=b"written", ticket=WRITE_TICKET), payload
        if k == 2:  # WRITE into the READ window under the READ grant: must be refused
            ext = self.ext(READ_AT, 64)
            return tcp._Hdr(tcp._VERSION, "W", agent="fuzzer", extents=memoryview(ext.tobytes()),
                            ticket=READ_TICKET), b"\xee" * 64
        return tcp._Hdr(tcp._VERSION, "N", agent="fuzzer", notify=rng.randbytes(16)), b""

    def random_extents(self) -> np.ndarray:
        rng = self.rng
        count = rng.choice([0, 1, 3, 17, 512, 513, 4096])
        addr = np.empty(count, dtype=np.uint64)
        length = np.empty(count, dtype=np.uint64)
        for i in range(count):
            where = rng.randrange(6)
            if where == 0:
                addr[i] = self.addr + rng.randrange(SIZE)  # anywhere in registered memory
            elif where == 1:
                addr[i] = self.addr + READ_AT + READ_LEN - rng.randrange(64)  # across the end
            elif where == 2:
                addr[i] = rng.getrandbits(64)
            elif where == 3:
                addr[i] = self.addr + WRITE_AT + rng.randrange(WRITE_LEN)
            else:
                addr[i] = self.addr + READ_AT + rng.randrange(READ_LEN)
            length[i] = rng.choice([0, 1, 64, 4096, 2**63, 2**64 - 1, rng.getrandbits(64)])
        return make_extents(addr, length)

    def mutated(self) -> tuple[str, bytes]:
        rng = self.rng
        kind = rng.choice(self.KINDS)
        hdr, payload = self.valid()
        if kind == "wrong_op":
            op = rng.choice(["", "X", "A", "E", "H", "RR", "r", rng.randbytes(3).hex()])
            hdr = tcp._Hdr(hdr.v, op, hdr.agent, hdr.extents, hdr.notify, hdr.reason, hdr.token,
                           hdr.ticket)
        elif kind == "wrong_version":
            v = rng.choice([0, 1, 3, -1, 2**31, 2**63 - 1])
            hdr = tcp._Hdr(v, hdr.op, hdr.agent, hdr.extents, hdr.notify, hdr.reason, hdr.token,
                           hdr.ticket)
        elif kind == "random_extents":
            ext = self.random_extents()
            hdr = tcp._Hdr(hdr.v, rng.choice(["R", "W"]), hdr.agent, memoryview(ext.tobytes()),
                           hdr.notify, hdr.reason, hdr.token,
                           rng.choice([READ_TICKET, WRITE_TICKET, b""]))
            payload = rng.randbytes(min(int(ext["len"].astype(object).sum()), 8192))
        elif kind == "random_ticket":
            hdr = tcp._Hdr(hdr.v, hdr.op, hdr.agent, hdr.extents, hdr.notify, hdr.reason,
                           hdr.token, rng.choice([b"", rng.randbytes(16), rng.randbytes(1000)]))
        elif kind == "garbage":
            return kind, rng.randbytes(rng.randint(0, 512))
        b = bytearray(frame(hdr) + (payload if hdr.op == "W" else b""))
        if kind == "bit_flips":
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del b[rng.randrange(len(b)) :]
        elif kind == "length_lie":
            n = rng.choice([0, 1, 4, len(b) - 5, len(b) + 1, 1 << 12, 1 << 16, 1 << 24, 17 << 20,
                            1 << 26, 2**32 - 1, rng.getrandbits(32)])
            b[:4] = struct.pack("<I", max(0, min(n, 2**32 - 1)))
        elif kind == "splice":
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif kind == "type_marker":
            b[4 + rng.randrange(len(b) - 4)] = rng.choice(
                [0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xD9, 0xC6, 0x92, 0x9F])
        return kind, bytes(b)


# ---------------------------------------------------------------------------- the fuzzer's side


class Closed(Exception):
    pass


class Conn:
    """One raw connection to the owner. Sends and drains together (select), so a READ the
    owner answers can never deadlock against our sending."""

    def __init__(self, owner: Owner, frames: Frames, stats: collections.Counter[str]) -> None:
        self.sock = socket.create_connection(owner.where, timeout=5)
        self.sock.setblocking(False)
        self.stats = stats
        self.tail = b""  # the last bytes received: a SECRET_RUN split across two recv()s
        stats["connections"] += 1
        rng = frames.rng
        r = rng.random()
        if r < 0.08:  # garbage before (or instead of) a hello
            stats["prelude_garbage"] += 1
            self.send(rng.choice([rng.randbytes(rng.randint(1, 64)),
                                  struct.pack("<I", rng.getrandbits(32)) + rng.randbytes(8),
                                  bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.1 else b
                                        for b in frames.hello())]))
        elif r < 0.12:  # a well-formed hello with the wrong key
            stats["prelude_bad_key"] += 1
            self.send(frame(tcp._Hdr(tcp._VERSION, "H", agent="fuzzer",
                                     token=rng.randbytes(16))))
        else:
            self.send(frames.hello())

    def drain(self) -> None:
        while True:
            try:
                got = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise Closed(str(exc)) from exc
            if not got:
                raise Closed("closed by the owner")
            self.stats["bytes_received"] += len(got)
            seen = self.tail + got
            if SECRET_RUN in seen:  # bytes from outside the READ window: a leak
                self.stats["secret_runs_received"] += 1
            self.tail = seen[-(len(SECRET_RUN) - 1):]

    def send(self, data: bytes, timeout: float = 3.0) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + timeout
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Closed("stalled")  # the owner waits for a header's end: let it time out
            r, w, _ = select.select([self.sock], [self.sock], [], left)
            if r:
                self.drain()
            if w:
                try:
                    n = self.sock.send(view)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    raise Closed(str(exc)) from exc
                view = view[n:]
                self.stats["bytes_sent"] += n
        self.drain()

    def close(self) -> None:
        self.sock.close()


def legit_read(client: TcpTransport, local: np.ndarray, owner: Owner, want: np.ndarray
               ) -> dict[str, Any]:
    t0 = time.monotonic()
    h = client.post(Op.READ, "owner", make_extents(local.ctypes.data, READ_LEN),
                    make_extents(owner.addr + READ_AT, READ_LEN), ticket=READ_TICKET)
    state = client.wait(h, 10.0)
    client.release(h)
    took = time.monotonic() - t0
    ok = state.status is XferStatus.DONE and bool(np.array_equal(local, want))
    local[:] = 0
    return {"ms": round(took * 1e3, 2), "verified": ok, "reason": state.reason}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-grants", action="store_true",
                    help="the control: an owner without require_grants, whose fuzzed READs "
                         "outside the window are served (the leak check must fail)")
    args = ap.parse_args()
    if args.serve:
        serve(not args.no_grants)
        return
    rng = random.Random(args.seed)
    owner = Owner(not args.no_grants)
    client = TcpTransport(TransportContext(agent_name="legit-reader"))
    local = np.zeros(READ_LEN, dtype=np.uint8)
    client.register([Region(local.ctypes.data, local.nbytes)])
    client.connect("owner", owner.descriptor)
    want = owner_bytes()[READ_AT : READ_AT + READ_LEN]
    reads = [dict(legit_read(client, local, owner, want), at_frame=0)]
    start = owner.status("reset")
    frames = Frames(rng, owner)
    stats: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    valid = 0
    conns: list[Conn | None] = [None] * args.conns
    t0 = time.perf_counter()
    for i in range(args.frames):
        slot = i % args.conns
        try:
            conn = conns[slot]
            if conn is None:
                conn = conns[slot] = Conn(owner, frames, stats)
            if rng.random() < 0.1:  # a valid request now and then, on the same connection
                hdr, payload = frames.valid()
                valid += 1
                conn.send(frame(hdr) + (payload if hdr.op == "W" else b""))
            kind, data = frames.mutated()
            kinds[kind] += 1
            conn.send(data)
        except Closed as exc:
            stats["closed_by_owner" if "stalled" not in str(exc) else "closed_stalled"] += 1
            if conns[slot] is not None:
                conns[slot].close()  # type: ignore[union-attr]
            conns[slot] = None
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ECONNRESET):
                raise
            stats["connect_failed"] += 1
            conns[slot] = None
        if (i + 1) % (args.frames // 10 or 1) == 0:
            reads.append(dict(legit_read(client, local, owner, want), at_frame=i + 1))
            st = owner.status()
            print(f"  {i + 1}/{args.frames} frames, {stats['connections']} connections, "
                  f"refused {st['refused']}, crashes {st['uncaught_count'] + st['error_count']}, "
                  f"legit READ {reads[-1]['ms']} ms {'ok' if reads[-1]['verified'] else 'BAD'}, "
                  f"owner RSS {st['rss'] / MiB:.0f} MiB", flush=True)
    seconds = time.perf_counter() - t0
    for c in conns:
        if c is not None:
            c.close()
    reads.append(dict(legit_read(client, local, owner, want), at_frame=args.frames))
    end = owner.status()
    client.close()
    owner.close()
    grew = end["rss_peak"] - start["rss_start"]
    crashes = end["uncaught_count"] + end["error_count"] + (0 if end["acceptor_alive"] else 1)
    ok = {
        "zero_crashes": crashes == 0,
        "acceptor_alive": end["acceptor_alive"],
        "legit_reads_verified": all(r["verified"] for r in reads),
        "intact_outside_write_window": end["intact_outside_write_window"],
        "nothing_read_outside_read_window": stats["secret_runs_received"] == 0,
        "rss_within_bound": grew < RSS_BOUND,
    }
    print(f"{args.frames} mutated frames (+{valid} valid) in {seconds:.1f}s "
          f"({args.frames / seconds:.0f}/s) over "
          f"{stats['connections']} connections: {crashes} crashes, owner refused "
          f"{end['refused']}, legit READs {sum(r['verified'] for r in reads)}/{len(reads)} "
          f"verified, owner peak RSS +{grew / MiB:.1f} MiB; {ok}")
    write_result("fuzz_tcp", {
        "frames": args.frames, "valid_frames_interleaved": valid, "grants": not args.no_grants,
        "conns": args.conns, "seed": args.seed,
        "seconds": seconds, "frames_per_second": args.frames / seconds,
        "mutations": dict(kinds), "client": dict(stats),
        "crashes": crashes, "crash_samples": end["uncaught"] + end["errors"],
        "checks": ok, "passed": all(ok.values()),
        "legit_reads": reads,
        "owner": {"refused": end["refused"], "notifications": end["notifications"],
                  "threads_at_end": end["threads"], "inbound_at_end": end["inbound"],
                  "rss_start_mib": start["rss_start"] / MiB, "rss_end_mib": end["rss"] / MiB,
                  "rss_peak_mib": end["rss_peak"] / MiB, "rss_bound_mib": RSS_BOUND / MiB,
                  "options": OWNER_OPTIONS, "connections_ended": end["connections_ended"],
                  "log": end["log"]},
    }, args.json)
    raise SystemExit(0 if all(ok.values()) else 1)


if __name__ == "__main__":
    main()
