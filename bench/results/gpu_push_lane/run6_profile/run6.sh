#!/bin/bash
set -u
cd "$(dirname "$0")/.."
G=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=8fe2b64
R=/tmp/r6; rm -rf $R; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
KVPROF_TIMES_ONLY=1 KVPROF_PUSH=$R/push_times.txt PYTHONPATH=$G/probe/probe_push:/tmp/site:$G timeout 150 python3 bench/layerwise.py --device cuda --requests 8 --integrity off --out $R/layerwise_off_times.json > $R/layerwise_off_times.log 2>&1; echo rc=$?
grep -E "^(whole|one) " $R/layerwise_off_times.log | cut -c1-120
head -1 $R/push_times.txt
KVPROF_PUSH=$R/push_profile.txt PYTHONPATH=$G/probe/probe_push:/tmp/site:$G timeout 150 python3 bench/layerwise.py --device cuda --requests 8 --integrity off --out $R/layerwise_off_prof.json > $R/layerwise_off_prof.log 2>&1; echo rc=$?
head -c 7000 $R/push_profile.txt
tar czf $OUT/results.tgz -C $R .
