#!/bin/bash
set -u
cd "$(dirname "$0")/.."
G=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc KVLINK_COMMIT=8fe2b64
R=/tmp/r7; rm -rf $R; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
for lv in sample full; do
KVST_OUT=$R/stamps_layerwise_$lv.jsonl PYTHONPATH=$G/probe/probe_site2:/tmp/site:$G timeout 150 python3 bench/layerwise.py --device cuda --requests 8 --integrity $lv --steps --out $R/layerwise_$lv.json > $R/layerwise_$lv.log 2>&1; echo rc=$?
grep -E "^(layered) " $R/layerwise_$lv.log | cut -c1-120
done
KVST_OUT=$R/stamps_landed.jsonl PYTHONPATH=$G/probe/probe_site2:/tmp/site:$G timeout 120 python3 bench/landed_check.py --reps 30 --out $R/landed.json > $R/landed.log 2>&1; echo rc=$?
KVST_OUT=$R/stamps_landed_cold.jsonl PYTHONPATH=$G/probe/probe_site2:/tmp/site:$G timeout 120 python3 bench/landed_check.py --reps 30 --cold --out $R/landed_cold.json > $R/landed_cold.log 2>&1; echo rc=$?
python3 - <<PY
import json, glob, os, statistics
for f in sorted(glob.glob("$R/stamps_*.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    for big in (False, True):
        rs = [r for r in rows if (r["blocks"] > 64) == big]
        if not rs: continue
        keys = [k for k in rs[0] if k not in ("pid", "blocks", "items", "spun")]
        print(os.path.basename(f), "full" if big else "sample", "n", len(rs), "spun", sum(r["spun"] for r in rs),
              {k: round(statistics.median(r[k] for r in rs), 1) for k in keys})
PY
tar czf $OUT/results.tgz -C $R .
