#!/bin/bash
# CPU per cold 160 KiB block (get_many_into of 32, io_uring, depth 8), main vs branch, alternating.
for i in 1 2 3; do
  for arm in main branch; do
    if [ $arm = main ]; then d=/tmp/ssdsmall/main; py=/work/main/.venv/bin/python; else d=/work/wt-ssdsmall; py=/work/wt-ssdsmall/.venv/bin/python; fi
    echo "$arm $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $d && nice -n 5 $py /tmp/ssdsmall/prof.py /var/tmp/ssdsmall-a 10,40 noprof 2>&1 | tail -2)
  done
done
for arm in main branch; do
  if [ $arm = main ]; then d=/tmp/ssdsmall/main; py=/work/main/.venv/bin/python; else d=/work/wt-ssdsmall; py=/work/wt-ssdsmall/.venv/bin/python; fi
  echo "$arm prof $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $d && nice -n 5 $py /tmp/ssdsmall/prof.py /var/tmp/ssdsmall-a 10,40 prof 2>&1 | grep -B2 -A40 "python calls")
done
