#!/bin/bash
# 8 requests in flight: the tree with the C event query (c8477f4) against the one before it
# (088fd64, the alive word), alternating in one start, twice each
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oi; rm -rf $O; mkdir -p $O
T0=$(date +%s)
for i in 1 2; do
  for t in mid new; do
    (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD KVLINK_COMMIT=$t timeout 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 20 --inflight-rounds 4 --layer-gap --out $O/e2e_${t}_$i.json > $O/e2e_${t}_$i.log 2>&1)
    echo "== $t $i rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *70b" $O/e2e_${t}_$i.log
    tar czf $OUT/results.tgz -C $O .
  done
done
