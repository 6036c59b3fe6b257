#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl .whl/pyzmq-*.whl || exit 1
export PYTHONUNBUFFERED=1
C="--device cuda --cases 70b-tp8 --requests 40"
run() {  # tree tag script args...
  local tree=$1 tag=$2 script=$3; shift 3
  local pp=/tmp/site:$PWD; [ "$tree" = old ] && pp=/tmp/site:$PWD/.gpu_old
  echo "=== $tree $tag"
  PYTHONPATH=$pp timeout 150 python3 $script "$@" --out $OUT/$tag.$tree.json > $OUT/$tag.$tree.log 2>&1; echo "rc=$?"
  grep -E "^(4mib|70b)|  (4mib|70b).*wait=|phases|overhead|Error|error|Traceback" $OUT/$tag.$tree.log | grep -v "^$"
}
for i in 1 2; do
run new e2e_cuda_ipc_70b_$i bench/e2e_request.py $C
run old e2e_cuda_ipc_70b_$i bench/e2e_request.py $C
done
run new integrity_70b_spin bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 40
