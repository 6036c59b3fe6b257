#!/bin/bash
# .gpu_pipe ($1): the digest lane's board lookups pipelined under the copy; probe against the
# committed kernel in one process, then the 70B integrity overhead through the public API
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/opi; rm -rf $O; mkdir -p $O
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  (cd .gpu_pipe && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|VARIANT|'ok': False|full|sample" $O/$tag.log | cut -c1-260 | tail -12
  tar czf $OUT/results.tgz -C $O .
}
go variants 240 python3 digest_pipe.py $O/variants.json
go io 300 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
