#!/bin/bash
# HEAD b88feb0 (the previous stop, its last mends never run on a GPU): lanes, marks, stream order, fused digests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ot; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|mark_|lane_launcher|lane_lists_verified|\"ok\"|'ok'" $O/$tag.log | cut -c1-200 | tail -8; el
  tar czf $OUT/results.tgz -C $O .
}
go runs 100 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go order 100 .gpu_new python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go fused 120 .gpu_new python3 scripts/gpu_fused_digest_check.py --out $O
go e2e 150 .gpu_new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
