#!/bin/bash
# c5e9b5e ($1): the integrity overhead (70B, polled in a loop), and A/B sleeping
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or5; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|overhead|b vs a|fault|MET" $O/$tag.log | cut -c1-220 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
go io 330 .gpu_fin2 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 250 --layer-gap --out $O/io.json
go ab_sleep 150 . python3 .gpu_fin2/bench/ab_trees.py --a .gpu_r1 --b .gpu_fin2 --label-a e98e4fa --label-b c5e9b5e --device cuda --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_sleep.json
