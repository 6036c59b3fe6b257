#!/bin/bash
# $1 commit: the stop's final tree on one H200: the 8B request against 696c5fb (the last stop's
# tree: both of this stop's trims), the e2e bench, integrity's overhead (600 requests a level),
# the cuda_ipc check (general posts and lanes through the transport)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofinal; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|b vs a|MISMATCH|MET|sample|full" $O/$tag.log | cut -c1-200 | tail -14
  tar czf $OUT/results.tgz -C $O .
}
go ab8b 200 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 150 --a ../.gpu_a --b . --label-a 696c5fb --label-b $1 --out $O/ab_8b_spin_150.json
go e2e 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
go io600 240 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
go ipc 100 python3 scripts/gpu_cuda_ipc_check.py --out $O
