set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
mkdir -p /tmp/r4; T0=$(date +%s)
for t in g c; do d=/tmp/r4/fused_$t; mkdir -p $d
  (cd .gpu_$t && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 scripts/gpu_fused_digest_check.py --out $d > $d/fused.log 2>&1); echo "fused $t rc=$?"
  python3 -c "
import json
d=json.load(open('$d/gpu_fused_digest_check.json')); c=d['board_lane_cost']; print({k:round(v,1) for k,v in c.items() if k.endswith('_us')}, 'ok' if d['ok'] else 'NOT OK')"
done
for t in g c g c; do k=${t}_$RANDOM
  (cd .gpu_$t && KVLINK_COMMIT=$t PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out /tmp/r4/io_$k.json > /tmp/r4/io_$k.log 2>&1; echo "io $t rc=$?")
  grep -hE "overhead|on the device" /tmp/r4/io_$k.log | cut -c1-220
  tar czf $OUT/r4.tgz -C /tmp/r4 .
  [ $(( $(date +%s) - T0 )) -gt 200 ] && break
done
tar czf $OUT/r4.tgz -C /tmp/r4 .
