#!/bin/bash
# .gpu_ord (fd21d33): the sample order block by block against segment by segment (digest_ord.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=$1
O=/tmp/oov; rm -rf $O; mkdir -p $O
(cd .gpu_ord && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 digest_ord.py $O/variants.json > $O/variants.log 2>&1); echo "rc=$?"
grep -E "VARIANT|Error|Trace" $O/variants.log | cut -c1-250
tar czf $OUT/results.tgz -C $O .
