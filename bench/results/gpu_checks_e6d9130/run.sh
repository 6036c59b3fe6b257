#!/bin/bash
# issue 24 at e6d9130 (+ .gpu_old = ab07b6b): integrity overhead new vs base in one start; issue 19 e2e at this tree
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|^8b|Error|Traceback|FAIL|phases|fault at|goals" $O/$tag.log | cut -c1-260 | tail -12; el
  tar czf $OUT/results.tgz -C $O .
}
base() { (cd .gpu_old && KVLINK_COMMIT=ab07b6b PYTHONPATH=/tmp/site:$PWD go "$@"); }
go fused 90 python3 scripts/gpu_fused_digest_check.py --out $O
go io_1 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --out $O/io_1.json
base io_base_1 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --out $O/io_base_1.json
go io_2 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --out $O/io_2.json
base io_base_2 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --out $O/io_base_2.json
KVLINK_BENCH_LAYER_GAP=1 go io_gap 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --out $O/io_gap.json
go io_8b 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 8b-tp1 --requests 60 --out $O/io_8b.json
go e2e_gap 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json
