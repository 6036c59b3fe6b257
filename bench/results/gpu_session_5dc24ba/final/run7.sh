#!/bin/bash
# HEAD after the review: the mended bench/gpu_host_calls.py, and the lane checks once more
set -u
G=$(cd "$(dirname "$0")/.." && pwd); R=/tmp/res11; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
cd $G
PYTHONPATH=/tmp/site:$G timeout 50 python3 bench/gpu_host_calls.py --no-copy --out $R/host_calls.json > $R/host_calls.log 2>&1; echo "host_calls rc=$?"
PYTHONPATH=/tmp/site:$G timeout 50 python3 scripts/gpu_runs_check.py --out $R > $R/runs.log 2>&1; echo "runs rc=$?"
grep -E '"lane_(verified|refused_failed|ctypes_verified)"' $R/gpu_runs_check.json
tar czf $OUT/results.tgz -C $R .
