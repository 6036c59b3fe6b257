#!/bin/bash
# $1 label, $2 part (checks|io): HEAD's GPU checks and issue 19/24's benches on the tree in .gpu_f
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oh_$2; rm -rf $O; mkdir -p $O
T0=$(date +%s)
PART=$2
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|MET|overhead|goals" $O/$tag.log | cut -c1-220 | tail -10
  tar czf $OUT/results_$PART.tgz -C $O .
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$2" = checks ]; then
  go runs 50 python3 scripts/gpu_runs_check.py --out $O
  go staging 80 python3 scripts/gpu_staging_check.py --stream-order --modes order --reps 1 --out $O
  go order 50 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
  go ipc 90 python3 scripts/gpu_cuda_ipc_check.py --out $O
  go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
  grep -E "^ *(70b|8b)|phases" $O/e2e.log
  go fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
else
  go io600 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
fi
