#!/bin/bash
# the working tree (5dc24ba + lane_end: a lane's end, status and check words in one C call)
# against 5dc24ba (old/): lane and fused-digest checks, integrity_overhead alternating, e2e
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res10; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
(cd $G && PYTHONPATH=/tmp/site:$G timeout 60 python3 scripts/gpu_runs_check.py --out $R > $R/runs.log 2>&1; echo "runs rc=$?")
grep -E "verified|refused|Error|Traceback" $R/runs.log | cut -c1-300 | tail -6
(cd $G && PYTHONPATH=/tmp/site:$G timeout 120 python3 scripts/gpu_fused_digest_check.py --out $R > $R/fused.log 2>&1; echo "fused rc=$?")
grep -cE "'ok': True" $R/fused.log; grep -E "'ok': False|Error|Traceback" $R/fused.log | cut -c1-300 | tail -4
grep -A10 '"board_lane_cost"' $R/gpu_fused_digest_check.json | grep _us
tar czf $OUT/results.tgz -C $R .
for i in 1 2; do
  for t in new old; do
    T=$G; [ $t = old ] && T=$G/old
    (cd $G && PYTHONPATH=/tmp/site:$T KVLINK_COMMIT=$t timeout 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 300 --layer-gap --out $R/io_${t}_$i.json > $R/io_${t}_$i.log 2>&1; echo "io $t $i rc=$?")
    grep -E "overhead|on the device|phases" $R/io_${t}_$i.log | cut -c1-300
    tar czf $OUT/results.tgz -C $R .
  done
done
(cd $G && PYTHONPATH=/tmp/site:$G KVLINK_COMMIT=lane_end timeout 100 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|MET|share" $R/e2e.log | head -24
tar czf $OUT/results.tgz -C $R .
