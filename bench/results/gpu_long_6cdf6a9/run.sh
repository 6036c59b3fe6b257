#!/bin/bash
# 6cdf6a9 ($1, code as a433099): a long integrity run (600 requests a level: the hold board's
# arena wraps about three times under `full`), then the e2e bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/olast; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_last && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|overhead|fault at|MET|^ *(70b|8b)" $O/$tag.log | cut -c1-200 | tail -16
  tar czf $OUT/results.tgz -C $O .
}
go io600 280 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
go e2e 250 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
