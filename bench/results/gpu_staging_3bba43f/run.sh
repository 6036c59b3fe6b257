#!/bin/bash
# $1 label: host staging's GPU checks on the tree in .gpu_f (tcp's socket buffers changed)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/os; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu_staging_check.py --stream-order --modes order --reps 1 --out $O > $O/staging.log 2>&1); echo "== staging rc=$?"
grep -E "wrong|Error|Traceback|ok" $O/staging.log | cut -c1-200 | tail -8
(cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu_staging_check.py --out $O > $O/staging_rates.log 2>&1); echo "== staging_rates rc=$?"
tail -12 $O/staging_rates.log | cut -c1-200
tar czf $OUT/results.tgz -C $O .
