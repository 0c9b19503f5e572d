#!/bin/bash
# A/B: main's build (/work/main/.venv, main's tree) against ssdsmall's, alternating.
out=/work/wt-ssdsmall/results/2026-12-06
for pair in 1 2; do  # run twice: pairs 1-2, then 3-4
  for arm in before after; do
    if [ $arm = before ]; then py=/work/main/.venv/bin/kvoffload; else py=/work/wt-ssdsmall/.venv/bin/kvoffload; fi
    echo "$arm $pair start $(date -u +%T) $(cat /proc/loadavg)"
    (cd /tmp && nice -n 5 $py bench ssd --batch only --nixl off --restart off --write off --batch-sizes 640KiB,160KiB --size 128 --rounds 3 --entries 0 --dir /var/tmp/ssdsmall-b --json $out/bench-ssd-2026-12-06-ssdsmall-$arm-$pair.json > /tmp/ssdsmall/$arm-$pair.log 2>&1)
    echo "$arm $pair end $(date -u +%T) $(cat /proc/loadavg) rc=$?"
  done
done
