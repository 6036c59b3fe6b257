"""Dump the raw UCX_PROTO_INFO text of kvlink's NIXL VRAM probe, and what is parsed from it."""
import json
import sys

from kvlink_transports._ucx import measure

orig, texts = measure.parse_proto_rows, []


def cap(t):
    texts.append(t)
    return orig(t)


measure.parse_proto_rows = cap
p = measure.nixl_probe("VRAM", 64 << 20, 2)
with open(sys.argv[1], "w") as f:
    f.write(texts[0] if texts else "")
print(json.dumps({"ok": p.ok, "error": p.error, "lanes": p.lanes, "gbps": p.gbps, "rows": p.rows,
                  "all_rows": orig(texts[0]) if texts else []}, indent=1))
