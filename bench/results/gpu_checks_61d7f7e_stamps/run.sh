#!/bin/bash
# where a 70B route READ's time goes at 61d7f7e (C launcher): host stamps (no events), then GPU events
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/os; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
R=bench/results/gpu_checks_61d7f7e_stamps/stamps_report3.py.txt
(cd .gpu_st && PYTHONPATH=/tmp/site:$PWD KVST_NOEV=1 KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
grep -E "^ *70b" $O/e2e_stamped.log; el
for f in $O/st.*.json; do python3 $R $f > $f.txt 2>&1; done; cat $O/st.*.txt | cut -c1-100; el
tar czf $OUT/results.tgz -C $O .
(cd .gpu_st && PYTHONPATH=/tmp/site:$PWD KVST_OUT=$O/ste timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped_ev.json > $O/e2e_stamped_ev.log 2>&1; echo "stamped+events rc=$?")
grep -E "^ *70b" $O/e2e_stamped_ev.log; el
for f in $O/ste.*[0-9].json; do python3 $R $f ${f%.json}.ev.json > $f.txt 2>&1; done; grep -A5 "GPU events" $O/ste.*.txt; el
tar czf $OUT/results.tgz -C $O .
