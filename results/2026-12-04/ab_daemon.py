"""Old tree against new tree, alternating: daemon CPU per get (64 KiB, 2 MiB) over kv://.

Usage: python ab_daemon.py OLD_TREE NEW_TREE ROUNDS OUT.json
Each round starts each tree's own `kvoffload serve` (its own venv) and drives it with that tree's
client in a subprocess: put the keys, then time `get_into` loops while reading the daemon's CPU
(utime+stime of all its threads, /proc/<pid>/stat) before and after.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

CLIENT = r"""
import os, sys, time
from kvoffload.client_sdk import Client
pid, port, size, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def cpu():
    f = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c = Client.connect(f"kv://127.0.0.1:{port}")
keys = [i.to_bytes(16, "big") for i in range(16)]
val = os.urandom(size)
for k in keys:
    c.put(k, val)
buf = bytearray(size)
for k in keys:  # warm
    assert c.get_into(k, buf) == size
c0, t0 = cpu(), time.perf_counter()
for i in range(n):
    c.get_into(keys[i % 16], buf)
c1, t1 = cpu(), time.perf_counter()
print(f"{(c1 - c0) / n * 1e6:.2f} {(t1 - t0) / n * 1e6:.2f}")
c.close()
"""
LISTEN = re.compile(r"kvoffload: (\w+) listening on (\S+):(\d+)")


def one(tree, size, n):
    py = os.path.join(tree, ".venv/bin/python")
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        d = subprocess.Popen(
            [
                py,
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
                "256MiB",
                "--ssd",
                "0",
                "--data-dir",
                tmp,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp,
        )
        port = None
        for line in d.stdout:
            m = LISTEN.match(line.strip())
            if m and m.group(1) == "native":
                port = int(m.group(3))
            if line.strip() == "kvoffload: ready":
                break
        try:
            out = subprocess.run(
                [py, "-c", CLIENT, str(d.pid), str(port), str(size), str(n)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp,
                timeout=600,
            )
            assert out.returncode == 0, out.stderr
            cpu_us, wall_us = map(float, out.stdout.split())
        finally:
            d.terminate()
            d.wait(30)
    return cpu_us, wall_us


def main():
    old, new, rounds, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    cases = [
        (64 << 10, int(os.environ.get("AB_N64", 20000))),
        (2 << 20, int(os.environ.get("AB_N2M", 2000))),
    ]
    rows = []
    for r in range(rounds):
        for name, tree in (
            [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
        ):
            for size, n in cases:
                cpu_us, wall_us = one(tree, size, n)
                rows.append(
                    {
                        "round": r,
                        "tree": name,
                        "size": size,
                        "gets": n,
                        "daemon_cpu_us_per_get": cpu_us,
                        "client_wall_us_per_get": wall_us,
                        "loadavg": os.getloadavg()[0],
                    }
                )
                print(rows[-1], flush=True)
    summary = {}
    for size, _ in cases:
        for name in ("old", "new"):
            v = sorted(
                x["daemon_cpu_us_per_get"] for x in rows if x["tree"] == name and x["size"] == size
            )
            summary[f"{name}/{size}"] = {"median": v[len(v) // 2], "all": v}
        summary[f"new_over_old/{size}"] = (
            summary[f"new/{size}"]["median"] / summary[f"old/{size}"]["median"]
        )
    out = {
        "what": "daemon CPU per get over kv:// (get_into), old tree vs new tree, alternating",
        "old": subprocess.run(
            ["git", "-C", old, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "new": subprocess.run(
            ["git", "-C", new, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": "shared 2-vCPU Intel Xeon VM, Python 3.11.7, no GPU",
        "rows": rows,
        "summary": summary,
    }
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(summary, indent=1))


main()
