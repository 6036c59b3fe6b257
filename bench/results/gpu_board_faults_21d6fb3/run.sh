#!/bin/bash
# 21d6fb3 ($1, .gpu_fault: the board's slots mapped up front) against ed0bf8f (.gpu_head), one
# start, interleaved: 70B polled in a loop and sleeping; then the board-fault bench on this host
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oabf; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (PYTHONPATH=/tmp/site timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|b vs a|faulted|unmapped" $O/$tag.log | cut -c1-220 | tail -4
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_fault/bench/ab_trees.py --a .gpu_head --b .gpu_fault --label-a ed0bf8f --label-b $1 --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 150 $AB --spin --requests 300 --out $O/ab_spin.json
go ab_sleep 120 $AB --requests 200 --out $O/ab_sleep.json
(cd .gpu_fault && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/board_faults.py --out $O/board_faults_h200.json > $O/board_faults.log 2>&1; echo "== board_faults rc=$?"; tail -4 $O/board_faults.log)
tar czf $OUT/results.tgz -C $O .
