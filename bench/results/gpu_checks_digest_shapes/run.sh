#!/bin/bash
# issue 24: fused-digest kernel v2 (rows with the launch, 32-bit indices, expected rows read early,
# launch bound) and the split launch for sample; probe of shapes; e2e overhead split vs one launch
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|_us\"|overhead|sample|full|Error|Traceback|FAIL|ok" $O/$tag.log | cut -c1-300 | tail -14; el
  tar czf $OUT/results.tgz -C $O .
}
go probe 150 python3 .exp/probe_digest_shapes.py $O
go fused 90 python3 scripts/gpu_fused_digest_check.py --out $O
go io_split 120 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --out $O/io_split.json
cd .gpu_a && KVLINK_COMMIT=$1-onelaunch PYTHONPATH=/tmp/site:$PWD go io_one 120 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --out $O/io_one.json; cd ..
go integrity 120 python3 scripts/gpu_integrity_check.py --out $O
go cuda_ipc 90 python3 scripts/gpu_cuda_ipc_check.py --out $O --reps 2
