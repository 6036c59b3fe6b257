#!/bin/bash
# .gpu_p3 ($1): the reporting poll steps its parts on the states it asked, the after-check's C
# check bound at the post; the fused digest kernel's per-unit offsets and paired weight loads.
# Against 8b84bfa (.gpu_flat): A/B polled; fused digests checked and timed; integrity; e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/op3; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|b vs a|MET|wrong|_us'|sample|full" $O/$tag.log | cut -c1-300 | tail -9; el
  tar czf $OUT/results.tgz -C $O .
}
mkdir -p $O/old
go fused_old 120 .gpu_flat python3 scripts/gpu_fused_digest_check.py --out $O/old
go fused 120 .gpu_p3 python3 scripts/gpu_fused_digest_check.py --out $O
AB="python3 .gpu_p3/bench/ab_trees.py --device cuda --case 70b-tp8 --layer-gap"
go ab_spin 170 . $AB --a .gpu_flat --b .gpu_p3 --label-a 8b84bfa --label-b poll3 --spin --requests 150 --out $O/ab_spin.json
go io 120 .gpu_p3 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
go e2e 150 .gpu_p3 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 30 --inflight-rounds 2 --layer-gap --out $O/e2e.json
