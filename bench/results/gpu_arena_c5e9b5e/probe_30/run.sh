#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=c5e9b5e-probe KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oiob; rm -rf $O; mkdir -p $O
(cd .gpu_iob && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 30 --layer-gap --out $O/io.json > $O/io.log 2>&1; echo rc=$?)
grep -E "PRODUCER|overhead|Error|Trace" $O/io.log | cut -c1-600
tar czf $OUT/results.tgz -C $O .
