#!/bin/bash
# the C lane launcher (61d7f7e) against ec598d2: lanes byte-exact both ways, stream order, A/B
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/on; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|wrong|lane_launcher|copy_lane|launch" $O/$tag.log | cut -c1-400 | tail -12; el
  tar czf $OUT/results.tgz -C $O .
}
go runs 120 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go order 200 .gpu_new python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go ab_spin 200 . python3 .gpu_new/bench/ab_trees.py --a .gpu_prev --b .gpu_new --label-a ec598d2 --label-b 61d7f7e --device cuda --spin --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_spin.json
go e2e 200 .gpu_new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
