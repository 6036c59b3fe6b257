#!/bin/bash
# .gpu_ord (1a909bf): the 70B integrity overhead with --profile (cProfile per level, only
# around its timed requests): what each level adds to a request, function by function
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/opr; rm -rf $O; mkdir -p $O
(cd .gpu_ord && PYTHONPATH=/tmp/site:$PWD timeout 400 python3 bench/integrity_overhead.py --device cuda --spin --cases 70b-tp8 --requests 100 --layer-gap --profile $O/io_prof --out $O/io_prof.json > $O/io_prof.log 2>&1); echo "rc=$?"
grep -E "overhead|phases|profile" $O/io_prof.log | cut -c1-250
tar czf $OUT/results.tgz -C $O .
