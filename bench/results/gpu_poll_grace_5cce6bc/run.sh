#!/bin/bash
# $1 label: the poll grace tree against 783e09f: sleeping and polled A/B, e2e, the IPC check
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or4; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|MET|b vs a" $O/$tag.log | cut -c1-220 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
go ab70b_sleep 150 python3 bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap --requests 200 --a ../.gpu_a --b . --label-a 783e09f --label-b $1 --out $O/ab_70b_sleep_200.json
go ab8b_sleep 120 python3 bench/ab_trees.py --device cuda --case 8b-tp1 --layer-gap --requests 150 --a ../.gpu_a --b . --label-a 783e09f --label-b $1 --out $O/ab_8b_sleep_150.json
go ab70b_spin 150 python3 bench/ab_trees.py --device cuda --spin --case 70b-tp8 --layer-gap --requests 200 --a ../.gpu_a --b . --label-a 783e09f --label-b $1 --out $O/ab_70b_spin_200.json
go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)" $O/e2e.log
go ipc 100 python3 scripts/gpu_cuda_ipc_check.py --out $O
