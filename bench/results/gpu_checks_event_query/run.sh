#!/bin/bash
# a copy's completion queried through the C helper (event_query): an A/A of ab_trees on the GPU,
# A/B against b88feb0 and against 088fd64 (the alive word alone), runs/order checks, e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oq; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|mark_|lane_launcher|wrong|\"ok\"|'ok'" $O/$tag.log | cut -c1-200 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_new/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap"
go aa_spin 150 . $AB --a .gpu_prev --b .gpu_prev --label-a b88feb0 --label-b b88feb0-again --spin --requests 150 --out $O/aa_spin.json
go ab_spin 150 . $AB --a .gpu_prev --b .gpu_new --label-a b88feb0 --label-b event-query --spin --requests 150 --out $O/ab_spin.json
go ab_sleep 150 . $AB --a .gpu_prev --b .gpu_new --label-a b88feb0 --label-b event-query --requests 100 --out $O/ab_sleep.json
go ab_mid_spin 150 . $AB --a .gpu_mid --b .gpu_new --label-a alive-word --label-b event-query --spin --requests 150 --out $O/ab_mid_spin.json
go runs 100 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go order 100 .gpu_new python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go e2e 150 .gpu_new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
