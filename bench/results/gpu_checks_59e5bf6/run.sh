#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl .whl/pyzmq-*.whl || exit 1
export PYTHONUNBUFFERED=1
mkdir -p $OUT/c
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 scripts/gpu_runs_check.py --out $OUT/c 2>&1 | grep -v "^\s*[0-9.,]*$" | tail -32
timeout 150 python3 scripts/gpu_fused_digest_check.py --out $OUT/c > $OUT/c/fused.log 2>&1; echo "fused rc=$?"; grep -E '"ok"|ratio|_us"' $OUT/c/fused.log | tail -14
C="--device cuda --cases 70b-tp8 --requests 40"
run() {  # tree tag args...
  local tree=$1 tag=$2; shift 2
  local pp=/tmp/site:$PWD; [ "$tree" = old ] && pp=/tmp/site:$PWD/.gpu_old
  echo "=== $tree $tag"
  PYTHONPATH=$pp timeout 150 python3 bench/e2e_request.py "$@" --out $OUT/$tag.$tree.json 2>&1 | grep -E "^(4mib|70b)|  (4mib|70b).*wait=|Error|error|Traceback" | grep -v "^$"
}
run new e2e_cuda_ipc_70b_1 $C
run old e2e_cuda_ipc_70b_1 $C
run new e2e_cuda_ipc_70b_2 $C
run old e2e_cuda_ipc_70b_2 $C
