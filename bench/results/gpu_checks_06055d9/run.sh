#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl .whl/pyzmq-*.whl || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O
C="--device cuda --cases 70b-tp8 --requests 40"
run() {  # tree tag script args...
  local tree=$1 tag=$2 script=$3; shift 3
  local pp=/tmp/site:$PWD; [ "$tree" = old ] && pp=/tmp/site:$PWD/.gpu_old; [ "$tree" = pol ] && pp=/tmp/site:$PWD/.gpu_new
  PYTHONPATH=$pp timeout 150 python3 $script "$@" --out $O/$tag.$tree.json > $O/$tag.$tree.log 2>&1; echo "== $tree $tag rc=$?"
  grep -E "^(4mib|70b)|  (4mib|70b).*wait=|phases|overhead|Error|error|Traceback" $O/$tag.$tree.log | grep -v "^$"
}
for i in 1 2; do
run pol e2e_cuda_ipc_70b_$i bench/e2e_request.py $C
run old e2e_cuda_ipc_70b_$i bench/e2e_request.py $C
done
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 bench/gpu_host_calls.py --out $O/gpu_host_calls.json > $O/gpu_host_calls.log 2>&1; echo "== host_calls rc=$?"; cat $O/gpu_host_calls.log | cut -c1-400
run new integrity_overhead_cuda_spin bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 40
for s in "gpu_runs_check.py --out $O" "gpu_fused_digest_check.py --out $O" "gpu_stream_order_check.py --out $O" "gpu_landing_check.py --out $O" "gpu_integrity_check.py --out $O/gpu_integrity_check.json" "gpu_cuda_ipc_check.py --out $O --reps 3"; do
  n=${s%%.py*}
  timeout 170 python3 scripts/$s > $O/$n.log 2>&1; echo "== $n rc=$?"; tail -3 $O/$n.log | cut -c1-300
done
KVPROF_OUT=$O/prof19_70b_calls.json TLREQ=45,47 timeout 200 python3 .exp/prof19.py --device cuda --cases 70b-tp8 --requests 30 --inflight-rounds 2 --out $O/prof19_70b.json > $O/prof19_70b.log 2>&1; echo "== prof19 rc=$?"; grep -E "^70b|wait=" $O/prof19_70b.log
tar czf $OUT/results.tgz -C $O .
