#!/bin/bash
# both servers bound to CPU 0 with one OpenMP thread each (as run at e97f80f): _core0.py was launch.py with
#   sed 's/            cmd, env = pinned(index, cmd, env)/            env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}/' examples/vllm_pd/launch.py > examples/vllm_pd/_core0.py
cd /work/main
for i in 1 2 3; do
  D=/tmp/c0_$1_$i; rm -rf $D; mkdir -p $D; t0=$(date +%s)
  timeout 300 .venv/bin/python examples/vllm_pd/_core0.py --check --transport $1 --mode push --prefill-port 18100 --decode-port 18200 --side-port 18600 --logs $D > $D/out.txt 2>&1
  echo "$1 core0-1thread round $i rc=$? $(( $(date +%s) - t0 )) s $(grep -c '==' $D/out.txt) equal; $(grep -h 'OMP_NUM_THREADS=\|Torch threads' $D/*.log | head -1 | cut -c60-140); $(grep -h 'did not complete\|no status frame\|did not write' $D/*.log | head -1 | cut -c1-100)"
done
