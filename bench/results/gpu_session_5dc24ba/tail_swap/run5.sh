#!/bin/bash
# the working tree (5dc24ba + `sample`'s tail swap, KV_TAIL) against 5dc24ba (old/): fused digest
# check (correctness, the kernel alone), lane runs check, then integrity_overhead alternating trees
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res9; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
(cd $G && PYTHONPATH=/tmp/site:$G timeout 120 python3 scripts/gpu_fused_digest_check.py --out $R > $R/fused.log 2>&1; echo "fused rc=$?")
grep -E "'ok'|Error|Traceback" $R/fused.log | cut -c1-400 | tail -8
grep -A10 '"board_lane_cost"' $R/gpu_fused_digest_check.json | grep _us
tar czf $OUT/results.tgz -C $R .
for i in 1 2; do
  for t in new old; do
    T=$G; [ $t = old ] && T=$G/old
    (cd $G && PYTHONPATH=/tmp/site:$T KVLINK_COMMIT=$t timeout 120 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 400 --layer-gap --out $R/io_${t}_$i.json > $R/io_${t}_$i.log 2>&1; echo "io $t $i rc=$?")
    grep -E "overhead|on the device" $R/io_${t}_$i.log | cut -c1-300
    tar czf $OUT/results.tgz -C $R .
  done
done
