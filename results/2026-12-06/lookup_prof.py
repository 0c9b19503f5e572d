"""Profile / time Client.lookup of 1,000 keys over kv:// against a fresh loopback daemon.

Usage: python lookup_prof.py time N OUT.json   -- p50/p99 wall, client CPU/lookup, daemon CPU/lookup
       python lookup_prof.py cprofile N        -- cProfile of N lookups (client side)
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

from kvoffload.bench.common import cpu_seconds, daemon
from kvoffload.client_sdk import Client


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    keys = [i.to_bytes(16, "big") for i in range(1000)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        daemon("64M", tmp) as (url, pid),
        Client.connect(url) as client,
    ):
        client.put_many([(k, b"x") for k in keys], parents=[None, *keys[:-1]])
        assert client.lookup(keys) == 1000
        for _ in range(50):
            client.lookup(keys)
        if mode == "cprofile":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                client.lookup(keys)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        if mode == "strace":
            print("pid", pid, "self", os.getpid(), flush=True)
            sys.stdin.readline()
            for _ in range(n):
                client.lookup(keys)
            print("done", flush=True)
            sys.stdin.readline()
            return
        samples = []
        d0, c0 = cpu_seconds(pid), time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            client.lookup(keys)
            samples.append((time.perf_counter() - t0) * 1e3)
        c1, d1 = time.process_time(), cpu_seconds(pid)
        samples.sort()
        out = {
            "lookups": n,
            "keys": 1000,
            "p50_ms": statistics.median(samples),
            "p99_ms": samples[min(n - 1, int(n * 0.99))],
            "client_cpu_us_per_lookup": (c1 - c0) / n * 1e6,
            "daemon_cpu_us_per_lookup": (d1 - d0) / n * 1e6,
            "loadavg": os.getloadavg(),
            "pure_python": os.environ.get("KVOFFLOAD_PURE_PYTHON", ""),
            "tree": os.path.dirname(os.path.dirname(__import__("kvoffload").__file__)),
        }
        print(json.dumps(out))
        if len(sys.argv) > 3:
            with open(sys.argv[3], "w") as fh:
                json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
