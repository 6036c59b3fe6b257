#!/bin/bash
# $1 commit: the 70B request with the consumer's cyclic GC on (as shipped) and off (gc.disable() before the bench runs), alternated
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/msgspec*.whl || exit 1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=$1 KVLINK_CACHE_DIR=/tmp/kvc
O=/tmp/ogc; rm -rf $O; mkdir -p $O
cd .gpu_f
for i in 1 2 3; do
  for m in on off; do
    if [ $m = on ]; then pre="import runpy, sys"; else pre="import gc, runpy, sys; gc.disable()"; fi
    PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -c "$pre; sys.argv = ['bench/e2e_request.py'] + sys.argv[1:]; sys.path.insert(0, 'bench'); runpy.run_path('bench/e2e_request.py', run_name='__main__')" --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 3 --layer-gap --out $O/gc_${m}_$i.json > $O/gc_${m}_$i.log 2>&1
    echo "$m $i rc=$? $(grep -E '^ *70b-tp8 +(sleep|spin) ' $O/gc_${m}_$i.log | awk '{print $2, $5}' | tr '\n' ' ')"
  done
done
tar czf $OUT/results.tgz -C $O .
