#!/bin/bash
# 5dc24ba (HEAD) on whatever card comes: the e2e bench and integrity overhead, for the record
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res8; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=5dc24ba
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
(cd $G && PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1; echo "e2e rc=$?")
grep -E "^ *(70b|8b)|MET|post=|share" $R/e2e.log | head -30
tar czf $OUT/results.tgz -C $R .
(cd $G && PYTHONPATH=/tmp/site:$G timeout 240 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 400 --layer-gap --out $R/io400.json > $R/io.log 2>&1; echo "io rc=$?")
tail -8 $R/io.log
tar czf $OUT/results.tgz -C $R .
