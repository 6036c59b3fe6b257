"""Fuzz every wire decoder: random bytes, and valid messages mutated (flips, truncation, splices).

    .venv/bin/python bench/fuzz_wire.py [--cases 100000]

Pass criterion: zero crashes — every input either decodes to a message or raises WireError.
The baseline beside the count is the same loop over valid messages only (decode cost per case).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np
from _common import write_result

from kvlink import wire
from kvlink.compat import WIRE_VERSION
from kvlink.errors import WireError
from kvlink.layout import KVCacheSpec


def seeds() -> list[bytes]:
    spec = KVCacheSpec.from_arrays([np.zeros((2, 4, 16, 2, 8), np.uint16)] * 2, dtype="bfloat16")
    v = WIRE_VERSION
    msgs: list[Any] = [
        wire.HandshakeRequest(v=v, engine_id="e", agent_name="a", tp_rank=0, tp_size=2,
                              host_id="h", compat="c"),
        wire.HandshakeResponse(v=v, engine_id="e", agent_name="a", tp_rank=1, tp_size=2,
                               host_id="h", compat="c", spec=wire.SpecMsg.of(spec),
                               transports={"tcp": b"x" * 40}),
        wire.Notification(v=v, engine_id="e", req_id="r", tp_rank=0, tp_size=1),
        wire.PushRequest(v=v, engine_id="e", agent_name="a", req_id="r", tp_rank=0, tp_size=1,
                         host="127.0.0.1", port=5600, block_ids=list(range(64))),
        wire.ReadIntent(v=v, engine_id="e", req_id="r", tp_rank=0),
        wire.ErrorReply(v=v, code="x", message="y"), wire.Ack(v=v),
        wire.Challenge(v=v, nonce=b"n" * 16),
        wire.Signed(v=v, nonce=b"n" * 16, mac=b"m" * 32, body=b"b"),
    ]
    return [wire.encode(m) for m in msgs]


def mutate(rng: random.Random, buf: bytes) -> bytes:
    b = bytearray(buf)
    kind = rng.randrange(5)
    if kind == 0 and b:  # bit flips
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 2:  # splice random bytes
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    elif kind == 3:
        return rng.randbytes(rng.randint(0, 256))
    else:  # overwrite a byte with a msgpack type marker
        if b:
            b[rng.randrange(len(b))] = rng.choice([0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xD9, 0x92])
    return bytes(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = seeds()
    t0 = time.perf_counter()
    for i in range(args.cases):
        wire.decode(base[i % len(base)])
    t_valid = time.perf_counter() - t0
    counts = {"decoded": 0, "rejected": 0, "crashed": 0}
    crashes: list[str] = []
    t0 = time.perf_counter()
    for i in range(args.cases):
        buf = mutate(rng, base[i % len(base)])
        try:
            wire.decode(buf)
            counts["decoded"] += 1
        except WireError:
            counts["rejected"] += 1
        except Exception as exc:  # the point of the fuzz: this must never happen
            counts["crashed"] += 1
            if len(crashes) < 20:
                crashes.append(f"{type(exc).__name__}: {exc} on {buf[:64].hex()}")
        if (i + 1) % (args.cases // 10 or 1) == 0:
            print(f"  {i + 1}/{args.cases} cases, {counts['crashed']} crashes", flush=True)
    t_fuzz = time.perf_counter() - t0
    print(f"{args.cases} cases: {counts}; {t_fuzz / args.cases * 1e6:.1f} us/case vs "
          f"{t_valid / args.cases * 1e6:.1f} us for valid messages")
    write_result("fuzz_wire", {"cases": args.cases, **counts, "crash_samples": crashes,
                               "fuzz_seconds": t_fuzz, "valid_baseline_seconds": t_valid,
                               "ratio_time_vs_valid": t_fuzz / t_valid}, args.json)
    raise SystemExit(1 if counts["crashed"] else 0)


if __name__ == "__main__":
    main()
