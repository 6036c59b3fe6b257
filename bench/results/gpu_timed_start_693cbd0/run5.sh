#!/bin/bash
# minimal: the new tree's lane checks (the launcher's start event), the e2e bench, an A/B
set -u
G=$(cd "$(dirname "$0")/.." && pwd); O=$G/../.gpu_o
R=/tmp/res5; mkdir -p $R
bash $G/scripts/gpu_checks.sh timed-start runs order ipc 2>&1 | tee $R/checks.txt | tail -40
cp -r /tmp/gpu_checks $R/checks
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=timed-start
(cd $G && PYTHONPATH=/tmp/site:$G timeout 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 25 --inflight-rounds 3 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|expects|MET" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
(cd $G && PYTHONPATH=/tmp/site:$G timeout 90 python3 bench/ab_trees.py --a $O --b $G --label-a 7c35336 --label-b timed-start --device cuda --case 8b-tp1 --requests 60 --layer-gap --out $R/ab_8b.json > $R/ab_8b.log 2>&1; echo "ab rc=$?")
tail -4 $R/ab_8b.log
tar czf $OUT/results.tgz -C $R .
