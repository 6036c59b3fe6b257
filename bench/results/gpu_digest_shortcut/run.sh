#!/bin/bash
# .gpu_dig ($1): the dense path's check short-circuited on unchecked units; probe against the
# committed form, then the GPU checks of the final tree (fused digests, lanes, stream order)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/osc; rm -rf $O; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_dig && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|VARIANT|mark_|lane_launcher|'ok': False" $O/$tag.log | cut -c1-260 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go variants 200 python3 scripts/digest_sc.py $O/variants.json
go fused 120 python3 scripts/gpu_fused_digest_check.py --out $O
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go order 90 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
