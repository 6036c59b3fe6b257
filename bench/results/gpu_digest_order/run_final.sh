#!/bin/bash
# .gpu_ord ($1): the final tree's GPU checks (fused digests through the C launcher and through
# ctypes, lanes, stream order) and the 70B integrity overhead through the public API
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oof; rm -rf $O; mkdir -p $O/ctypes
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_ord && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|goals" $O/$tag.log | cut -c1-300 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
go fused 120 python3 scripts/gpu_fused_digest_check.py --out $O
KVLINK_NATIVE=0 go ctypes/fused 150 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go order 90 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go io 420 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out $O/io.json
