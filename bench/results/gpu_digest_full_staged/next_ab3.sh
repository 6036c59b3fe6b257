#!/bin/bash
# one device call: full's order c (HEAD: block-major) against d (this tree: KV_GROUPS segments
# of one block a block of threads, blocks in turn); the io bench in runs of 20; this tree's
# GPU checks
set -u
mkdir -p /tmp/r
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
for t in c d; do
  d=/tmp/r/f$t; mkdir -p $d
  (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 scripts/gpu_fused_digest_check.py --out $d > $d/fused.log 2>&1); echo "fused $t rc=$?"
  python3 -c "
import json
d=json.load(open('$d/gpu_fused_digest_check.json')); c=d['board_lane_cost']; print({k:round(v,1) for k,v in c.items() if k.endswith('_us')}, 'ok' if d['ok'] else 'NOT OK')"
done
for t in d c; do
  (cd .gpu_$t && KVLINK_COMMIT=$t PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out /tmp/r/io_${t}.json 2>&1 | grep -E "overhead|on the device" | cut -c1-200; echo "io $t")
done
(cd .gpu_d && KVLINK_COMMIT=d PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --run-length 20 --layer-gap --out /tmp/r/io_d_runs20.json 2>&1 | grep -E "overhead|on the device" | cut -c1-200; echo "io d runs of 20")
tar czf $OUT/r.tgz -C /tmp/r .
echo done
