#!/bin/bash
# this tree ($1, .gpu_b) against 6594195 (.gpu_h), one start, interleaved (bench/ab_trees.py):
# 70B one at a time sleeping and polled in a loop, 8 in flight sleeping
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oab; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (PYTHONPATH=/tmp/site timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|b vs a" $O/$tag.log | cut -c1-220 | tail -4
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_b/bench/ab_trees.py --a .gpu_h --b .gpu_b --label-a 6594195 --label-b $1 --device cuda --case 70b-tp8 --layer-gap"
go ab_sleep 170 $AB --requests 250 --out $O/ab_sleep.json
go ab_spin 150 $AB --spin --requests 250 --out $O/ab_spin.json
go ab_inflight 150 $AB --inflight 8 --requests 80 --out $O/ab_inflight.json
