#!/bin/bash
# alternate unpinned / pinned launch --check --transport $1 --mode push, N rounds
# (as run at 523a689; _unpinned.py was launch.py without its pinning, made with
#  sed 's/        if args.device == "cpu" and args.tp == 1:  # a core each (where there are as many)/        if False:/' \
#      examples/vllm_pd/launch.py > examples/vllm_pd/_unpinned.py )
cd /work/main
for i in $(seq 1 $2); do
  for v in unpinned pinned; do
    f=examples/vllm_pd/launch.py; [ $v = unpinned ] && f=examples/vllm_pd/_unpinned.py
    D=/tmp/ab_${1}_${v}_$i; rm -rf $D; mkdir -p $D
    t0=$(date +%s)
    timeout 400 .venv/bin/python $f --check --transport $1 --mode push --prefill-port 18100 --decode-port 18200 --side-port 18600 --logs $D > $D/out.txt 2>&1
    rc=$?
    echo "$1 $v round $i rc=$rc $(( $(date +%s) - t0 )) s $(grep -c '==' $D/out.txt) equal; $(grep -h 'did not complete\|no status frame' $D/*.log | head -1 | cut -c1-120)"
  done
done
