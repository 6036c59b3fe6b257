#!/bin/bash
# $1 (.gpu_m): after the review mend of the ctypes lane launch: the fused digest check through
# the C launcher and through ctypes, and the lanes' check through ctypes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/om; rm -rf $O; mkdir -p $O/c $O/ct
cd .gpu_m
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu_fused_digest_check.py --out $O/c > $O/c/fused.log 2>&1; echo "== fused C rc=$?"
KVLINK_NATIVE=0 PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu_fused_digest_check.py --out $O/ct > $O/ct/fused.log 2>&1; echo "== fused ctypes rc=$?"
KVLINK_NATIVE=0 PYTHONPATH=/tmp/site:$PWD timeout 60 python3 scripts/gpu_runs_check.py --out $O/ct > $O/ct/runs.log 2>&1; echo "== runs ctypes rc=$?"
for t in c ct; do python3 -c "import json;d=json.load(open('$O/$t/gpu_fused_digest_check.json'));print('$t', d['ok'])"; done
python3 -c "import json;d=json.load(open('$O/ct/gpu_runs_check.json'));print({k:v for k,v in d.items() if k.startswith('lane')})"
tar czf $OUT/results.tgz -C $O .
