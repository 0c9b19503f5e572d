#!/bin/sh
# main's build vs lookup's, alternating, same machine: 4 rounds x 3,000 lookups of 1,000 keys.
# Each run starts its own daemon from the same tree (bench.common.daemon uses sys.executable).
set -e
R=results/2026-12-06
for i in 1 2 3 4; do
  (cd /tmp && /work/main/.venv/bin/python /work/wt-lookup/$R/lookup_prof.py time 3000 /work/wt-lookup/$R/lookup_main_$i.json) 2>/dev/null
  .venv/bin/python $R/lookup_prof.py time 3000 $R/lookup_branch_$i.json 2>/dev/null
done
