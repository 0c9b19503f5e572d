#!/bin/bash
# bench trace --url against a daemon on the C core and one on the pure-Python path, per policy
cd /tmp/tr
port=17720
for policy in lru s3fifo prefix; do
  for core in c python; do
    port=$((port+1))
    env=(KVOFFLOAD_DRAM__POLICY=$policy)
    [ $core = python ] && env+=(KVOFFLOAD_PURE_PYTHON=1) || env+=(KVOFFLOAD_REQUIRE_EXT=1)
    env "${env[@]}" /work/main/.venv/bin/kvoffload serve --port $port --nvme-port 0 --metrics-port 0 --dram 12MiB --ssd 0 --data-dir /tmp/tr/d-$policy-$core > srv-$policy-$core.log 2>&1 &
    pid=$!
    sleep 4
    nice /work/main/.venv/bin/kvoffload bench trace --sessions 40 --model smollm2-135m --url kv://127.0.0.1:$port --peers '' --json url-$policy-$core.json > url-$policy-$core.txt 2>&1
    echo "$policy $core rc=$?"
    kill -INT $pid; wait $pid
    grep -m1 -o '"core": "[a-z]*"' srv-$policy-$core.log
  done
done
