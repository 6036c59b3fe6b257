#!/bin/bash
D=$1
for i in $(seq 1 1200); do grep -qh "peers.py:191" $D/decode.log 2>/dev/null && break; sleep 0.25; done
sleep 3
for round in 1 2 3; do
  date +%T.%N >> $D/ps_$round.txt
  ps -eLo pid,tid,cls,rtprio,ni,pri,psr,stat,pcpu,time,comm >> $D/ps_$round.txt
  for pid in $(ps -eo pid,comm | awk "/VLLM|python|pt_main/{print \$1}"); do
    echo "== $pid $(taskset -p $pid)" >> $D/sched_$round.txt
    for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm|tr ' ' _) $(cat $t/schedstat) $(awk '{print $3}' $t/stat) $(cat $t/wchan) $(taskset -p $(basename $t) | awk '{print $NF}')"; done >> $D/sched_$round.txt
  done
  cat /proc/sched_debug 2>/dev/null | head -400 > $D/sched_debug_$round.txt
  sleep 5
done
echo watched
