#!/bin/bash
# $1 label: the second command of the pending run (see README): integrity's overhead on the
# 70B request (600 a level, polled) and the lane checks, on the tree in .gpu_f
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or5; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|overhead|goals|lane_end" $O/$tag.log | cut -c1-220 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go io600 240 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
# host staging's stream order (kvlink/staging.py takes its driver calls from kvlink.gpu.move since 9b4f268)
go staging 90 python3 scripts/gpu_staging_check.py --stream-order --modes order --reps 1 --out $O
