"""`kvoffload bench ssd`'s restart_serve rows: a real `kvoffload serve --events` on a store of
blocks with metadata, timed until it serves (CPU seconds from /proc) and until it has
announced the store (its announce thread's log line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from kvoffload.bench.common import Row, daemon_ports, stop_process

__all__ = ["serve_rows"]


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_ANNOUNCED = re.compile(r"announced (\d+) stored blocks: ([\d.]+) s, ([\d.]+) CPU-s")


def serve_rows(store: Path, capacity: int, label: str) -> list[Row]:
    """`kvoffload serve` on the store with events on: CPU seconds of the process (Python
    start-up and imports included) when it prints ``ready``, and the announce thread's."""
    cmd = [sys.executable, "-m", "kvoffload.cli", "serve", "--data-dir", str(store),
           "--ssd", str(capacity), "--dram", "64MiB", "--port", "0", "--metrics-port", "0",
           "--nvme-port", "0", "--events", "tcp://127.0.0.1:*", "--log-level", "info"]  # fmt: skip
    err = store.parent / "serve.err"
    t0 = time.perf_counter()
    with open(err, "w") as err_file:
        env = {**os.environ, "KVOFFLOAD_DRAM__MAX_VALUE_BYTES": "65536"}  # the store's slots
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
        try:
            daemon_ports(proc, err)
            ready, ready_cpu = time.perf_counter() - t0, _proc_cpu(proc.pid)
            found = None
            for _ in range(1200):  # the announce's log line, at most 10 minutes
                found = _ANNOUNCED.search(err.read_text())
                if found or proc.poll() is not None:
                    break
                time.sleep(0.5)
        finally:
            stop_process(proc)
    rows = [
        Row(f"restart_serve/{label}", ready_cpu, "s", "goal_5s", 5.0,
            note=f"CPU s of `kvoffload serve --events` until it prints ready (wall {ready:.2f} "
            "s), Python start-up and imports included")
    ]  # fmt: skip
    if found:
        rows.append(
            Row(f"restart_serve_announce/{label}", float(found.group(3)), "s", "before", 10.29,
                note=f"CPU s of the daemon's announce thread, while serving ({found.group(1)} "
                f"blocks, wall {float(found.group(2)):.2f} s); before = 2026-12-02")
        )  # fmt: skip
    return rows
