#!/bin/bash
# $1 label: cuda_ipc's copy-rate estimate from copies timed on the device (kvlink.gpu.ends),
# tree (.gpu_f) against 702229c (.gpu_old) for 8 requests in flight with a caller sleeping
# between polls, then the GPU lane check and the e2e bench of the tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/of; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|\"ok\": false|MISMATCH|MET|median|change|expects" $O/$tag.log | cut -c1-220 | tail -14
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
go runs 60 python3 scripts/gpu_runs_check.py --out $O
grep -A4 lane_device_times $O/runs.log | head -6
go ab70 170 python3 bench/ab_trees.py --device cuda --a ../.gpu_old --b . --label-a 702229c --label-b $1 --case 70b-tp8 --inflight 8 --requests 40 --layer-gap --out $O/ab70_inflight8_sleep.json
go e2e 230 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)|poll grace|expects" $O/e2e.log
tar czf $OUT/results.tgz -C $O .
