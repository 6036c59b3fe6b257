#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl .whl/pyzmq-*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O/so
for s in "gpu_runs_check.py --out $O" "gpu_fused_digest_check.py --out $O" "gpu_landing_check.py --out $O" "gpu_cuda_ipc_check.py --out $O --reps 1" "gpu_staging_check.py --out $O --gib 0.5 --reps 2" "gpu_staging_check.py --stream-order --out $O/so"; do
  n=${s%%.py*}; n=$n$(echo "$s" | grep -q stream-order && echo _stream_order)
  timeout 120 python3 scripts/$s > $O/$n.log 2>&1; echo "== $n rc=$?"; tail -2 $O/$n.log | cut -c1-250
done
timeout 100 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 15 --inflight-rounds 1 --out $O/e2e_cuda_ipc_70b.json > $O/e2e.log 2>&1; echo "== e2e rc=$?"; grep -E "^70b|wait=" $O/e2e.log
tar czf $OUT/results.tgz -C $O .
