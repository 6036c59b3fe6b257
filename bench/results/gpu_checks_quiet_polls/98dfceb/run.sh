#!/bin/bash
# quiet polls (1 s): A/B vs ad2a5c2 (spin, sleep), stamped e2e (mode tags, whole polls counted, no GPU events), e2e, integrity
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o48; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|8b| 8b)|b vs a|Error|Traceback|FAIL|overhead|\"ok\": false|wrong|passed" $O/$tag.log | cut -c1-300 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
go ab_spin 50 python3 bench/ab_trees.py --a .gpu_prev4 --b . --label-a ad2a5c2 --label-b $1 --device cuda --spin --case 70b-tp8 --requests 80 --out $O/ab_spin.json
go ab_sleep 45 python3 bench/ab_trees.py --a .gpu_prev4 --b . --label-a ad2a5c2 --label-b $1 --device cuda --case 70b-tp8 --requests 70 --out $O/ab_sleep.json
(cd .gpu_a && PYTHONPATH=/tmp/site:$PWD KVST_NOEV=1 KVST_OUT=$O/st timeout 80 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 50 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
for f in $O/st.*[0-9].json; do python3 .exp/stamps_report2.py $f > $f.txt 2>&1; cut -c1-70 $f.txt; done; el
tar czf $OUT/results.tgz -C $O .
go e2e_gap 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json
go io_gap 90 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json
