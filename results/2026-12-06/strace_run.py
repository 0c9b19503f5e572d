"""strace -c on a client (lookup_prof.py or get2m_prof.py in strace mode) and its daemon.

Usage: python strace_run.py PYTHON TREE OUT_PREFIX [SCRIPT]"""

import signal
import subprocess
import sys
import time

py, tree, out = sys.argv[1], sys.argv[2], sys.argv[3]
p = subprocess.Popen(
    [
        py,
        "/work/wt-lookup/results/2026-12-06/"
        + (sys.argv[4] if len(sys.argv) > 4 else "lookup_prof.py"),
        "strace",
        "300",
    ],
    cwd=tree if tree != "/work/main" else "/tmp",
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    stderr=subprocess.DEVNULL,
)
line = p.stdout.readline().split()
dpid, cpid = line[1], line[3]
sd = subprocess.Popen(
    ["strace", "-c", "-f", "-p", dpid, "-o", out + "_daemon.txt"], stderr=subprocess.DEVNULL
)
sc = subprocess.Popen(
    ["strace", "-c", "-f", "-p", cpid, "-o", out + "_client.txt"], stderr=subprocess.DEVNULL
)
time.sleep(1.0)
p.stdin.write("\n")
p.stdin.flush()
print(p.stdout.readline().strip())
for s in (sd, sc):
    s.send_signal(signal.SIGINT)
    s.wait()
p.stdin.write("\n")
p.stdin.flush()
p.wait()
