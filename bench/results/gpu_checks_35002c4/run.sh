#!/bin/bash
# final checks at HEAD: GPU checks (runs, fused digest, stream order, landing), e2e, integrity, stamps
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o39; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|8b| 8b)|Error|Traceback|FAIL|overhead|lane_|\"ok\": false|wrong|passed" $O/$tag.log | cut -c1-200 | tail -8; el
  tar czf $OUT/results.tgz -C $O .
}
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go fused 60 python3 scripts/gpu_fused_digest_check.py --out $O
go order 60 python3 scripts/gpu_stream_order_check.py
go landing 60 python3 scripts/gpu_landing_check.py
go e2e_gap 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json
go io_gap 90 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json
(cd .gpu_a && PYTHONPATH=/tmp/site:$PWD KVST_OUT=$O/st timeout 90 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 40 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
for f in $O/st.*.json; do python3 bench/results/gpu_checks_2f9e7e9/stamps_report.py.txt $f > $f.txt 2>&1; done
tail -36 $O/st.*.txt | cut -c1-60; el
tar czf $OUT/results.tgz -C $O .
