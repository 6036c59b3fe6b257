#!/bin/bash
# .gpu_pipe (a9c1ebc: the kernel reads the hold's slot) against .gpu_slot ($1: the launcher
# reads it, the kernel's units one round trip): the fused check of each tree in turn, three
# times, then this tree's GPU checks and the 70B integrity overhead through the public API
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/osl; rm -rf $O; mkdir -p $O
go() {  # dir tag limit cmd...
  local dir=$1 tag=$2 lim=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|goals|board_lane" $O/$tag.log | cut -c1-300 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
for i in 1 2 3; do
  mkdir -p $O/old$i $O/new$i
  KVLINK_COMMIT=a9c1ebc go .gpu_pipe old$i/fused 120 python3 scripts/gpu_fused_digest_check.py --out $O/old$i
  KVLINK_COMMIT=$1 go .gpu_slot new$i/fused 120 python3 scripts/gpu_fused_digest_check.py --out $O/new$i
done
export KVLINK_COMMIT=$1
go .gpu_slot runs 60 python3 scripts/gpu_runs_check.py --out $O
go .gpu_slot order 90 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go .gpu_slot io 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 120 --layer-gap --out $O/io.json
