"""Daemon CPU per 1 KiB request, puts only and puts and gets alternating, main (old) against
creader (new) alternating: what arming the C reader and handing it back costs a put."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon import start

CLIENT = r"""
import os, sys
from kvoffload.client_sdk import Client
pid, port, n, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def cpu():
    f = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    t = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / t
c = Client.connect(f"kv://127.0.0.1:{port}")
keys = [i.to_bytes(16, "big") for i in range(16)]
val = os.urandom(1024)
for k in keys: c.put(k, val)
c0 = cpu()
for i in range(n):
    if mode == "puts" or i % 2: c.put(keys[i % 16], val)
    else: c.get(keys[i % 16])
print(f"{(cpu() - c0) / n * 1e6:.1f}")
"""
env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
rows = []
for r in range(2):
    for name, tree in (
        (("old", "/work/main"), ("new", "/work/wt-creader"))
        if r % 2 == 0
        else (("new", "/work/wt-creader"), ("old", "/work/main"))
    ):
        for mode in ("puts", "mixed"):
            py = tree + "/.venv/bin/python"
            with tempfile.TemporaryDirectory() as tmp:
                d, port = start(py, tmp, env, "256MiB")
                out = subprocess.run(
                    [py, "-c", CLIENT, str(d.pid), str(port), "10000", mode],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                d.terminate()
                d.wait(30)
                rows.append(
                    {
                        "round": r,
                        "tree": name,
                        "mode": mode,
                        "daemon_cpu_us_per_request": float(out.stdout),
                        "loadavg": os.getloadavg()[0],
                    }
                )
                print(rows[-1], flush=True)
WHAT = "daemon CPU per 1 KiB request: puts only, and put/get alternating, 10,000 requests"
Path(sys.argv[1]).write_text(
    json.dumps(
        {"what": WHAT, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
        indent=1,
    )
)
