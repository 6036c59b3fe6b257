#!/bin/bash
# $1 commit: the refactored lane probes (shapes, probe), the e2e bench, GPU checks (lanes, stream order)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofin3; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|MET|^ *(70b|8b)|best|verified=False|verified" $O/$tag.log | cut -c1-200 | tail -16
  tar czf $OUT/results.tgz -C $O .
}
go shapes 120 python3 bench/gpu_lane_shapes.py --reps 30 --out $O/gpu_lane_shapes.json
go probe 120 python3 bench/gpu_lane_probe.py --reps 40 --out $O/gpu_lane_probe.json
go runs 50 python3 scripts/gpu_runs_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go e2e 230 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
