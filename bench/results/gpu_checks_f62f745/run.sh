#!/bin/bash
# stamps + A/B vs 9e53c8e + e2e at the routes tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1
O=/tmp/o38; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 bench/ab_trees.py --a .gpu_prev --b . --label-a prev-9e53c8e --label-b $1 --device cuda --spin --case 70b-tp8 --requests 150 --out $O/ab_routes.json > $O/ab.log 2>&1; echo "ab rc=$?"; grep "b vs a" $O/ab.log; el
timeout 170 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json > $O/e2e_gap.log 2>&1; echo "e2e rc=$?"; grep -E "^ *(70b|8b)" $O/e2e_gap.log; el
tar czf $OUT/results.tgz -C $O .
(cd .gpu_a && PYTHONPATH=/tmp/site:$PWD KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
grep -E "^ *70b" $O/e2e_stamped.log
for f in $O/st.*.json; do python3 bench/results/gpu_checks_2f9e7e9/stamps_report.py.txt $f > $f.txt 2>&1; done
tail -40 $O/st.*.txt; el
tar czf $OUT/results.tgz -C $O .
