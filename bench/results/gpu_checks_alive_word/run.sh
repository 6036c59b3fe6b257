#!/bin/bash
# the hold board's alive word (a robust futex the kernel marks when the producer dies), read by
# the after-check where it made a flock: A/B against b88feb0, the host calls cold, checks, e2e, integrity
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oa; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|overhead|fault at|after-check|syscall|mark_|lane_launcher|wrong|\"ok\"|'ok'" $O/$tag.log | cut -c1-220 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
go cold 120 .gpu_new python3 bench/cold_calls.py --reps 100 --out $O/cold_calls.json
go ab_spin 150 . python3 .gpu_new/bench/ab_trees.py --a .gpu_prev --b .gpu_new --label-a b88feb0 --label-b alive-word --device cuda --spin --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_spin.json
go ab_sleep 150 . python3 .gpu_new/bench/ab_trees.py --a .gpu_prev --b .gpu_new --label-a b88feb0 --label-b alive-word --device cuda --case 70b-tp8 --requests 100 --layer-gap --out $O/ab_sleep.json
go e2e 150 .gpu_new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
go io 150 .gpu_new python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
go runs 100 .gpu_new python3 scripts/gpu_runs_check.py --out $O
go fused 120 .gpu_new python3 scripts/gpu_fused_digest_check.py --out $O
