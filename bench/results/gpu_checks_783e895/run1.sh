#!/bin/bash
# 783e895 (HEAD): lane checks, stream order, IPC, the e2e bench, issue 24 overhead
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res1; mkdir -p $R
bash $G/scripts/gpu_checks.sh 783e895 runs order ipc 2>&1 | tee $R/checks.txt | tail -30
cp -r /tmp/gpu_checks $R/checks
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=783e895
(cd $G && PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|expects|MET|post phase" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
(cd $G && PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 300 --layer-gap --out $R/io300.json > $R/io.log 2>&1; echo "io rc=$?")
tail -9 $R/io.log
tar czf $OUT/results.tgz -C $R .
