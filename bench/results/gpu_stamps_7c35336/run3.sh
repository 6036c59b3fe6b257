#!/bin/bash
# start 3 (slow host): stamps + timing events around the launcher's call (KVST_EV=1): when the
# end word was written, on the host's clock
set -u
G=$(cd "$(dirname "$0")/.." && pwd); S=$G/../.gpu_s
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl
R=/tmp/res3; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=stamped KVLINK_CACHE_DIR=/tmp/kvc
one() {  # tag case env...
  local tag=$1 c=$2; shift 2
  (cd $S && env "$@" PYTHONPATH=/tmp/site:$S KVST_OUT=$R/st_$tag timeout 150 python3 bench/e2e_request.py --device cuda --cases $c --requests 60 --inflight-rounds 1 --layer-gap --out $R/e2e_$tag.json > $R/e2e_$tag.log 2>&1; echo "== $tag rc=$?")
  grep -E "^ *(70b|8b)-[a-z0-9]+ +(sleep|spin)|expects" $R/e2e_$tag.log
  python3 $G/probe/stamp_read.py $R/st_$tag.*.json 2>&1 | tail -15
}
one ev70 70b-tp8 KVST_EV=1
one ev8 8b-tp1 KVST_EV=1
one noev70 70b-tp8 KVST_EV=
tar czf $OUT/results.tgz -C $R .
