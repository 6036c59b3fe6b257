#!/bin/bash
# stamps along a lane READ (.gpu_a = this tree with .exp/stamp_tree.py's stamps); integrity overhead with lanes per level
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 PYTHONPATH=/tmp/site
O=/tmp/o30; rm -rf $O; mkdir -p $O
T0=$(date +%s)
el() { echo "   [$(( $(date +%s) - T0 )) s]"; }
(cd .gpu_a && PYTHONPATH=/tmp/site:$PWD KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 100 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e.log 2>&1; echo "stamped rc=$?")
grep -E "^70b|wait=" $O/e2e.log; el
tar czf $OUT/results.tgz -C $O .
export PYTHONPATH=/tmp/site:$PWD
#timeout 120 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --layer-gap --out $O/io_gap.json > $O/io_gap.log 2>&1; echo "io rc=$?"
grep -E "phases|overhead|fault at|goals" $O/io_gap.log | cut -c1-250; el
tar czf $OUT/results.tgz -C $O .
