#!/bin/bash
# experiment: what the quiet check of a reporting poll costs end to end: 85e8581 (.gpu_f)
# against the same tree with _FULL_EVERY = 1 s (.gpu_q: every reporting poll within the window)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oq; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (PYTHONPATH=/tmp/site timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|b vs a" $O/$tag.log | cut -c1-220 | tail -4
  tar czf $OUT/results.tgz -C $O .
}
AB="python3 .gpu_q/bench/ab_trees.py --a .gpu_f --b .gpu_q --label-a 85e8581 --label-b full_every_1s --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 150 $AB --spin --requests 250 --out $O/ab_spin.json
go ab_sleep 150 $AB --requests 250 --out $O/ab_sleep.json
