#!/bin/bash
# $1 commit: lanes byte-exact, the 8B request A/B (.gpu_a = 530ee35, before LANE_SMALL), e2e, integrity 600/level
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofin2; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|overhead|MET|^ *(70b|8b)|b vs a|fault" $O/$tag.log | cut -c1-220 | tail -16
  tar czf $OUT/results.tgz -C $O .
}
go runs 50 python3 scripts/gpu_runs_check.py --out $O
go ab8b 150 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 80 --a ../.gpu_a --b . --label-a 530ee35 --label-b $1 --out $O/ab_8b_spin.json
go e2e 230 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
go io600 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
