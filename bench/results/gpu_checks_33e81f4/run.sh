#!/bin/bash
# digest kernel (fused check, integrity checks, io); doctor with the final parser; NIXL READ vs WRITE (spin timing, 70B public API); e2e 70B cuda_ipc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site:$PWD
O=/tmp/o; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
go() {  # tag limit cmd...
  local tag=$1 lim=$2; shift 2
  timeout $lim "$@" > $O/$tag.log 2>&1; echo "== $tag rc=$?"; grep -E "^(70b|4mib|4MiB)|READ time|kvlink [+-]|Error|Traceback|FAIL|wrong|_us|b vs a|overhead|MET|ok" $O/$tag.log | cut -c1-330 | tail -12; el
  tar czf $OUT/results.tgz -C $O .
}
go fused 90 python3 scripts/gpu_fused_digest_check.py --out $O
go integrity 90 python3 scripts/gpu_integrity_check.py --out $O/gpu_integrity_check.json
go landing 60 python3 scripts/gpu_landing_check.py --out $O
go stream_order 90 python3 scripts/gpu_stream_order_check.py --out $O
timeout 120 python3 -c 'import sys; from kvlink.cli import main; sys.argv=["kvlink","doctor"]; sys.exit(main())' > $O/doctor-gpu.txt 2>$O/doctor-gpu.err; echo "== doctor rc=$?"; grep -A4 "measured NIXL VRAM" $O/doctor-gpu.txt; grep -A5 "^transports" $O/doctor-gpu.txt; el
tar czf $OUT/results.tgz -C $O .
go io 120 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --out $O/io.json
go nixl_check 120 python3 scripts/gpu_nixl_check.py --memory vram --reps 20 --out $O
go e2e_cuda_ipc_70b 100 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 40 --inflight-rounds 2 --out $O/e2e_cuda_ipc_70b.json
go e2e_nixl_70b_both 120 python3 bench/e2e_request.py --device cuda --transport nixl --op both --requests 6 --inflight-rounds 1 --cases 70b-tp8 --out $O/e2e_nixl_70b_both.json
