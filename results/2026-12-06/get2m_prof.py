"""A 2 MiB get_into over kv:// against a fresh loopback daemon: client CPU per get, cProfile
of 300 gets (the Python calls per get), or a pause for strace -c (mode strace)."""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import numpy as np

from kvoffload.bench.common import cpu_seconds, daemon
from kvoffload.client_sdk import Client


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    size = 2 << 20
    keys = [i.to_bytes(16, "big") for i in range(16)]
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    with (
        tempfile.TemporaryDirectory() as tmp,
        daemon("256M", tmp) as (url, pid),
        Client.connect(url) as client,
    ):
        for k in keys:
            client.put(k, value)
        for k in keys * 3:
            assert client.get_into(k, out) == size
        if mode == "cprofile":
            prof = cProfile.Profile()
            prof.enable()
            for i in range(n):
                client.get_into(keys[i % 16], out)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
            return
        if mode == "strace":
            print("pid", pid, "self", os.getpid(), flush=True)
            sys.stdin.readline()
            for i in range(n):
                client.get_into(keys[i % 16], out)
            print("done", flush=True)
            sys.stdin.readline()
            return
        d0, c0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
        for i in range(n):
            client.get_into(keys[i % 16], out)
        t1, c1, d1 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
        res = {
            "gets": n,
            "bytes": size,
            "wall_us_per_get": (t1 - t0) / n * 1e6,
            "client_cpu_us_per_get": (c1 - c0) / n * 1e6,
            "daemon_cpu_us_per_get": (d1 - d0) / n * 1e6,
            "loadavg": os.getloadavg(),
            "tree": os.path.dirname(os.path.dirname(__import__("kvoffload").__file__)),
        }
        print(json.dumps(res))
        if len(sys.argv) > 3:
            with open(sys.argv[3], "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
