#!/bin/bash
# $1 label: issue 19's e2e bench and issue 24's overhead on the tree in .gpu_f (one command)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oe; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "Error|Traceback|FAIL|MISMATCH|MET|overhead|goals" $O/$tag.log | cut -c1-220 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
go e2e 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
grep -E "^ *(70b|8b)|phases| post=" $O/e2e.log
go io600 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json
