#!/bin/bash
# integrity overhead with a route per level
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o41; rm -rf $O; mkdir -p $O
timeout 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json > $O/io_gap.log 2>&1; echo "io rc=$?"; tail -9 $O/io_gap.log | cut -c1-330
tar czf $OUT/results.tgz -C $O .
