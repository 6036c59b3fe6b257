#!/bin/bash
# where a 70B READ's host time goes now (perf_counter stamps, stamp_tree5.py.txt on this tree:
# .gpu_st), and the integrity bench on the same tree unstamped (.gpu_new)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ost; rm -rf $O; mkdir -p $O
R=bench/results/gpu_stamps_head/stamps_report3.py.txt
(cd .gpu_st && PYTHONPATH=/tmp/site:$PWD KVST_NOEV=1 KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
for f in $O/st.*.json; do python3 $R $f > $f.txt 2>&1; done; sed -n '1,32p' $O/st.*.txt | cut -c1-60
tar czf $OUT/results.tgz -C $O .
(cd .gpu_new && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 80 --layer-gap --out $O/io.json > $O/io.log 2>&1; echo "io rc=$?"); grep -E "overhead|fault at" $O/io.log | cut -c1-250
tar czf $OUT/results.tgz -C $O .
