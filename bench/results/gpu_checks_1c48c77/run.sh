#!/bin/bash
# final: A/A (the same tree from the repo root and from .gpu_new), io A/B (HEAD vs 3d34bf2 in .gpu_old), GPU checks
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
run() {  # where tag script args...
  local where=$1 tag=$2 script=$3; shift 3
  local pp=/tmp/site:$PWD b=bench
  [ "$where" != root ] && pp=/tmp/site:$PWD/$where && b=$where/bench
  PYTHONPATH=$pp timeout 170 python3 $b/$script "$@" --out $O/$tag.json > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|4mib)|phases|Error|Traceback" $O/$tag.log | cut -c1-300; el
}
E="--device cuda --cases 70b-tp8 --requests 40 --inflight-rounds 2"
I="--device cuda --spin --cases 70b-tp8 --requests 50"
run root aa_e2e_1.root e2e_request.py $E
run .gpu_new aa_e2e_1.sub e2e_request.py $E
run root io_1.new integrity_overhead.py $I
run .gpu_old io_1.old integrity_overhead.py $I
run .gpu_new aa_e2e_2.sub e2e_request.py $E
run root aa_e2e_2.root e2e_request.py $E
run .gpu_old io_2.old integrity_overhead.py $I
run root io_2.new integrity_overhead.py $I
export PYTHONPATH=/tmp/site:$PWD
for s in "gpu_fused_digest_check.py --out $O" "gpu_integrity_check.py --out $O/gpu_integrity_check.json" "gpu_runs_check.py --out $O" "gpu_stream_order_check.py --out $O" "gpu_landing_check.py --out $O" "gpu_cuda_ipc_check.py --out $O --reps 2"; do
  n=${s%%.py*}
  timeout 150 python3 scripts/$s > $O/$n.log 2>&1; echo "== $n rc=$?"; tail -2 $O/$n.log | cut -c1-300; el
done
tar czf $OUT/results.tgz -C $O .
