#!/bin/bash
# e7d213e (HEAD): lane checks, stream order, IPC; e2e bench; integrity overhead; all-reduce (world 2 on one GPU); demo --device cuda
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res4; mkdir -p $R
bash $G/scripts/gpu_checks.sh e7d213e runs order ipc 2>&1 | tee $R/checks.txt | tail -12
cp -r /tmp/gpu_checks $R/checks
tar czf $OUT/results.tgz -C $R .
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=e7d213e
(cd $G && PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|MET|post=" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
(cd $G && PYTHONPATH=/tmp/site:$G timeout 170 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 400 --layer-gap --out $R/io400.json > $R/io.log 2>&1; echo "io rc=$?")
tail -14 $R/io.log
tar czf $OUT/results.tgz -C $R .
(cd $G && OUT=$R PYTHONPATH=/tmp/site:$G timeout 120 python3 scripts/gpu_allreduce_check.py --worlds 2 --deadline-s 110 > $R/allreduce.log 2>&1; echo "allreduce rc=$?")
tail -3 $R/allreduce.log
tar czf $OUT/results.tgz -C $R .
(cd $G && OUT=$R/demo PYTHON=python3 PYTHONPATH=/tmp/site timeout 150 bash scripts/gpu_demo_check.sh > $R/demo.log 2>&1; echo "demo rc=$?")
tail -8 $R/demo.log
tar czf $OUT/results.tgz -C $R .
