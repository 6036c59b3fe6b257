#!/bin/bash
# the final tree on the GPU: cuda_ipc check, integrity overhead (fused READs through post_runs)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|verified|Error|Traceback|FAIL|overhead" $O/$tag.log | cut -c1-400 | tail -8; el
  tar czf $OUT/results.tgz -C $O .
}
go io 90 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 40 --out $O/io.json
go cuda_ipc 60 python3 scripts/gpu_cuda_ipc_check.py --out $O --reps 2
