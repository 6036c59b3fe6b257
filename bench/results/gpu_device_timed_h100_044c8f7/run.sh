#!/bin/bash
# $1 label: device-timed copies (.gpu_f) vs HEAD (.gpu_a): checks, e2e, A/Bs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og5; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |MISMATCH|b vs a|MET|\"ok\": false|'ok': False" $O/$tag.log | cut -c1-200 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
AB="python3 bench/ab_trees.py --device cuda --layer-gap --a ../.gpu_a --b . --label-a head --label-b timed"
go runs 60 python3 scripts/gpu_runs_check.py --out $O

go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 4 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)|phases|wait=|grace" $O/e2e.log
go ab70b_if8 100 $AB --case 70b-tp8 --inflight 8 --requests 40 --out $O/ab_70b_inflight8_sleep.json




