#!/bin/bash
# $1 commit: final-tree GPU checks, then the C-stamped tree's e2e (70B, 8B)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or1; rm -rf $O; mkdir -p $O/st
T0=$(date +%s)
go() {  # dir tag limit cmd...
  local dir=$1 tag=$2 lim=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong  |'ok': False|verified=False|\"ok\": false|MISMATCH|MET" $O/$tag.log | cut -c1-200 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
go .gpu_f fused 100 python3 scripts/gpu_fused_digest_check.py --out $O
go .gpu_f runs 50 python3 scripts/gpu_runs_check.py --out $O
go .gpu_f order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go .gpu_f ipc 120 python3 scripts/gpu_cuda_ipc_check.py --out $O
KVST_OUT=$O/st/st go .gpu_x st 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 60 --inflight-rounds 2 --layer-gap --out $O/e2e_st.json
for f in $O/st/st.*.json; do python3 .exp/run1/cstamp_report.py  # (kept here as stamps_report.py.txt, split by case) $f > $f.txt 2>&1; done
cat $O/st/*.txt | head -120
tar czf $OUT/results.tgz -C $O .
