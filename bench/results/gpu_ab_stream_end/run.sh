#!/bin/bash
# $1 label: the end-word tree's GPU checks, then A/B against d6aa2dd (70B 300, 8B 200), e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or2; rm -rf $O; mkdir -p $O/ctypes
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|MET|b vs a|lane_end" $O/$tag.log | cut -c1-220 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
go runs 60 python3 scripts/gpu_runs_check.py --out $O
grep -A3 '"lane_end_word"' $O/runs.log | head -8
go fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
KVLINK_NATIVE=0 go ctypes/fused 100 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
KVLINK_NATIVE=0 go ctypes/runs 60 python3 scripts/gpu_runs_check.py --out $O/ctypes
go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go ipc 120 python3 scripts/gpu_cuda_ipc_check.py --out $O
go ab70b 200 python3 bench/ab_trees.py --device cuda --spin --case 70b-tp8 --layer-gap --requests 300 --a ../.gpu_a --b . --label-a d6aa2dd --label-b $1 --out $O/ab_70b_spin_300.json
go ab8b 150 python3 bench/ab_trees.py --device cuda --spin --case 8b-tp1 --layer-gap --requests 200 --a ../.gpu_a --b . --label-a d6aa2dd --label-b $1 --out $O/ab_8b_spin_200.json
go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
