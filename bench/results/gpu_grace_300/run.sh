#!/bin/bash
# $1 label: poll_grace_us 300 by default (.gpu_f) against 100 (.gpu_a, the tree before):
# the sleeping caller's 8 in flight and 8B request, the polled 70B request; then the e2e bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og3; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|MISMATCH|b vs a|MET|grace" $O/$tag.log | cut -c1-220 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 bench/ab_trees.py --device cuda --layer-gap --a ../.gpu_a --b . --label-a 100us --label-b 300us"
go ab70b_if8 130 $AB --case 70b-tp8 --inflight 8 --requests 60 --out $O/ab_70b_inflight8_sleep.json
go ab8b_sleep 100 $AB --case 8b-tp1 --requests 120 --out $O/ab_8b_sleep.json
go ab70b_spin 100 $AB --case 70b-tp8 --spin --requests 150 --out $O/ab_70b_spin.json
go ab70b_sleep 100 $AB --case 70b-tp8 --requests 150 --out $O/ab_70b_sleep.json
go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 8 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)" $O/e2e.log
