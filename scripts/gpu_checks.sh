#!/bin/bash
# The GPU checks and benches of a tree, in one call of the device machine (its README: no
# internet, msgspec carried as a wheel).
#
#   here:    rm -rf .gpu_f && mkdir .gpu_f && git ls-files -z kvlink kvlink_transports scripts \
#              'bench/*.py' | xargs -0 tar c | tar x -C .gpu_f
#            (and the msgspec wheel for the device's Python in .whl2/)
#   device:  bash .gpu_f/scripts/gpu_checks.sh LABEL [STEP...]     (carry .whl2 and .gpu_f)
#
# LABEL names the tree in the JSONs (KVLINK_COMMIT: the device's copy has no git metadata).
# STEPs, in the order given (default: all of them, ~5 min on one H200):
#   runs   scripts/gpu_runs_check.py: lanes byte for byte, refusals, end marks, device times
#   order  scripts/gpu_stream_order_check.py: copies after the caller's stream (0 wrong)
#   ipc    scripts/gpu_cuda_ipc_check.py: cuda_ipc between two processes
#   fused  scripts/gpu_fused_digest_check.py: the copy kernel's integrity digest (issue 24)
#   e2e    bench/e2e_request.py --device cuda: issue 19's goals, through the public API
#   host   bench/gpu_lane_host.py: a lane post's host time, the 70B and 8B cases
#   io     bench/integrity_overhead.py --device cuda: issue 24's overhead, 500 requests a level
#          request by request, then 200 in runs of 20 a level
#   integrity  scripts/gpu_integrity_check.py: the digest kernel against the host's, a layer
#          range taken later (not waiting for a busy stream), its cost
#   layerwise  bench/layerwise.py --device cuda at integrity off, sample and full (a
#          layer-wise push digested range by range on the forward's stream, checked whole)
#   landing  scripts/gpu_landing_check.py: the landing board's signal on the device
#   soak   bench/lifecycle_soak.py --transport cuda_ipc: randomized kills, restarts, stalls and
#          reuse with both caches on the GPU (integrity sample), 8 schedules; 0 violations
# Every step's log and JSON go to $OUT/results.tgz; each step's last telling lines print here.
set -u
label=${1:?usage: gpu_checks.sh LABEL [runs order ipc fused e2e host io integrity layerwise landing soak]}
shift
steps=${*:-runs order ipc fused e2e host io}
tree=$(cd "$(dirname "$0")/.." && pwd)
wheels=$tree/.whl2  # (the checkout's own, or the one beside the copy in .gpu_f)
[ -d "$wheels" ] || wheels=$tree/../.whl2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$label KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/gpu_checks
rm -rf $O && mkdir -p $O
T0=$(date +%s)
go() {  # tag limit cmd...
    local tag=$1 lim=$2
    shift 2
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$lim" "$@" > $O/$tag.log 2>&1)
    echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"
    grep -E "Error|Traceback|FAIL|MISMATCH|MET|overhead|expects|copy_lane " $O/$tag.log \
        | cut -c1-220 | tail -14
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for step in $steps; do
    case $step in
    runs) go runs 60 python3 scripts/gpu_runs_check.py --out $O
          grep -A6 lane_device_times $O/runs.log | head -7 ;;
    order) go order 60 python3 scripts/gpu_stream_order_check.py --out $O --modes order \
               --timing-reps 0 ;;
    ipc) go ipc 90 python3 scripts/gpu_cuda_ipc_check.py --out $O ;;
    fused) go fused 120 python3 scripts/gpu_fused_digest_check.py --out $O
           grep -A10 '"board_lane_cost"' $O/gpu_fused_digest_check.json | grep _us ;;
    e2e) go e2e 200 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 \
             --requests 40 --inflight-rounds 6 --layer-gap --out $O/e2e.json
         grep -E "^ *(70b|8b)|poll grace" $O/e2e.log ;;
    host) go host 120 python3 bench/gpu_lane_host.py --reps 200 --out $O/gpu_lane_host.json ;;
    io) go io 240 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 \
            --requests 500 --layer-gap --out $O/io500.json
        tail -12 $O/io.log
        # (levels in runs of 20: a deployment's one level, its path warm)
        go io_runs20 120 python3 bench/integrity_overhead.py --device cuda --spin \
            --cases 70b-tp8 --requests 200 --run-length 20 --layer-gap \
            --out $O/io200_runs20.json
        grep -E "overhead|on the device" $O/io_runs20.log ;;
    integrity) go integrity 120 python3 scripts/gpu_integrity_check.py \
                   --out $O/gpu_integrity_check.json ;;
    layerwise) for lv in off sample full; do
            go layerwise_$lv 180 python3 bench/layerwise.py --device cuda --requests 8 \
                --integrity $lv --out $O/layerwise_$lv.json
            grep -E "^(whole|layered|one) |mismatches" $O/layerwise_$lv.log
        done ;;
    landing) go landing 90 python3 scripts/gpu_landing_check.py --out $O ;;
    soak) go soak 150 python3 bench/lifecycle_soak.py --transport cuda_ipc --integrity sample \
              --schedules 8 --start 0 --out $O/lifecycle_soak_cuda_ipc.json
          grep -E "violations" $O/soak.log | cut -c1-300 ;;
    *) echo "unknown step $step (runs order ipc fused e2e host io integrity layerwise landing soak)"
       exit 2 ;;
    esac
done
tar czf "${OUT:-/tmp}/results.tgz" -C $O .
