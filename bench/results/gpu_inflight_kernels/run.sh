#!/bin/bash
# .gpu_slot ($1): 8 lane kernels back to back against 8 device copies (inflight_probe.py), and
# the fused check with lanes launched through ctypes (KVLINK_NATIVE=0: the launcher's Python
# twin, board_slot, reads the hold's slot)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oin; rm -rf $O; mkdir -p $O/ctypes
(cd .gpu_slot && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 inflight_probe.py $O/inflight.json > $O/inflight.log 2>&1); echo "== inflight rc=$?"; tail -5 $O/inflight.log | cut -c1-400
(cd .gpu_slot && KVLINK_NATIVE=0 PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes > $O/ctypes/fused.log 2>&1); echo "== fused_ctypes rc=$?"; grep -E "Error|Trace|FAIL|False" $O/ctypes/fused.log | head -5
tar czf $OUT/results.tgz -C $O .
