#!/bin/bash
# the stop's tree (.gpu_rec = ca3fb6c's code, $1) against the last stop's (.gpu_new = 5edb102), polled, tree
# against tree; e2e goals; integrity's cost and fault rounds; fused digests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/of3; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|wrong|overhead|\"ok\"" $O/$tag.log | cut -c1-250 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_rec/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap --spin"
go ab_spin 120 . $AB --a .gpu_new --b .gpu_rec --label-a 5edb102 --label-b ca3fb6c --requests 150 --out $O/ab_spin.json
go ab_inflight 120 . $AB --a .gpu_new --b .gpu_rec --label-a 5edb102 --label-b ca3fb6c --inflight 8 --requests 40 --out $O/ab_inflight.json
go e2e 150 .gpu_rec python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
go io 120 .gpu_rec python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
