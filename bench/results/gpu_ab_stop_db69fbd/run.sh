#!/bin/bash
# $1 commit: against 696c5fb (the last stop's tree: every trim of this stop), one start: the 70B
# request 300 rounds, the 8B 200, polled in a loop; then the e2e bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oabl; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|'ok': False|\"ok\": false|b vs a|MISMATCH|overhead|goals" $O/$tag.log | cut -c1-260 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
go ab70b 200 python3 bench/ab_trees.py --device cuda --spin --case 70b-tp8 --layer-gap --requests 300 --a ../.gpu_a --b . --label-a 696c5fb --label-b $1 --out $O/ab_70b_spin_300.json
go ab8b 150 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 200 --a ../.gpu_a --b . --label-a 696c5fb --label-b $1 --out $O/ab_8b_spin_200.json
go e2e 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
