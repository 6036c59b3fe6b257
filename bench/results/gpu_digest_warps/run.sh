#!/bin/bash
# .gpu_dig ($1): kv_move_digest with a wave of warps that each read the board once and take
# their checked units first; against .gpu_fin (a3e5dd9): fused digests checked and timed,
# grids of 1/2/4 waves and uncapped, integrity overhead end to end on both trees
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/odw; rm -rf $O; mkdir -p $O/old
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|wrong|board_lane_cost|plain_lane_us|sample|full" $O/$tag.log | cut -c1-400 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
go fused 150 .gpu_dig python3 scripts/gpu_fused_digest_check.py --out $O
go waves 150 .gpu_dig python3 scripts/digest_waves.py $O/waves.json
go fused_old 150 .gpu_fin python3 scripts/gpu_fused_digest_check.py --out $O/old
go io 170 .gpu_dig python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --layer-gap --out $O/io.json
go io_old 170 .gpu_fin python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --layer-gap --out $O/old/io.json
