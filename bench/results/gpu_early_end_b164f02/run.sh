#!/bin/bash
# $1: which part. A: e2e of new, 70B A/B (5a428c2 vs early end), lane checks, 8B A/B.
# B: integrity levels for new, old, arena (a probe copy: every lane copy timed).
set -u
G=$(cd "$(dirname "$0")" && pwd)
R=/tmp/res5$1; rm -rf $R; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
(cat /sys/devices/system/clocksource/clocksource0/current_clocksource; nproc; grep -m1 "model name" /proc/cpuinfo; date -u) > $R/host.txt 2>&1; cat $R/host.txt
cd $G; T0=$(date +%s)
go() {  # tag limit tree cmd...
  local tag=$1 lim=$2 tree=$3; shift 3
  PYTHONPATH=/tmp/site:$tree timeout $lim "$@" > $R/$tag.log 2>&1; echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"
  grep -E "Error|Traceback|FAIL|b vs a|MET|overhead|fault at|^ *(70b|8b)|violations|schedules" $R/$tag.log | cut -c1-300 | tail -14
  tar czf $OUT/results.tgz -C $R .
}
if [ $1 = A ]; then
  KVLINK_COMMIT=b164f02 go e2e_new 110 $G/new python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 4 --layer-gap --out $R/e2e_new.json
  KVLINK_COMMIT=b164f02 go soak_ipc 120 $G/new python3 bench/lifecycle_soak.py --transport cuda_ipc --integrity sample --schedules 8 --start 0 --out $R/soak_ipc_sample.json
  for t in new arena; do
    KVLINK_COMMIT=$t go io_$t 75 $G/$t python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 250 --layer-gap --out $R/io_$t.json
  done
  go ab70 $(( 545 - ($(date +%s) - T0) )) $G python3 bench/ab_trees.py --a $G/old --b $G/new --label-a 5a428c2 --label-b b164f02 --device cuda --spin --case 70b-tp8 --layer-gap --requests 200 --out $R/ab_70b_spin_200.json
else
  KVLINK_COMMIT=b164f02 go runs 40 $G/new python3 scripts/gpu_runs_check.py --out $R
  go ab8 110 $G python3 bench/ab_trees.py --a $G/old --b $G/new --label-a 5a428c2 --label-b b164f02 --device cuda --spin --case 8b-tp1 --layer-gap --requests 150 --out $R/ab_8b_spin_150.json
  for t in new arena new2; do
    d=$t; [ $t = new2 ] && d=new
    KVLINK_COMMIT=$t go io_$t 62 $G/$d python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 250 --layer-gap --out $R/io_$t.json
  done
fi
