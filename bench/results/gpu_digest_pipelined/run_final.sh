#!/bin/bash
# .gpu_pipe ($1): the final tree's GPU checks (fused digests, lanes, stream order), the 70B
# integrity overhead and the e2e request through the public API
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/opf; rm -rf $O; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_pipe && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|goals|70b|8b" $O/$tag.log | cut -c1-300 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go fused 120 python3 scripts/gpu_fused_digest_check.py --out $O
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go order 90 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go io 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 120 --layer-gap --out $O/io.json
go e2e 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
