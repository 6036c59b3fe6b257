#!/bin/bash
# start 1 (slow host): stamps of the READ route path (stamped tree .gpu_s, from 7c35336 by
# stamp_tree.py.txt), then the plain tree's e2e
set -u
G=$(cd "$(dirname "$0")/.." && pwd); S=$G/../.gpu_s
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=stamped KVLINK_CACHE_DIR=/tmp/kvc
for c in 70b-tp8 8b-tp1; do
  (cd $S && PYTHONPATH=/tmp/site:$S KVST_OUT=$R/st_$c timeout 150 python3 bench/e2e_request.py --device cuda --cases $c --requests 60 --inflight-rounds 1 --layer-gap --out $R/e2e_st_$c.json > $R/e2e_st_$c.log 2>&1; echo "stamped $c rc=$?")
  grep -E "^ *(70b|8b)" $R/e2e_st_$c.log
  python3 $G/probe/stamp_read.py $R/st_$c.*.json 2>&1 | tail -13
done
export KVLINK_COMMIT=7c35336
(cd $G && PYTHONPATH=/tmp/site:$G timeout 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|post=|NOT MET|MET" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
