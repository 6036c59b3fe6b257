#!/bin/bash
# HEAD: integrity overhead (70B spin, vLLM layout too), e2e issue-19 figures, and a call timeline of the decode's request path
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|^8b|Error|Traceback|FAIL|phases|fault at|MET" $O/$tag.log | cut -c1-240 | tail -14; el
  tar czf $OUT/results.tgz -C $O .
}
go probe_walk 120 python3 .exp/probe_walk.py $O
go fused 60 python3 scripts/gpu_fused_digest_check.py --out $O
go io_8b 80 python3 bench/integrity_overhead.py --device cuda --spin --cases 8b-tp1 --requests 40 --layer-gap --out $O/io_8b.json
go io 80 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --layer-gap --out $O/io_gap.json
