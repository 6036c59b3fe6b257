#!/bin/bash
# one device call: HEAD's GPU checks (c = 9cce35e), then full's order c/d and sample's order d/e
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p /tmp/r
save() { tar czf $OUT/r.tgz -C /tmp/r . ; }
OUT=/tmp/r timeout 80 bash .gpu_c/scripts/gpu_checks.sh 9cce35e runs order; mv /tmp/r/results.tgz /tmp/r/head_checks.tgz; save
echo "[$(( $(date +%s) - T0 )) s] checks done"
for i in 1 2; do for t in c d e; do
  d=/tmp/r/fused_${t}_$i; mkdir -p $d
  (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 scripts/gpu_fused_digest_check.py --out $d > $d/fused.log 2>&1); echo "fused $t $i rc=$?"
  python3 -c "
import json
d=json.load(open('$d/gpu_fused_digest_check.json')); c=d['board_lane_cost']; print({k:round(v,1) for k,v in c.items() if k.endswith('_us')}, 'ok' if d['ok'] else 'NOT OK')"
done; done; save
echo "[$(( $(date +%s) - T0 )) s] fused done"
for t in d e c d e c; do
  k=${t}_$RANDOM
  (cd .gpu_$t && KVLINK_COMMIT=$t PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out /tmp/r/io_$k.json > /tmp/r/io_$k.log 2>&1; echo "io $t rc=$?")
  grep -hE "overhead|on the device|fault at" /tmp/r/io_$k.log | cut -c1-220
  save
  [ $(( $(date +%s) - T0 )) -gt 330 ] && break
done
echo "[$(( $(date +%s) - T0 )) s] io done"
if [ $(( $(date +%s) - T0 )) -lt 340 ]; then
  (cd .gpu_e && KVLINK_COMMIT=e PYTHONPATH=/tmp/site:$PWD timeout 70 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --run-length 20 --layer-gap --out /tmp/r/io_e_runs20.json > /tmp/r/io_e_runs20.log 2>&1; echo "io e runs20 rc=$?")
  grep -hE "overhead|on the device" /tmp/r/io_e_runs20.log | cut -c1-220
fi
save
