#!/bin/bash
# tree against tree in one start: 783e895 (a) vs this session's HEAD (b), 70B TP8 rank, spin
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
R=/tmp/res3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
cd $G && PYTHONPATH=/tmp/site:$G timeout 250 python3 bench/ab_trees.py --a $G/old --b $G/new --label-a 783e895 --label-b HEAD --device cuda --spin --requests 300 --out $R/ab70.json > $R/ab70.log 2>&1; echo "ab rc=$?"
tail -6 $R/ab70.log
tar czf $OUT/results.tgz -C $R .
