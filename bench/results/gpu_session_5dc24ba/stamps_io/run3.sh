#!/bin/bash
# integrity levels stamped (.gpu_s: 5dc24ba + stamps), then HEAD's integrity_overhead unstamped
set -u
G=$(cd "$(dirname "$0")/.." && pwd); S=$G/../.gpu_s
R=/tmp/res7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/../.whl2/*.whl $G/../.whl3/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 KVLINK_CACHE_DIR=/tmp/kvc
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
(cd $S && PYTHONPATH=/tmp/site:$S KVST_OUT=$R/st_io KVLINK_COMMIT=stamped timeout 200 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 200 --layer-gap --out $R/io_st.json > $R/io_st.log 2>&1; echo "io stamped rc=$?")
grep -E "overhead|on the device|phases" $R/io_st.log
python3 $G/probe/stamp_levels.py $R/st_io.*.json 2>&1 | tail -32
tar czf $OUT/results.tgz -C $R .
(cd $G && PYTHONPATH=/tmp/site:$G KVLINK_COMMIT=5dc24ba timeout 240 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 400 --layer-gap --out $R/io400.json > $R/io.log 2>&1; echo "io rc=$?")
tail -14 $R/io.log
tar czf $OUT/results.tgz -C $R .
