#!/bin/bash
# device call 3: the two-call check (27260a1) against 82ecb4a, same start; every output in results.tgz
set -u
cd "$(dirname "$0")/.."
G=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
R=/tmp/r3; rm -rf $R; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
echo "== integrity check script (27260a1)"
(cd $G && KVLINK_COMMIT=27260a1 PYTHONPATH=/tmp/site:$G timeout 120 python3 scripts/gpu_integrity_check.py --out $R/gpu_integrity_check.json > $R/integrity.log 2>&1; echo rc=$?)
python3 -c "
import json; d=json.load(open('$R/gpu_integrity_check.json')); print('ok', d['ok'], [r['ok'] for r in d['equal']], d['cost'])" 2>&1 | cut -c1-400
echo "== landing (27260a1)"
(cd $G && KVLINK_COMMIT=27260a1 PYTHONPATH=/tmp/site:$G timeout 90 python3 scripts/gpu_landing_check.py --out $R > $R/landing.log 2>&1; echo rc=$?)
for tree in o g o g; do
  T=$G/../.gpu_$tree; label=$([ $tree = g ] && echo 27260a1 || echo 82ecb4a)
  for c in "" --cold; do
    (cd $T && PYTHONPATH=/tmp/site:$T timeout 120 python3 bench/landed_check.py --reps 30 $c --out $R/landed_${label}${c}_$RANDOM.json >> $R/landed_${label}${c}.log 2>&1; echo -n "landed $label $c rc=$? ")
    grep -E "^(sample|full)" $R/landed_${label}${c}.log | tail -2 | sed 's/.*the check in one kernel/one kernel/' | cut -c1-60 | tr '\n' ' '; echo
  done
done
for round in 1 2; do
 for tree in o g; do
  T=$G/../.gpu_$tree; label=$([ $tree = g ] && echo 27260a1 || echo 82ecb4a)
  for lv in sample full; do
   (cd $T && KVLINK_COMMIT=$label PYTHONPATH=/tmp/site:$T timeout 150 python3 bench/layerwise.py --device cuda --requests 8 --integrity $lv --steps --out $R/layerwise_${label}_${lv}_r$round.json > $R/layerwise_${label}_${lv}_r$round.log 2>&1; echo -n "$label $lv r$round rc=$? ")
   grep -E "^(layered) " $R/layerwise_${label}_${lv}_r$round.log | cut -c1-60
  done
 done
done
echo "== layerwise off (27260a1)"
(cd $G && KVLINK_COMMIT=27260a1 PYTHONPATH=/tmp/site:$G timeout 150 python3 bench/layerwise.py --device cuda --requests 8 --integrity off --out $R/layerwise_27260a1_off.json > $R/layerwise_27260a1_off.log 2>&1; echo rc=$?)
grep -E "^(whole|layered) |mismatch" $R/layerwise_27260a1_off.log | cut -c1-120
python3 - <<PY
import json, glob, statistics
for f in sorted(glob.glob("$R/layerwise_*_r*.json")):
    d = json.load(open(f))
    def find(x):
        if isinstance(x, dict):
            if "layered" in x and isinstance(x["layered"], dict) and "exposed" in x["layered"]:
                return x["layered"]
            for v in x.values():
                r = find(v)
                if r: return r
    m = find(d) or {}
    print(f.split("/")[-1], {k: round(statistics.median(v) * 1e3, 3) for k, v in m.items()
          if isinstance(v, list) and v and (k.startswith("done_poll_") or k == "exposed")})
PY
tar czf $OUT/results.tgz -C $R .
