#!/bin/bash
export KVOFFLOAD_LMCACHE_PYTHON=/work/main/.venv-lmcache/bin/python
R=/tmp/pinab; mkdir -p $R
for i in 1 2; do
  (cd /work/main && echo "main-$i $(date -u +%T) $(uptime)" >> $R/log && nice -n 5 /work/main/.venv/bin/python -m kvoffload.cli bench lmcache-mp --trials 5 --json $R/bench-lmcache-mp-pinbudget-main-$i.json > $R/main-$i.out 2>&1)
  (cd /work/wt-pinbudget && echo "branch-share1-$i $(date -u +%T) $(uptime)" >> $R/log && KVOFFLOAD_NATIVE__ANSWER_PIN_SHARE=1.0 nice -n 5 .venv/bin/python -m kvoffload.cli bench lmcache-mp --trials 5 --json $R/bench-lmcache-mp-pinbudget-branch-share1-$i.json > $R/branch-$i.out 2>&1)
done
echo "done $(date -u +%T) $(uptime)" >> $R/log
