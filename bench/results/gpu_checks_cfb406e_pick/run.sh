#!/bin/bash
# final: sample picked by the kernel, full without the row read (cfb406e) vs b7d16f1: fused check, integrity bench alternating
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1
O=/tmp/ob; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$?"; grep -E "^(70b|8b| 8b)|Error|Traceback|FAIL|overhead|fault at|'ok'|\"ok\"|wrong|passed|board_lane" $O/$tag.log | cut -c1-500 | tail -8; el
  tar czf $OUT/results.tgz -C $O .
}
go fused 150 . python3 scripts/gpu_fused_digest_check.py --out $O
go io_new1 120 . python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_new1.json
go io_prev1 120 .gpu_prev2 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_prev1.json
go io_new2 120 . python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io_new2.json
