#!/bin/bash
# the ids handed to the C launcher as given + a flat lane post (working tree on 61d7f7e) against ec598d2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/og; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|wrong|lane_launcher|lane_lists|copy_lane" $O/$tag.log | cut -c1-300 | tail -12; el
  tar czf $OUT/results.tgz -C $O .
}
R=bench/results/gpu_checks_ids_as_given/stamps_report3.py.txt
go runs 120 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go order 120 .gpu_new python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go ab_spin 150 . python3 .gpu_new/bench/ab_trees.py --a .gpu_prev --b .gpu_new --label-a ec598d2 --label-b new --device cuda --spin --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_spin.json
go ab_sleep 150 . python3 .gpu_new/bench/ab_trees.py --a .gpu_prev --b .gpu_new --label-a ec598d2 --label-b new --device cuda --case 70b-tp8 --requests 100 --layer-gap --out $O/ab_sleep.json
go e2e 150 .gpu_new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
(cd .gpu_st && PYTHONPATH=/tmp/site:$PWD KVST_NOEV=1 KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
for f in $O/st.*.json; do python3 $R $f > $f.txt 2>&1; done; sed -n '1,40p' $O/st.*.txt | cut -c1-90; el
tar czf $OUT/results.tgz -C $O .
