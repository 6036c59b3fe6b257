#!/bin/bash
# e2e on 020d84e; integrity levels on 5a428c2 (before the early end) and 020d84e one after the other; one start
set -u
G=$(cd "$(dirname "$0")" && pwd)
R=/tmp/res7; rm -rf $R; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt; lscpu | grep 'Model name' > $R/host.txt; cat $R/host.txt
cd $G; T0=$(date +%s)
PYTHONPATH=/tmp/site:$G/new KVLINK_COMMIT=020d84e timeout 130 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1
echo "== e2e rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *(70b|8b)|MET|poll grace" $R/e2e.log | cut -c1-220
tar czf $OUT/results.tgz -C $R .
for t in old new; do
  c=5a428c2; [ $t = new ] && c=020d84e
  PYTHONPATH=/tmp/site:$G/$t KVLINK_COMMIT=$c timeout 62 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 180 --layer-gap --out $R/io_$t.json > $R/io_$t.log 2>&1
  echo "== io_$t rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "overhead|on the device" $R/io_$t.log | cut -c1-300
  tar czf $OUT/results.tgz -C $R .
done
