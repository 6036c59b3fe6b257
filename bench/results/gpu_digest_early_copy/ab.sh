#!/bin/bash
# kv_move_digest: a unit not checked copies at once (no geometry load first) — old tree (.gpu_old, HEAD) against new (.gpu_g)
set -u
ROOT=$(pwd)
R=$OUT/ab; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl2/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1
for round in 1 2; do
  for tree in old g; do
    d=$ROOT/.gpu_$tree; mkdir -p $R/$tree$round
    (cd $d && KVLINK_CACHE_DIR=/tmp/kvc_$tree PYTHONPATH=/tmp/site:$d timeout 120 python3 scripts/gpu_fused_digest_check.py --out $R/$tree$round > $R/$tree$round/log.txt 2>&1; echo "$tree$round rc=$?")
    grep -o "'plain_lane_us': [0-9.]*, 'board_lane_sample_us': [0-9.]*\|'board_lane_full_us': [0-9.]*\|'board_lane_unknown_sample_us': [0-9.]*" $R/$tree$round/log.txt | tr '\n' ' '; echo
  done
  tar czf $OUT/results.tgz -C $OUT ab
done
d=$ROOT/.gpu_g
(cd $d && KVLINK_CACHE_DIR=/tmp/kvc_g PYTHONPATH=/tmp/site:$d timeout 150 python3 scripts/gpu_integrity_check.py --out $R/gpu_integrity_check.json > $R/integrity.log 2>&1; echo "integrity rc=$?")
tail -4 $R/integrity.log
tar czf $OUT/results.tgz -C $OUT ab
(cd $d && KVLINK_CACHE_DIR=/tmp/kvc_g KVLINK_COMMIT=digest-early-copy PYTHONPATH=/tmp/site:$d timeout 200 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 400 --layer-gap --out $R/io400.json > $R/io.log 2>&1; echo "io rc=$?")
tail -6 $R/io.log
tar czf $OUT/results.tgz -C $OUT ab
