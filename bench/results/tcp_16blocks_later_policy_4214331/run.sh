#!/bin/bash
for i in 1 2 3; do
 for t in old new; do
  R=/tmp/${t}tree
  (cd $R && timeout 400 /work/main/.venv/bin/python bench/e2e_request.py --cases 16-blocks --requests 40 --inflight-rounds 2 --out /tmp/ab3_$t$i.json > /tmp/ab3_$t$i.log 2>&1)
  echo "$t$i rc=$?"; grep -E "^16-blocks" /tmp/ab3_$t$i.log
 done
done
