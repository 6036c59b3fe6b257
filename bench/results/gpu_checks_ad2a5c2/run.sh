#!/bin/bash
# translated lanes: GPU checks, the lane probe, A/B vs 287154d (spin, sleep), e2e, integrity
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o44; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|8b| 8b)|b vs a|Error|Traceback|FAIL|overhead|lane_|translated|gpu_median|host_launch|verified|\"ok\": false|wrong|passed" $O/$tag.log | cut -c1-300 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go probe 60 python3 bench/gpu_lane_probe.py --out $O/gpu_lane_probe.json
go fused 60 python3 scripts/gpu_fused_digest_check.py --out $O
go ab_spin 50 python3 bench/ab_trees.py --a .gpu_prev3 --b . --label-a 287154d --label-b $1 --device cuda --spin --case 70b-tp8 --requests 80 --out $O/ab_spin.json
go ab_sleep 45 python3 bench/ab_trees.py --a .gpu_prev3 --b . --label-a 287154d --label-b $1 --device cuda --case 70b-tp8 --requests 70 --out $O/ab_sleep.json
go e2e_gap 120 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json
go io_gap 90 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_gap.json
go order 60 python3 scripts/gpu_stream_order_check.py
go landing 60 python3 scripts/gpu_landing_check.py
