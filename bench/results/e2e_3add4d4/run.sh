#!/bin/bash
# the stop's tree: e2e (integrity off) through the public API
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/of; rm -rf $O; mkdir -p $O
timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json > $O/e2e_gap.log 2>&1; echo "rc=$?"
grep -E "^(70b|8b| 8b)|Error|Traceback" $O/e2e_gap.log | cut -c1-300
tar czf $OUT/results.tgz -C $O .
