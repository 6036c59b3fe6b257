#!/bin/bash
# .gpu_ord ($1): the session's last code: the fused check and the 70B integrity overhead
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ofi; rm -rf $O; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_ord && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|'ok': False|overhead|goals|phases" $O/$tag.log | cut -c1-300 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 120 python3 scripts/gpu_fused_digest_check.py --out $O
go io 200 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out $O/io.json
