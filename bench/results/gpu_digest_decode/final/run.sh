python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/odv; rm -rf $O; mkdir -p $O
T0=$(date +%s)
go() {  # tag limit dir cmd...
  local tag=$1 lim=$2 dir=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout $lim "$@" > $O/$tag.log 2>&1); echo "== $tag rc=$? [$(( $(date +%s) - T0 )) s]"; grep -E "^ *(70b|8b)|Error|Traceback|FAIL|VARIANT|'ok': False|mark_|lane_launcher" $O/$tag.log | cut -c1-300 | tail -8
  tar czf $OUT/results.tgz -C $O .
}
go variants 200 .gpu_dig python3 scripts/digest_v.py $O/variants.json
go fused 120 .gpu_dig python3 scripts/gpu_fused_digest_check.py --out $O
go runs 60 .gpu_dig python3 scripts/gpu_runs_check.py --out $O
go io 170 .gpu_dig python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json
