#!/bin/bash
# .gpu_slot ($1): the e2e request with 8 in flight under both pollers (inflight8: the caller
# sleeps 0.2 ms between polls; inflight8_spin: it polls in a loop), every request verified
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ois; rm -rf $O; mkdir -p $O
(cd .gpu_slot && PYTHONPATH=/tmp/site:$PWD timeout 400 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 6 --layer-gap --out $O/e2e.json > $O/e2e.log 2>&1); echo "== e2e rc=$?"
grep -E "^\s*(70b|8b)|MET|Error|Trace" $O/e2e.log | cut -c1-200
tar czf $OUT/results.tgz -C $O .
