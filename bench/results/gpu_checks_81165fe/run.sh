#!/bin/bash
# the fused kernel's copy first: correctness + device time; integrity check; integrity overhead
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|_us|Error|Traceback|FAIL|'ok'|overhead" $O/$tag.log | cut -c1-600 | tail -8; el
  tar czf $OUT/results.tgz -C $O .
}
go fused 90 python3 scripts/gpu_fused_digest_check.py --out $O
go integrity 60 python3 scripts/gpu_integrity_check.py --out $O/gpu_integrity_check.json
go io 130 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --out $O/io.json
