#!/bin/bash
# the ledger (records written off the reporting poll) against the last stop's tree, tree against
# tree; the checks; e2e goals; integrity's cost. $1: the commit of .gpu_led
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ol; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|mark_|lane_launcher|wrong|\"ok\"|'ok'|sample|full" $O/$tag.log | cut -c1-200 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_led/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 170 . $AB --a .gpu_new --b .gpu_led --label-a 5edb102 --label-b ledger --spin --requests 150 --out $O/ab_spin.json
go ab_sleep 150 . $AB --a .gpu_new --b .gpu_led --label-a 5edb102 --label-b ledger --requests 100 --out $O/ab_sleep.json
go runs 80 .gpu_led python3 scripts/gpu_runs_check.py --out $O
go e2e 150 .gpu_led python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
go io 120 .gpu_led python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
