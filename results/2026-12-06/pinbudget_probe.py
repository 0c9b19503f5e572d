"""Issue 30 probe: one kv:// store + load of `bench lmcache-mp`'s working set, the load
daemon's GetMany counters (answers, cut short, hits read then dropped) and its CPU time.

Usage (from the worktree): .venv/bin/python results/2026-12-06/pinbudget_probe.py SHARE DRAM_MIB
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kvoffload.bench.common import peer_python
from kvoffload.bench.peers import lmcache_mp as b
from kvoffload.client_sdk import Client

MiB = 1 << 20
share, dram = sys.argv[1], int(sys.argv[2])
os.environ["KVOFFLOAD_NATIVE__ANSWER_PIN_SHARE"] = share
python = peer_python("lmcache", None, "KVOFFLOAD_LMCACHE_PYTHON")
drive = {"size": 2 * MiB, "keys": 8, "in_flight": 4, "rounds": 4}
ws = 2 * MiB * 8 * 4 * 4
ssd = ws + ws // 2 + 64 * MiB
work = Path(tempfile.mkdtemp(prefix="pinprobe-", dir="/var/tmp"))


def daemon(home: Path, ssd_bytes: int):  # the bench's daemon, with --dram DRAM_MIB
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def cm():
        home.mkdir(exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "kvoffload.cli",
            "serve",
            "--port",
            "0",
            "--nvme-port",
            "0",
            "--metrics-port",
            "0",
            "--dram",
            f"{dram}MiB",
            "--ssd",
            f"{ssd_bytes >> 20}MiB",
            "--data-dir",
            str(home / "data"),
        ]
        env = {**os.environ, "KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
        err = home / "stderr"
        with err.open("w") as f:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
        try:
            ports = b.daemon_ports(proc, err)
            yield f"kv://127.0.0.1:{ports['native']}?timeout=60", proc
        finally:
            b.stop_process(proc)

    return cm()


def cpu(pid: int) -> int:  # the daemon's user + system clock ticks
    with open(f"/proc/{pid}/stat") as f:
        return sum(int(x) for x in f.read().split()[13:15])


try:
    spec = lambda url: b._ours(url)  # noqa: E731
    with daemon(work, ssd) as (url, _):
        stored = b._drive(python, {**drive, "spec": spec(url), "phase": "store"})
    with daemon(work, ssd) as (url, proc):
        cpu0 = cpu(proc.pid)
        loaded = b._drive(python, {**drive, "spec": spec(url), "phase": "load"})
        cpu1 = cpu(proc.pid)
        with Client.connect(url) as c:
            st = c.stats()
    server = st.store.get("server")
    print(
        json.dumps(
            {
                "share": float(share),
                "dram_mib": dram,
                "uptime": os.getloadavg(),
                "load": loaded,
                "store_gbps": stored.get("gbps"),
                "daemon_cpu_s_load": (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK"),
                "server": {k: v for k, v in dict(server).items() if "get_many" in k}
                if server is not None
                else str(st),
            },
            default=str,
        )
    )
finally:
    shutil.rmtree(work, ignore_errors=True)
