#!/bin/bash
# device call 10: whole pushes with integrity through the lane (HEAD) against 6e852aa, one start
set -u
cd "$(dirname "$0")/.."
G=$PWD
NEW=$(cat probe/label)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
R=/tmp/r10; rm -rf $R; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
for lv in sample full sample; do
 for tree in o g; do
  T=$G/../.gpu_$tree; label=$([ $tree = g ] && echo $NEW || echo 6e852aa)
  (cd $T && KVLINK_COMMIT=$label PYTHONPATH=/tmp/site:$T timeout 100 python3 bench/layerwise.py --device cuda --requests 8 --integrity $lv --out $R/layerwise_${label}_${lv}_$RANDOM.json > $R/lw.log 2>&1; echo -n "$label $lv rc=$? ")
  grep -E "^(whole|one) " $R/lw.log | cut -c1-60 | tr '\n' ' '; grep -E "mismatches" $R/lw.log | sed 's/.*mismatches/mismatches/'
  cat $R/lw.log >> $R/all.log
 done
done
tar czf $OUT/results.tgz -C $R .
