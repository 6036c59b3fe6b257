#!/bin/bash
# c1c7cf6's library: issue 19's e2e and issue 24's overhead (new tree only), then the integrity
# package's GPU checks (moved in 8bceff1, not run on a GPU since)
G=$(cd "$(dirname "$0")" && pwd)
R=/tmp/resm; rm -rf $R; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=c1c7cf6
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; lscpu | grep 'Model name' | tee $R/host.txt
cd $G; T0=$(date +%s)
PYTHONPATH=/tmp/site:$G/new timeout 130 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e.json > $R/e2e.log 2>&1
echo "== e2e rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *(70b|8b)|MET|poll grace" $R/e2e.log | cut -c1-220
tar czf $OUT/resm.tgz -C $R .
PYTHONPATH=/tmp/site:$G/new timeout 62 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 180 --layer-gap --out $R/io_new.json > $R/io_new.log 2>&1
echo "== io_new rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "overhead|on the device" $R/io_new.log | cut -c1-300
tar czf $OUT/resm.tgz -C $R .
timeout 200 bash $G/scripts/gpu_checks.sh c1c7cf6 integrity fused 2>&1 | tail -30
