#!/bin/bash
# lanes probe + doctor; kernel region search (checks, A/B vs 28f46e3); pending checks of b7de42c/f91bf28;
# NIXL READ vs WRITE paired (transport and public API); integrity overhead
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O/staging $O/staging_order
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|4mib)|READ time|kvlink [+-]|Error|Traceback|FAIL|wrong|refused|_us|b vs a|median" $O/$tag.log | cut -c1-400 | tail -12; el
  tar czf $OUT/results.tgz -C $O .
}
go probe_dump 100 python3 .exp/probe_dump.py $O/proto_info_vram.txt
timeout 120 python3 -c 'import sys; from kvlink.cli import main; sys.argv=["kvlink","doctor"]; sys.exit(main())' > $O/doctor-gpu.txt 2>$O/doctor-gpu.err; echo "== doctor rc=$?"; grep -A4 "measured NIXL VRAM" $O/doctor-gpu.txt; el
go fused 90 python3 scripts/gpu_fused_digest_check.py --out $O
go kernel 60 python3 scripts/gpu_kernel_check.py --out $O
go runs 60 python3 scripts/gpu_runs_check.py --out $O
go cuda_ipc 90 python3 scripts/gpu_cuda_ipc_check.py --out $O --reps 2
go staging 60 python3 scripts/gpu_staging_check.py --out $O/staging --gib 0.5 --reps 2
go staging_order 60 python3 scripts/gpu_staging_check.py --out $O/staging_order --gib 0.5 --reps 2 --stream-order
go ab_search 120 python3 bench/ab_trees.py --a .gpu_old --b . --label-a scan-28f46e3 --label-b search --device cuda --spin --case 70b-tp8 --requests 150 --out $O/ab_search.json
go nixl_check 120 python3 scripts/gpu_nixl_check.py --memory vram --reps 20 --out $O
go e2e_nixl_4mib_both 100 python3 bench/e2e_request.py --device cuda --transport nixl --op both --requests 20 --inflight-rounds 2 --transport-option prep_block_bytes=4194304 --cases 4mib-pages --out $O/e2e_nixl_4mib_both.json
go io 100 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 60 --out $O/io.json
