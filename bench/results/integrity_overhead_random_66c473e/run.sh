#!/bin/bash
# integrity overhead, series in a fresh random order every round (66c473e): HEAD vs 3d34bf2 (.gpu_old, same bench), same start
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/msgspec-*.whl || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
run() {  # where tag script args...
  local where=$1 tag=$2 script=$3; shift 3
  local pp=/tmp/site:$PWD b=bench
  [ "$where" != root ] && pp=/tmp/site:$PWD/$where && b=$where/bench
  PYTHONPATH=$pp timeout 200 python3 $b/$script "$@" --out $O/$tag.json > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|4mib)|phases|Error|Traceback" $O/$tag.log | cut -c1-400; el
}
I="--device cuda --spin --cases 70b-tp8 --requests 100"
run root io_1.new integrity_overhead.py $I
run .gpu_old io_1.old integrity_overhead.py $I
run root io_2.new integrity_overhead.py $I

tar czf $OUT/results.tgz -C $O .
