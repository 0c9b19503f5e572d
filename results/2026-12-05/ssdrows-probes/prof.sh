#!/bin/bash
# Profile lmcache-mp's local:// load phase (worst-missing row): py-spy of all threads, then cProfile counts.
# py-spy: pip install --target /tmp/ssdrows/pyspy py-spy (0.4.3). Outputs go to /tmp/ssdrows/prof.
set -u
PY=/work/wt-ssdrows/.venv-lmcache/bin/python
W=/var/tmp/ssdrows-prof; rm -rf $W; mkdir -p $W
O=/tmp/ssdrows/prof
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
cfg() { echo "{\"size\": 2097152, \"keys\": 8, \"in_flight\": 4, \"rounds\": 4, \"phase\": \"$1\", \"spec\": $2}"; }
OURS='{"type": "plugin", "module_path": "kvoffload.connectors.lmcache_mp", "class_name": "KVOffloadL2Adapter", "adapter_params": {"url": "local://'$W'/kvoffload?dram=64MiB&max_value=4MiB&ssd=448MiB&admit=1"}}'
FS='{"type": "fs", "base_path": "'$W'/fs"}'
cd /work/wt-ssdrows
uptime > $O/uptime.txt
$PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg store "$OURS")" > $O/ours-store.json 2>/dev/null
$PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg store "$FS")" > $O/fs-store.json 2>/dev/null
/tmp/ssdrows/pyspy/bin/py-spy record -r 200 -f raw -o $O/ours-load.spy -- $PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg load "$OURS")" > $O/ours-load-spy.json 2>$O/ours-load-spy.err
/tmp/ssdrows/pyspy/bin/py-spy record -r 200 -f raw -o $O/fs-load.spy -- $PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg load "$FS")" > $O/fs-load-spy.json 2>$O/fs-load-spy.err
strace -f -c -o $O/ours-load.strace $PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg load "$OURS")" > $O/ours-load-strace.json 2>/dev/null
strace -f -c -o $O/fs-load.strace $PY -m kvoffload.bench.peers.lmcache_mp --drive "$(cfg load "$FS")" > $O/fs-load-strace.json 2>/dev/null
$PY "$(dirname "$0")"/prof_drive.py "$(cfg load "$OURS")" $O/ours-load.prof > $O/ours-load-cprof.json 2>$O/ours-load-cprof.txt
uptime >> $O/uptime.txt
rm -rf $W
