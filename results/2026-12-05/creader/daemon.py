"""`kvoffload serve` from one tree's venv, as the creader measurements start it (DRAM only,
one worker): the process and its native port."""

import re
import subprocess

LISTEN = re.compile(r"kvoffload: (\w+) listening on (\S+):(\d+)")
SERVE = ["-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0"]
SERVE += ["--metrics-port", "0", "--ssd", "0"]


def start(py, tmp, env, dram, profile=None):
    """Start the daemon (under cProfile writing `profile`, if given) and wait until ready."""
    pre = ["-m", "cProfile", "-o", profile] if profile else []
    args = [py, *pre, *SERVE, "--dram", dram, "--data-dir", tmp]
    d = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
    port = None
    for line in d.stdout:
        m = LISTEN.match(line.strip())
        if m and m.group(1) == "native":
            port = int(m.group(3))
        if line.strip() == "kvoffload: ready":
            break
    return d, port
