#!/bin/bash
# $1 label: on the tree in .gpu_f, the lane checks (cuda_ipc's post changed) and integrity's
# overhead on the 70B request, 1000 a level (the long run never made before)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og2; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|overhead|goals|lane_end" $O/$tag.log | cut -c1-220 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go io1000 440 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 1000 --layer-gap --out $O/io1000.json
