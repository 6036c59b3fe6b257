#!/bin/bash
# $1 commit: the e2e bench on the stop's final tree (one more start of the device machine)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oe2e; rm -rf $O; mkdir -p $O
(cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json > $O/e2e.log 2>&1); echo "== e2e rc=$?"
grep -E "MET|^ *(70b|8b)" $O/e2e.log | cut -c1-160
tar czf $OUT/results.tgz -C $O .
