#!/bin/bash
# flattened frames before the launch and on the polls (.gpu_flat) against the ledger tree
# (fc60672), tree against tree; the checks (lanes, fused digests); e2e goals; integrity. $1: HEAD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/of2; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|mark_|lane_launcher|wrong|\"ok\"|'ok'|sample|full" $O/$tag.log | cut -c1-200 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_flat/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 170 . $AB --a .gpu_led --b .gpu_flat --label-a fc60672 --label-b flat --spin --requests 150 --out $O/ab_spin.json
go ab_sleep 150 . $AB --a .gpu_led --b .gpu_flat --label-a fc60672 --label-b flat --requests 100 --out $O/ab_sleep.json
go ab0_spin 170 . $AB --a .gpu_new --b .gpu_flat --label-a 5edb102 --label-b flat --spin --requests 150 --out $O/ab0_spin.json
go runs 80 .gpu_flat python3 scripts/gpu_runs_check.py --out $O
go fused 120 .gpu_flat python3 scripts/gpu_fused_digest_check.py --out $O
go e2e 150 .gpu_flat python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
go io 120 .gpu_flat python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
