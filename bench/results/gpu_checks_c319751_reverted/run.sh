#!/bin/bash
# the whole poll's order: A/B against 35002c4 (sleeping and tight-loop callers), e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o40; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
timeout 150 python3 bench/ab_trees.py --a .gpu_prev2 --b . --label-a 35002c4 --label-b $1 --device cuda --case 70b-tp8 --requests 100 --out $O/ab_sleep.json > $O/ab_sleep.log 2>&1; echo "ab sleep rc=$?"; grep "b vs a" $O/ab_sleep.log; el
timeout 150 python3 bench/ab_trees.py --a .gpu_prev2 --b . --label-a 35002c4 --label-b $1 --device cuda --spin --case 70b-tp8 --requests 100 --out $O/ab_spin.json > $O/ab_spin.log 2>&1; echo "ab spin rc=$?"; grep "b vs a" $O/ab_spin.log; el
tar czf $OUT/results.tgz -C $O .
timeout 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json > $O/e2e_gap.log 2>&1; echo "e2e rc=$?"; grep -E "^ *(70b|8b)|MET" $O/e2e_gap.log; el
tar czf $OUT/results.tgz -C $O .
