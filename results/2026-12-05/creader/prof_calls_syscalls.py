"""Python calls per 64 KiB get in the daemon (cProfile, 11,000 minus 1,000 gets) and syscalls
per get (strace -c -f -p over 5,000 gets), for one tree: prof.py TREE OUT.json"""

import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon import start

tree, out = sys.argv[1], sys.argv[2]
py = os.path.join(tree, ".venv/bin/python")
CLIENT = r"""
import sys
from kvoffload.client_sdk import Client
port, n = int(sys.argv[1]), int(sys.argv[2])
c = Client.connect(f"kv://127.0.0.1:{port}")
keys = [i.to_bytes(16, "big") for i in range(16)]
val = bytes(range(256)) * 256
for k in keys:
    c.put(k, val)
buf = bytearray(len(val))
for k in keys:
    c.get_into(k, buf)
sys.stdout.write("go\n"); sys.stdout.flush(); sys.stdin.readline()
for i in range(n):
    c.get_into(keys[i % 16], buf)
sys.stdout.write("done\n"); sys.stdout.flush(); sys.stdin.readline()
c.close()
"""
env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}


def daemon(tmp, profile=None):
    return start(py, tmp, env, "1GiB", profile)


def client(port, n):
    c = subprocess.Popen(
        [py, "-c", CLIENT, str(port), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert c.stdout.readline().strip() == "go"
    return c


def calls(n):
    with tempfile.TemporaryDirectory() as tmp:
        prof = os.path.join(tmp, "d.pstats")
        d, port = daemon(tmp, prof)
        c = client(port, n)
        c.stdin.write("\n")
        c.stdin.flush()
        assert c.stdout.readline().strip() == "done"
        c.stdin.write("\n")
        c.stdin.flush()
        c.wait(60)
        d.send_signal(signal.SIGINT)
        d.wait(60)
        s = pstats.Stats(prof)
        per = {f"{k[0].rsplit('/', 1)[-1]}:{k[1]}({k[2]})": v[1] for k, v in s.stats.items()}
        return s.total_calls, per


def syscalls(n):
    with tempfile.TemporaryDirectory() as tmp:
        d, port = daemon(tmp)
        c = client(port, n)
        trace = os.path.join(tmp, "strace.txt")
        st = subprocess.Popen(
            ["strace", "-c", "-f", "-p", str(d.pid), "-o", trace], stderr=subprocess.DEVNULL
        )
        time.sleep(1.0)  # attached
        c.stdin.write("\n")
        c.stdin.flush()
        assert c.stdout.readline().strip() == "done"
        st.send_signal(signal.SIGINT)
        st.wait(30)
        c.stdin.write("\n")
        c.stdin.flush()
        c.wait(60)
        d.terminate()
        d.wait(30)
        rows = {}
        for line in Path(trace).read_text().splitlines():
            f = line.split()
            if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
                errors = int(f[4]) if len(f) == 6 else 0
                rows[f[-1]] = {
                    "per_get": round(int(f[3]) / n, 3),
                    "errors_per_get": round(errors / n, 3),
                }
        return rows


small, big = calls(1000), calls(11000)
per_fn = {k: round((big[1].get(k, 0) - small[1].get(k, 0)) / 10000, 2) for k in big[1]}
top = sorted(((v, k) for k, v in per_fn.items() if v >= 0.5), reverse=True)
result = {
    "tree": tree,
    "commit": subprocess.run(
        ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "loadavg_start": os.getloadavg(),
    "python_calls_per_get": round((big[0] - small[0]) / 10000, 1),
    "calls_per_get_by_function": {k: v for v, k in top},
    "syscalls_per_get": syscalls(5000),
    "loadavg_end": os.getloadavg(),
}
Path(out).write_text(json.dumps(result, indent=1))
print(json.dumps({k: v for k, v in result.items() if k != "calls_per_get_by_function"}, indent=1))
print(list(result["calls_per_get_by_function"].items())[:40])
