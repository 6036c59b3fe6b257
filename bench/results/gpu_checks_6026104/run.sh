#!/bin/bash
# NIXL transport check prepped at 4 MiB; public API READ vs WRITE again; e2e cuda_ipc 70B and 8B at HEAD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|8b|4mib|4MiB)|READ time|kvlink [+-]|Error|Traceback|FAIL|MET" $O/$tag.log | cut -c1-330 | tail -14; el
  tar czf $OUT/results.tgz -C $O .
}
go ab_search_gap 150 python3 bench/ab_trees.py --a .gpu_old --b . --label-a scan-28f46e3 --label-b search --device cuda --spin --case 70b-tp8 --requests 150 --layer-gap --out $O/ab_search_gap.json
go e2e_cuda_ipc_gap 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8,8b-tp1 --requests 40 --inflight-rounds 2 --layer-gap --out $O/e2e_cuda_ipc_gap.json
go nixl_check 150 python3 scripts/gpu_nixl_check.py --memory vram --reps 20 --out $O
go e2e_nixl_4mib_both 150 python3 bench/e2e_request.py --device cuda --transport nixl --op both --requests 20 --inflight-rounds 2 --transport-option prep_block_bytes=4194304 --cases 4mib-pages --out $O/e2e_nixl_4mib_both.json
