#!/bin/bash
# $1 label: the staged-READ checks on the tree in .gpu_f after the review's mend (the last
# chunk's address through hostmem.address_of)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
cd .gpu_f && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 70 python3 scripts/gpu_staging_check.py --out $OUT --gib 0.5 --reps 2 > $OUT/staging.log 2>&1; echo "staging rc=$?"
timeout 80 python3 scripts/gpu_staging_check.py --stream-order --modes order --reps 1 --out $OUT > $OUT/staging_order.log 2>&1; echo "staging_order rc=$?"
grep -E "wrong|gbps" $OUT/staging.log $OUT/staging_order.log | cut -c1-160
