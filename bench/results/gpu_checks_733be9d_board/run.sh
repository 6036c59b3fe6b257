#!/bin/bash
# board lanes: GPU checks (fused incl. board lanes, runs), integrity bench (new tree)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/oa; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|8b| 8b)|Error|Traceback|FAIL|overhead|fault at|'ok'|\"ok\"|ratio|wrong|passed|board_lane" $O/$tag.log | cut -c1-600 | tail -14; el
  tar czf $OUT/results.tgz -C $O .
}
go fused 150 python3 scripts/gpu_fused_digest_check.py --out $O
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go io_gap 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json
