#!/bin/bash
# one device call: the digest lane kernel of HEAD (f), HEAD with full's units block-major (b),
# and this tree (c: block-major, full's rows staged per block of warps)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for i in 1 2; do for t in f b c; do
  d=$OUT/fused_${t}_$i; mkdir -p $d
  (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 scripts/gpu_fused_digest_check.py --out $d > $d/fused.log 2>&1); echo "fused $t $i rc=$?"
  python3 -c "
import json
d=json.load(open('$d/gpu_fused_digest_check.json')); c=d['board_lane_cost']; print({k:round(v,1) for k,v in c.items() if k.endswith('_us')}, 'ok' if d['ok'] else 'NOT OK')"
done; done
for t in f c b f c; do
  (cd .gpu_$t && KVLINK_COMMIT=$t PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out $OUT/io_${t}_$RANDOM.json 2>&1 | grep -E "overhead|on the device|fault at" | cut -c1-200; echo "io $t")
done
