#!/bin/bash
# 959a4b7 ($1) against e98e4fa (.gpu_r1): GPU checks, the A/B tree against tree (70B, polled
# in a loop), a stamped timeline of the new tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or3; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|b vs a|MET" $O/$tag.log | cut -c1-250 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 120 .gpu_new python3 scripts/gpu_fused_digest_check.py --out $O
go runs 60 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go ab_spin 200 . python3 .gpu_new/bench/ab_trees.py --a .gpu_r1 --b .gpu_new --label-a e98e4fa --label-b 959a4b7 --device cuda --spin --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_spin.json
KVST_NOEV=1 KVST_OUT=$O/st go stamped 150 .gpu_st2 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json
for f in $O/st.*.json; do python3 .gpu_st2/report.py $f > $f.txt 2>&1; done; sed -n '1,40p' $O/st.*.txt | cut -c1-60
tar czf $OUT/results.tgz -C $O .
