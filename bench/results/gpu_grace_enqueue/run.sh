#!/bin/bash
# $1 label: cuda_ipc's copy-end estimate timed from the enqueue (.gpu_f) against 7abcff2
# (.gpu_a): 8 in flight with a sleeping caller, A/B, then the e2e bench on .gpu_f
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|MISMATCH|b vs a|MET|grace" $O/$tag.log | cut -c1-220 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
go ab70b_if8 170 python3 bench/ab_trees.py --device cuda --case 70b-tp8 --inflight 8 --layer-gap --requests 80 --a ../.gpu_a --b . --label-a 7abcff2 --label-b $1 --out $O/ab_70b_inflight8_sleep.json
go ab8b_if8 150 python3 bench/ab_trees.py --device cuda --case 8b-tp1 --inflight 8 --layer-gap --requests 40 --a ../.gpu_a --b . --label-a 7abcff2 --label-b $1 --out $O/ab_8b_inflight8_sleep.json
go e2e 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 8 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)" $O/e2e.log
