#!/bin/bash
# stamps at the routes tree (+ the lane's byte checks)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1
O=/tmp/o36; rm -rf $O; mkdir -p $O
PYTHONPATH=/tmp/site:$PWD timeout 90 python3 scripts/gpu_runs_check.py --out $O > $O/runs.log 2>&1; echo "runs rc=$?"; grep -E "lane_|Traceback|Error" $O/runs.log | head
(cd .gpu_a && PYTHONPATH=/tmp/site:$PWD KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 100 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
grep -E "^ *70b" $O/e2e_stamped.log
for f in $O/st.*.json; do python3 bench/results/gpu_checks_2f9e7e9/stamps_report.py.txt $f > $f.txt 2>&1; done
cat $O/st.*.txt | head -150
tar czf $OUT/results.tgz -C $O .
