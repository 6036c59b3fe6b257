#!/bin/bash
# $1 label: GPU checks of the tree in .gpu_f (tcp's staged READ now sends its last chunk through
# the C helper that leaves the grant gate, serve_move; the native module rebuilt) and the e2e bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/of; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|\"ok\": false|MISMATCH|MET" $O/$tag.log | cut -c1-200 | tail -12
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
go runs 50 python3 scripts/gpu_runs_check.py --out $O
go staging 70 python3 scripts/gpu_staging_check.py --out $O/staging --gib 0.5 --reps 2
go staging_order 80 python3 scripts/gpu_staging_check.py --stream-order --modes order --reps 1 --out $O
go ipc 90 python3 scripts/gpu_cuda_ipc_check.py --out $O
go e2e 170 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)" $O/e2e.log
tail -8 $O/staging.log
tar czf $OUT/results.tgz -C $O .
