#!/bin/bash
# the stamped HEAD (5dc24ba + stamps, .gpu_s) 70B and 8B one at a time; then the plain tree's e2e
set -u
G=$(cd "$(dirname "$0")/.." && pwd); S=$G/../.gpu_s
R=/tmp/res6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
for c in 70b-tp8 8b-tp1; do
  (cd $S && PYTHONPATH=/tmp/site:$S KVST_OUT=$R/st_$c KVLINK_COMMIT=stamped timeout 120 python3 bench/e2e_request.py --device cuda --cases $c --requests 60 --inflight-rounds 1 --layer-gap --out $R/e2e_st_$c.json > $R/e2e_st_$c.log 2>&1; echo "== $c rc=$?")
  grep -E "^ *$c +(sleep|spin) " $R/e2e_st_$c.log
  python3 $G/probe/stamp_read7.py $R/st_$c.*.json 2>&1 | tail -16
  tar czf $OUT/results.tgz -C $R .
done
(cd $G && PYTHONPATH=/tmp/site:$G KVLINK_COMMIT=5dc24ba timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|MET|post=|share" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
