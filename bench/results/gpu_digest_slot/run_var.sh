#!/bin/bash
# .gpu_slot: variants of the digest lane kernel's board block, in one process (digest_var.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=$1
O=/tmp/ova; rm -rf $O; mkdir -p $O
(cd .gpu_slot && PYTHONPATH=/tmp/site:$PWD timeout 400 python3 digest_var.py $O/variants.json > $O/variants.log 2>&1); echo "rc=$?"
grep -E "VARIANT|Error|Trace" $O/variants.log | cut -c1-250
tar czf $OUT/results.tgz -C $O .
