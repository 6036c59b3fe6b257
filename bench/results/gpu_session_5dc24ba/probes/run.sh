#!/bin/bash
# probes: driver calls hot/cold by param size; lane posts by table class; A/B PARAM_WORDS +1024 class
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
cd $G
PYTHONPATH=/tmp/site:$G timeout 100 python3 bench/gpu_host_calls.py --no-copy --out $R/host_calls.json > $R/host_calls.log 2>&1; echo "host_calls rc=$?"
cat $R/host_calls.log | tail -26
tar czf $OUT/results.tgz -C $R .
PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/gpu_lane_host.py --reps 150 --classes 640,832,1024,1536,4000 --out $R/lane_host.json > $R/lane_host.log 2>&1; echo "lane_host rc=$?"
tail -26 $R/lane_host.log
tar czf $OUT/results.tgz -C $R .
PYTHONPATH=/tmp/site:$G timeout 200 python3 bench/ab_trees.py --a $G/old --b $G/new --label-a 5dc24ba --label-b class1024 --device cuda --spin --case 70b-tp8 --layer-gap --requests 300 --out $R/ab70.json > $R/ab70.log 2>&1; echo "ab70 rc=$?"
tail -5 $R/ab70.log
tar czf $OUT/results.tgz -C $R .
