#!/bin/bash
# $1 commit: the final tree's GPU checks: fused digests (C, ctypes), lanes, stream order, cuda_ipc (general posts: the C bounds check), the lane shapes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofin6; rm -rf $O; mkdir -p $O/ctypes
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false" $O/$tag.log | cut -c1-200 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
KVLINK_NATIVE=0 go ctypes/fused 100 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
go runs 50 python3 scripts/gpu_runs_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go ipc 120 python3 scripts/gpu_cuda_ipc_check.py --out $O
go shapes 120 python3 bench/gpu_lane_shapes.py --reps 20 --out $O/gpu_lane_shapes.json
