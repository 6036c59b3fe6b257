#!/bin/bash
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res6; mkdir -p $R
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=timed-start
(cd $G && PYTHONPATH=/tmp/site:$G timeout 130 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 300 --layer-gap --out $R/io300.json > $R/io.log 2>&1; echo "io rc=$?")
tail -9 $R/io.log
(cd $G && PYTHONPATH=/tmp/site:$G timeout 100 python3 scripts/gpu_fused_digest_check.py --out $R > $R/fused.log 2>&1; echo "fused rc=$?")
grep -E "Error|Traceback|FAIL|MISMATCH" $R/fused.log | head -5
tar czf $OUT/results.tgz -C $R .
