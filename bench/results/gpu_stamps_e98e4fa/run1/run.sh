#!/bin/bash
# e98e4fa ($1): GPU checks of the review mends (fused digests through the C launcher and
# ctypes, lanes, stream order), then a stamped 70B request timeline (.gpu_st)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/or1; rm -rf $O; mkdir -p $O/ctypes
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|goals|MET" $O/$tag.log | cut -c1-250 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 120 .gpu_r1 python3 scripts/gpu_fused_digest_check.py --out $O
KVLINK_NATIVE=0 go ctypes/fused 150 .gpu_r1 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
go runs 60 .gpu_r1 python3 scripts/gpu_runs_check.py --out $O
go order 90 .gpu_r1 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
KVST_NOEV=1 KVST_OUT=$O/st go stamped 150 .gpu_st python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json
for f in $O/st.*.json; do python3 .gpu_st/report.py $f > $f.txt 2>&1; done; cat $O/st.*.txt | cut -c1-70
tar czf $OUT/results.tgz -C $O .
