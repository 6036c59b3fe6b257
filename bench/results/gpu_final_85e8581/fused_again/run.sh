#!/bin/bash
# $1: the fused digest check again, C launcher twice and ctypes once (the cost rows' spread)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofu; rm -rf $O; mkdir -p $O/c1 $O/c2 $O/ct
cd .gpu_f
for t in c1 ct c2; do
  if [ $t = ct ]; then export KVLINK_NATIVE=0; else unset KVLINK_NATIVE; fi
  PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu_fused_digest_check.py --out $O/$t > $O/$t/fused.log 2>&1; echo "== $t rc=$?"
  python3 -c "import json;d=json.load(open('$O/$t/gpu_fused_digest_check.json'));print(d['ok'],{k:round(v,1) for k,v in d['board_lane_cost'].items() if k.endswith('_us')})"
done
tar czf $OUT/results.tgz -C $O .
