"""Daemon user and system CPU per 64 KiB get (20,000 get_into), old and new tree alternating."""

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
pid, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def cpu():
    f = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    t = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / t, int(f[12]) / t
c = Client.connect(f"kv://127.0.0.1:{port}")
keys = [i.to_bytes(16, "big") for i in range(16)]
val = os.urandom(65536)
for k in keys: c.put(k, val)
buf = bytearray(65536)
for k in keys: c.get_into(k, buf)
(u0, s0) = cpu()
for i in range(n): c.get_into(keys[i % 16], buf)
(u1, s1) = cpu()
print(f"{(u1-u0)/n*1e6:.1f} {(s1-s0)/n*1e6:.1f}")
"""
env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
rows = []
for r in range(3):
    for name, tree in (
        (("old", "/work/main"), ("new", "/work/wt-creader"))
        if r % 2 == 0
        else (("new", "/work/wt-creader"), ("old", "/work/main"))
    ):
        py = tree + "/.venv/bin/python"
        with tempfile.TemporaryDirectory() as tmp:
            d, port = start(py, tmp, env, "256MiB")
            out = subprocess.run(
                [py, "-c", CLIENT, str(d.pid), str(port), "20000"],
                capture_output=True,
                text=True,
                env=env,
            )
            d.terminate()
            d.wait(30)
            u, s = map(float, out.stdout.split())
            rows.append(
                {"round": r, "tree": name, "user_us": u, "sys_us": s, "loadavg": os.getloadavg()[0]}
            )
            print(rows[-1], flush=True)
WHAT = "daemon user/system CPU per 64 KiB get_into (20,000 gets), main (old) vs creader (new)"
Path(sys.argv[1]).write_text(
    json.dumps(
        {"what": WHAT, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
        indent=1,
    )
)
