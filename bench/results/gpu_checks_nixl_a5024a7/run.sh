#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O
N="--device cuda --transport nixl --op both --requests 30 --inflight-rounds 3 --transport-option prep_block_bytes=4194304 --cases 4mib-pages"
run() {
  local tree=$1 tag=$2; shift 2
  local pp=/tmp/site:$PWD; [ "$tree" = old ] && pp=/tmp/site:$PWD/.gpu_old
  PYTHONPATH=$pp timeout 140 python3 bench/e2e_request.py "$@" --out $O/$tag.$tree.json > $O/$tag.$tree.log 2>&1; echo "== $tree $tag rc=$?"
  grep -E "^4mib|wait=|Error|Traceback" $O/$tag.$tree.log
}
run new e2e_nixl_4mibpages_both_1 $N
run old e2e_nixl_4mibpages_both_1 $N
run new e2e_nixl_4mibpages_both_2 $N
run old e2e_nixl_4mibpages_both_2 $N
tar czf $OUT/results.tgz -C $O .
