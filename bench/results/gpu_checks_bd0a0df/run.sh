#!/bin/bash
# HEAD after the walk was reverted: fused check and the 70B integrity overhead (vLLM's region per layer)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^70b|Error|Traceback|FAIL|phases|fault at" $O/$tag.log | cut -c1-240 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 60 python3 scripts/gpu_fused_digest_check.py --out $O
go io_gap 80 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json
