#!/bin/bash
# the e2e bench standalone, trees in turn (new, mid, prev, twice): does c8477f4 run slower alone
# than 088fd64, as gpu_inflight_event_query/ showed, while interleaved A/Bs had it faster?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/os; rm -rf $O; mkdir -p $O
T0=$(date +%s)
for i in 1 2; do
  for t in new mid prev; do
    (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD KVLINK_COMMIT=$t timeout 100 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 20 --inflight-rounds 1 --layer-gap --out $O/e2e_${t}_$i.json > $O/e2e_${t}_$i.log 2>&1)
    echo "== $t $i rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *70b-tp8 +(sleep|spin)|70b-tp8 (sleep|spin) wait" $O/e2e_${t}_$i.log
    tar czf $OUT/results.tgz -C $O .
  done
done
(PYTHONPATH=/tmp/site:$PWD timeout 100 python3 .gpu_new/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap --a .gpu_mid --b .gpu_new --label-a alive-word --label-b event-query --spin --requests 120 --out $O/ab_mid_spin.json > $O/ab_mid_spin.log 2>&1); grep "b vs a" $O/ab_mid_spin.log
tar czf $OUT/results.tgz -C $O .
