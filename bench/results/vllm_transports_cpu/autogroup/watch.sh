#!/bin/bash
D=$1
for i in $(seq 1 1200); do grep -qh "peers.py:191" $D/decode.log 2>/dev/null && break; sleep 0.25; done
sleep 4
for round in 1 2; do
  date +%T.%N > $D/dbg_$round.txt
  for pid in $(ps -eo pid,comm | awk '/VLLM|python|pt_main/{print $1}'); do echo "== $pid $(cat /proc/$pid/comm) $(cat /proc/$pid/autogroup)"; done >> $D/dbg_$round.txt
  cat /sys/kernel/debug/sched/debug >> $D/dbg_$round.txt
  sleep 6
done
