#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ost; rm -rf $O; mkdir -p $O
(cd .gpu_st && PYTHONPATH=/tmp/site:$PWD KVST_NOEV=1 KVST_OUT=$O/st timeout 150 python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 100 --inflight-rounds 4 --layer-gap --out $O/e2e_stamped.json > $O/e2e_stamped.log 2>&1; echo "stamped rc=$?")
for f in $O/st.*.json; do python3 .gpu_st/report.py $f > $f.txt 2>&1; done; grep -E "^ *70b" $O/e2e_stamped.log; cat $O/st.*.json.txt | head -48 | cut -c1-70
tar czf $OUT/results.tgz -C $O .
