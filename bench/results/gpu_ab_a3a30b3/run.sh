#!/bin/bash
# $1 commit: the 8B request, LANE_SMALL against 530ee35, 200 rounds; the 70B request against the last stop (66b1b56), 120 rounds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oab; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|b vs a" $O/$tag.log | cut -c1-220 | tail -4
  tar czf $OUT/results.tgz -C $O .
}
go ab8b 240 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 200 --a ../.gpu_a --b . --label-a 530ee35 --label-b $1 --out $O/ab_8b_spin_200.json
go ab70b 200 python3 bench/ab_trees.py --device cuda --spin --case 70b-tp8 --layer-gap --requests 150 --a ../.gpu_o --b . --label-a 66b1b56 --label-b $1 --out $O/ab_70b_spin_150.json
