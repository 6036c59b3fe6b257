#!/bin/bash
# device call 8: the final tree's GPU checks (9b6255a), and the by-value check against 6550864
set -u
cd "$(dirname "$0")/.."
G=$PWD
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
R=/tmp/r8; rm -rf $R; mkdir -p $R $OUT
timeout 330 bash scripts/gpu_checks.sh 9b6255a runs order ipc fused integrity landing 2>&1 | tee $R/gpu_checks.out | tail -40
cp /tmp/gpu_checks/* $R/ 2>/dev/null
for round in 1 2; do
 for tree in o g; do
  T=$G/../.gpu_$tree; label=$([ $tree = g ] && echo 9b6255a || echo 6550864)
  (cd $T && KVLINK_COMMIT=$label PYTHONPATH=/tmp/site:$T timeout 120 python3 bench/layerwise.py --device cuda --requests 8 --integrity sample --steps --out $R/layerwise_${label}_sample_r$round.json > $R/layerwise_${label}_sample_r$round.log 2>&1; echo -n "$label sample r$round rc=$? ")
  grep -E "^(layered) " $R/layerwise_${label}_sample_r$round.log | cut -c1-70
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 100 python3 bench/landed_check.py --reps 30 --out $R/landed_${label}_r$round.json > $R/landed_${label}_r$round.log 2>&1; echo -n "landed $label rc=$? ")
  grep -E "^(sample|full)" $R/landed_${label}_r$round.log | sed 's/.*the check in one kernel/one kernel/' | cut -c1-40 | tr '\n' ' '; echo
 done
done
for lv in off full; do
  (cd $G && KVLINK_COMMIT=9b6255a PYTHONPATH=/tmp/site:$G timeout 120 python3 bench/layerwise.py --device cuda --requests 8 --integrity $lv --out $R/layerwise_9b6255a_$lv.json > $R/layerwise_9b6255a_$lv.log 2>&1; echo "9b6255a $lv rc=$?")
  grep -E "^(whole|layered|one) |mismatch" $R/layerwise_9b6255a_$lv.log | cut -c1-110
done
tar czf $OUT/results.tgz -C $R .
