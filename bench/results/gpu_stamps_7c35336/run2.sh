#!/bin/bash
# start 2 (fast host): is the host's cold time the CPU's idle states or migration? the
# stamped 70B READs four ways (plain, pinned to two cores, PM QoS 0 us held, both), then plain
set -u
G=$(cd "$(dirname "$0")/.." && pwd); S=$G/../.gpu_s
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/../.whl2/msgspec*.whl
R=/tmp/res2; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | head -20
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1
  for d in /sys/devices/system/cpu/cpu2/cpuidle/state*; do echo "$d $(cat $d/name) lat=$(cat $d/latency) usage=$(cat $d/usage) disable=$(cat $d/disable)"; done 2>&1
  ls -l /dev/cpu_dma_latency 2>&1; cat /proc/cmdline; nproc; } > $R/sys.txt 2>&1
export PYTHONUNBUFFERED=1 KVLINK_COMMIT=stamped KVLINK_CACHE_DIR=/tmp/kvc
one() {  # tag prefix...
  local tag=$1; shift
  (cd $S && PYTHONPATH=/tmp/site:$S KVST_OUT=$R/st_$tag timeout 120 "$@" python3 bench/e2e_request.py --device cuda --cases 70b-tp8 --requests 60 --inflight-rounds 1 --layer-gap --out $R/e2e_$tag.json > $R/e2e_$tag.log 2>&1; echo "== $tag rc=$?")
  grep -E "^ *70b-tp8 +(sleep|spin)" $R/e2e_$tag.log
  python3 $G/probe/stamp_read.py $R/st_$tag.*.json 2>&1 | tail -12
}
one plain
one pinned taskset -c 2,3
python3 -c "
import os,struct,time
fd=os.open('/dev/cpu_dma_latency', os.O_WRONLY); os.write(fd, struct.pack('i',0)); print('pm qos held', flush=True); time.sleep(300)" > $R/qos.txt 2>&1 &
QOS=$!
sleep 1
one qos
one qos_pinned taskset -c 2,3
kill $QOS
one plain2
tar czf $OUT/results.tgz -C $R .
