#!/bin/bash
# $1 label: one lane post in 16 timed on the device (.gpu_f) against the tree before it
# (.gpu_a): the lane checks, 8 in flight sleeping and the 70B request polled (A/B), e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og4; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|MISMATCH|b vs a|MET|grace|\"ok\": false" $O/$tag.log | cut -c1-220 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 bench/ab_trees.py --device cuda --layer-gap --a ../.gpu_a --b . --label-a before --label-b timed"
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go ab70b_if8 120 $AB --case 70b-tp8 --inflight 8 --requests 60 --out $O/ab_70b_inflight8_sleep.json
go e2e 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 8 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)" $O/e2e.log
go ab70b_spin 80 $AB --case 70b-tp8 --spin --requests 150 --out $O/ab_70b_spin.json
