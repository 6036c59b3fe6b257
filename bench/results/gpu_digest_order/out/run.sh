#!/bin/bash
# .gpu_slot (484188d: the kernel works the sample pick out per unit, segment by segment)
# against .gpu_ord ($1: the launcher picks, the kernel takes the checked blocks first): the
# fused check of each tree in turn, three times; then $1's fused check through ctypes
# (KVLINK_NATIVE=0), lanes, stream order and the 70B integrity overhead
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/oor; rm -rf $O; mkdir -p $O
go() {  # dir tag limit cmd...
  local dir=$1 tag=$2 lim=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "Error|Traceback|FAIL|wrong|'ok': False|overhead|goals" $O/$tag.log | cut -c1-300 | tail -6
  tar czf $OUT/results.tgz -C $O .
}
for i in 1 2 3; do
  mkdir -p $O/old$i $O/new$i
  KVLINK_COMMIT=484188d go .gpu_slot old$i/fused 120 python3 scripts/gpu_fused_digest_check.py --out $O/old$i
  KVLINK_COMMIT=$1 go .gpu_ord new$i/fused 120 python3 scripts/gpu_fused_digest_check.py --out $O/new$i
done
export KVLINK_COMMIT=$1
mkdir -p $O/ctypes
KVLINK_NATIVE=0 go .gpu_ord ctypes/fused 150 python3 scripts/gpu_fused_digest_check.py --out $O/ctypes
go .gpu_ord runs 60 python3 scripts/gpu_runs_check.py --out $O
go .gpu_ord order 90 python3 scripts/gpu_stream_order_check.py --out $O --modes order --timing-reps 0
go .gpu_ord io 400 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 160 --layer-gap --out $O/io.json
