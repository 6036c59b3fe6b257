#!/bin/bash
# the stop's final tree (.gpu_fin = $1): lanes and marks, stream order, fused digests, a short e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofin; rm -rf $O; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_fin && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|mark_|lane_launcher|MET|^ *70b" $O/$tag.log | cut -c1-160 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go fused 60 python3 scripts/gpu_fused_digest_check.py --out $O
go e2e 90 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 20 --inflight-rounds 1 --layer-gap --out $O/e2e.json
