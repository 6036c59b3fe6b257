#!/bin/bash
# the session's tree ($1, .gpu_head) against the last stop's (75cb5c9, .gpu_old75), one start,
# interleaved (bench/ab_trees.py): 70B one at a time polled in a loop and sleeping, 8 in flight
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oab; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (PYTHONPATH=/tmp/site timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|b vs a" $O/$tag.log | cut -c1-220 | tail -4
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_head/bench/ab_trees.py --a .gpu_old75 --b .gpu_head --label-a 75cb5c9 --label-b $1 --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 170 $AB --spin --requests 300 --out $O/ab_spin.json
go ab_sleep 150 $AB --requests 250 --out $O/ab_sleep.json
go ab_inflight 170 $AB --spin --inflight 8 --requests 100 --out $O/ab_inflight.json
