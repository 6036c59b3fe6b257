#!/bin/bash
cd /work/main
for i in 1 2; do
 for t in old new; do
  if [ $t = old ]; then R=/tmp/oldtree; else R=/work/main; fi
  (cd $R && timeout 400 /work/main/.venv/bin/python bench/e2e_request.py --cases 16-blocks --requests 40 --inflight-rounds 2 --out /tmp/ab_$t$i.json > /tmp/ab_$t$i.log 2>&1)
  echo "$t$i rc=$?"; grep -E "^16-blocks" /tmp/ab_$t$i.log
 done
done
