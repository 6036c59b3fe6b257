#!/bin/bash
# a433099 ($1, .gpu_arena) and c5e9b5e (.gpu_fin2) in one start: the integrity overhead over
# 300 requests a level (past one pass through the hold board's arena for `full`)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oar; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit dir commit cmd...
  local tag=$1 lim=$2 dir=$3 c=$4; shift 4
  (cd $dir && KVLINK_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|overhead|fault at" $O/$tag.log | cut -c1-220 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
go io_fixed 200 .gpu_arena $1 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 300 --layer-gap --out $O/io_fixed.json
go io_before 200 .gpu_fin2 c5e9b5e python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 300 --layer-gap --out $O/io_before.json
