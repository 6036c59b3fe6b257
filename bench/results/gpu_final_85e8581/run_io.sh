#!/bin/bash
# $1 (.gpu_f): integrity overhead, 600 requests a level, polled in a loop
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oio; rm -rf $O; mkdir -p $O
T0=$(date +%s)
(cd .gpu_f && PYTHONPATH=/tmp/site:$PWD timeout 420 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 600 --layer-gap --out $O/io600.json > $O/io600.log 2>&1); echo "== io600 rc=$? [$(( $(date +%s) - T0 )) s]"
grep -E "Error|Traceback|overhead|fault|MET" $O/io600.log | cut -c1-220 | tail -16
tar czf $OUT/results.tgz -C $O .
