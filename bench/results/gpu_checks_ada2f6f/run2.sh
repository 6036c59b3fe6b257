#!/bin/bash
# ada2f6f (HEAD): the lane checks and the e2e bench through the public API, short
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res2; mkdir -p $R
bash $G/scripts/gpu_checks.sh ada2f6f runs ipc 2>&1 | tee $R/checks.txt | tail -12
cp -r /tmp/gpu_checks $R/checks
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=ada2f6f
(cd $G && PYTHONPATH=/tmp/site:$G timeout 100 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 20 --inflight-rounds 2 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|MET" $R/e2e.log | head -24
tar czf $OUT/results.tgz -C $R .
