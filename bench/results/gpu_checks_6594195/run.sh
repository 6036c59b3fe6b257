#!/bin/bash
# $1 commit: GPU checks (fused digests C + ctypes, lanes, stream order)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or1; rm -rf $O; mkdir -p $O/ctypes
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|b vs a|MET|^ *(70b|8b)" $O/$tag.log | cut -c1-200 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
go fused 100 .gpu_h python3 scripts/gpu_fused_digest_check.py --out $O
KVLINK_NATIVE=0 go ctypes/fused 100 .gpu_h python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
go runs 50 .gpu_h python3 scripts/gpu_runs_check.py --out $O
go order 60 .gpu_h python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
