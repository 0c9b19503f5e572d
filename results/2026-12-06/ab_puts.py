"""Old tree against new tree, alternating: daemon CPU per put (64 KiB, 2 MiB) and Python
calls per 64 KiB put in the daemon (cProfile, 3,000 minus 1,000 puts).

Usage: python ab_puts.py OLD_TREE NEW_TREE ROUNDS OUT.json (env: AB_N64, AB_N2M puts per
size; AB_SIZES="1024:10000" other sizes; AB_CALLS=0 no cProfile runs)
Each round starts each tree's own `kvoffload serve` (DRAM only, its own venv; started by
results/2026-12-05/creader/daemon.py) and drives it with that tree's client in a subprocess:
`put` loops over 16 keys (overwrites) while reading the daemon's CPU (utime+stime of all its
threads, /proc/<pid>/stat).
"""

import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the creader measurements' daemon starter (DRAM only, one worker)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-05" / "creader"))
from daemon import start  # noqa: E402

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
for k in keys:  # warm
    c.put(k, val)
c0, t0 = cpu(), time.perf_counter()
for i in range(n):
    c.put(keys[i % 16], val)
c1, t1 = cpu(), time.perf_counter()
print(f"{(c1 - c0) / n * 1e6:.2f} {(t1 - t0) / n * 1e6:.2f}")
c.close()
"""
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}


def one(tree, size, n, profile=False):
    py = os.path.join(tree, ".venv/bin/python")
    with tempfile.TemporaryDirectory() as tmp:
        prof = os.path.join(tmp, "d.pstats") if profile else None
        d, port = start(py, tmp, ENV, "256MiB", prof)
        try:
            out = subprocess.run(
                [py, "-c", CLIENT, str(d.pid), str(port), str(size), str(n)],
                capture_output=True,
                text=True,
                env=ENV,
                cwd=tmp,
                timeout=600,
            )
            assert out.returncode == 0, out.stderr
            cpu_us, wall_us = map(float, out.stdout.split())
        finally:
            d.send_signal(signal.SIGINT if profile else signal.SIGTERM)
            d.wait(60)
        calls = pstats.Stats(prof).total_calls if profile else None
    return cpu_us, wall_us, calls


def main():
    old, new, rounds, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    cases = [(64 << 10, int(os.environ.get("AB_N64", 5000))),
             (2 << 20, int(os.environ.get("AB_N2M", 500)))]  # fmt: skip
    if os.environ.get("AB_SIZES"):  # e.g. "1024:10000": other sizes, counts
        cases = [tuple(map(int, c.split(":"))) for c in os.environ["AB_SIZES"].split(",")]
    rows = []
    for r in range(rounds):
        order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
        for name, tree in order:
            for size, n in cases:
                cpu_us, wall_us, _ = one(tree, size, n)
                rows.append({"round": r, "tree": name, "size": size, "puts": n,
                             "daemon_cpu_us_per_put": cpu_us, "client_wall_us_per_put": wall_us,
                             "loadavg": os.getloadavg()[0]})  # fmt: skip
                print(rows[-1], flush=True)
    calls = {}
    for name, tree in (("old", old), ("new", new)) if os.environ.get("AB_CALLS") != "0" else ():
        small, big = one(tree, 64 << 10, 1000, True)[2], one(tree, 64 << 10, 3000, True)[2]
        calls[name] = round((big - small) / 2000, 1)
    summary = {"python_calls_per_64KiB_put": calls}
    for size, _ in cases:
        for name in ("old", "new"):
            v = sorted(x["daemon_cpu_us_per_put"] for x in rows
                       if x["tree"] == name and x["size"] == size)  # fmt: skip
            summary[f"{name}/{size}"] = {"median": v[len(v) // 2], "all": v}
        summary[f"new_over_old/{size}"] = round(
            summary[f"new/{size}"]["median"] / summary[f"old/{size}"]["median"], 3
        )
    rev = ["git", "-C", "{}", "rev-parse", "HEAD"]
    out = {
        "what": "daemon CPU per put over kv://, old tree vs new tree, alternating",
        "old": subprocess.run([a.format(old) for a in rev], capture_output=True,
                              text=True).stdout.strip(),
        "new": subprocess.run([a.format(new) for a in rev], capture_output=True,
                              text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": "shared 2-vCPU VM, Python 3.11.7",
        "rows": rows,
        "summary": summary,
    }  # fmt: skip
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(summary, indent=1))


main()
