#!/bin/bash
# .gpu_rec ($1): a route's READ recorded by the first look at it, not inside read(), against
# 8b84bfa (.gpu_flat): 8 in flight and one at a time, polled; e2e; lanes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/orl; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|mark_|lane_launcher|wrong" $O/$tag.log | cut -c1-200 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_rec/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap --spin"
go ab_inflight 170 . $AB --a .gpu_flat --b .gpu_rec --label-a 8b84bfa --label-b records-later --inflight 8 --requests 60 --out $O/ab_inflight.json
go ab_spin 170 . $AB --a .gpu_flat --b .gpu_rec --label-a 8b84bfa --label-b records-later --requests 150 --out $O/ab_spin.json
go runs 80 .gpu_rec python3 scripts/gpu_runs_check.py --out $O
go e2e 150 .gpu_rec python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
