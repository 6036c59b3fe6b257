#!/bin/bash
# $1 commit, $2 stage: "checks" (runs, fused digests, stream order, then the 70B request
# tree against tree, 150 rounds) or "ab8b" (the 8B request, 150 rounds, then the e2e bench)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/o_$2; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|b vs a|MISMATCH" $O/$tag.log | cut -c1-220 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
if [ "$2" = checks ]; then
  go runs 60 python3 scripts/gpu_runs_check.py --out $O
  go fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
  go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
  go ab70b 260 python3 bench/ab_trees.py --device cuda --spin --case 70b-tp8 --layer-gap --requests 150 --a ../.gpu_a --b . --label-a 696c5fb --label-b $1 --out $O/ab_70b_spin_150.json
else
  go ab8b 250 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 150 --a ../.gpu_a --b . --label-a 696c5fb --label-b $1 --out $O/ab_8b_spin_150.json
  go e2e 300 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e_cuda_ipc.json
fi
