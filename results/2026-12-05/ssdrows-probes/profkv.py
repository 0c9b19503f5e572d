import signal
import subprocess
import time
from pathlib import Path

from kvoffload.bench.peers.lmcache_mp import _daemon, _drive, _ours

py = "/work/wt-ssdrows/.venv-lmcache/bin/python"
work = Path("/var/tmp/ssdrows-profkv")
work.mkdir(exist_ok=True)
ssd = 448 << 20
drive = {"size": 2 << 20, "keys": 8, "in_flight": 4, "rounds": 4}
with _daemon(work, ssd) as url:
    print("store", _drive(py, {**drive, "spec": _ours(url), "phase": "store"}))
with _daemon(work, ssd) as url:
    pid = subprocess.run(
        ["pgrep", "-f", "--", f"data-dir {work}/data"], capture_output=True, text=True
    ).stdout.split()[0]
    spy = subprocess.Popen(
        [
            "/tmp/ssdrows/pyspy/bin/py-spy",
            "record",
            "-r",
            "200",
            "--pid",
            pid,
            "-f",
            "raw",
            "-o",
            "/tmp/ssdrows/prof/daemon-load.spy",
        ],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    print("load", _drive(py, {**drive, "spec": _ours(url), "phase": "load"}))
    spy.send_signal(signal.SIGINT)
    spy.wait(30)
