"""Daemon CPU per get on a 2-worker daemon (issue 29, workers on the C path), 2026-12-06.

Run with the Python of the build to measure (`<checkout>/.venv/bin/python workers-cpu.py
OUT.json`). One client `get_into`s 64 KiB and 2 MiB DRAM hits, keys of both shards, from a
2-worker daemon and from a 1-worker daemon, then the raw socket server (bench net's
reference) serves as many gets of each size: the CPU of every daemon process (supervisor and
workers, /proc, clock ticks) and of the raw server, divided by the gets. Prints and writes
JSON with the load average (`os.getloadavg`) before and after.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

import kvoffload
from kvoffload.bench.common import cpu_seconds, daemon
from kvoffload.bench.micro.net_mc import _children
from kvoffload.bench.micro.raw_socket import raw_reference
from kvoffload.client_sdk import Client

SIZES = {"64KiB": (64 << 10, 10000), "2MiB": (2 << 20, 1500)}  # bytes, gets


def _daemon_cpu(workers: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, daemon("256MiB", tmp, workers) as (url, pid):
        procs = [pid, *_children(pid)] if workers > 1 else [pid]
        with Client.connect(url) as client:
            for name, (size, gets) in SIZES.items():
                keys = [bytes([len(name)]) + i.to_bytes(15, "big") for i in range(16)]
                value = np.frombuffer(os.urandom(size), dtype=np.uint8)
                buf = np.empty(size, dtype=np.uint8)
                for key in keys:
                    client.put(key, value)
                for key in keys:
                    client.get_into(key, buf)  # warm
                before = sum(cpu_seconds(p) for p in procs)
                t0 = time.perf_counter()
                for i in range(gets):
                    client.get_into(keys[i % len(keys)], buf)
                wall = time.perf_counter() - t0
                out[f"cpu_us/{name}"] = (sum(cpu_seconds(p) for p in procs) - before) / gets * 1e6
                out[f"wall_us/{name}"] = wall / gets * 1e6
            server = client.stats().store["server"]
            out["hot_reader_requests"] = float(server.get("hot_reader_requests", 0))  # type: ignore[union-attr]
    return out


def _raw_cpu() -> dict[str, float]:
    out: dict[str, float] = {}
    with raw_reference(2 << 20, 1) as raw:
        assert raw.server_pid is not None
        for name, (size, gets) in SIZES.items():
            raw.get(size)
            before = cpu_seconds(raw.server_pid)
            for _ in range(gets):
                raw.get(size)
            out[f"cpu_us/{name}"] = (cpu_seconds(raw.server_pid) - before) / gets * 1e6
    return out


def main() -> None:
    load0 = os.getloadavg()
    result = {
        "build": os.path.dirname(os.path.dirname(kvoffload.__file__)),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workers_2": _daemon_cpu(2),
        "workers_1": _daemon_cpu(1),
        "raw_socket": _raw_cpu(),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
