#!/bin/bash
# one device call: the digest kernel of a64626a (.gpu_o) against this tree's (.gpu_f), then
# this tree's GPU checks and benches
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=$OUT/ab; mkdir -p $O/old $O/new
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for i in 1 2; do
  for t in o f; do
    d=$O/$([ $t = o ] && echo old || echo new)/$i; mkdir -p $d
    (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 scripts/gpu_fused_digest_check.py --out $d > $d/fused.log 2>&1); echo "fused $t $i rc=$?"
    python3 - $d/gpu_fused_digest_check.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); c=d.get("board_lane_cost",{}); print({k:round(v,1) if isinstance(v,float) else v for k,v in c.items()}, "ok" if d.get("ok", True) else "NOT OK")
PY
  done
done
