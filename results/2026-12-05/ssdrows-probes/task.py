"""One task at a time (no overlap between tasks): get_many_into of 8 cold 2 MiB blocks,
local:// vs kv:// over the same kind of SSD tier; time per task split into wall and client CPU."""

import os
import statistics
import time
from pathlib import Path

from kvoffload.bench.peers.lmcache_mp import _daemon, _drop_page_cache
from kvoffload.client_sdk import Client

MiB = 1 << 20
N = 64
K = 8
keys = [os.urandom(16) for _ in range(N)]
vals = [os.urandom(2 * MiB) for _ in range(N)]
ssd = 448 * MiB


def timed(client):
    bufs = [memoryview(bytearray(2 * MiB)) for _ in range(K)]
    _drop_page_cache()
    walls, cpus = [], []
    for at in range(0, N, K):
        c, t = time.process_time(), time.perf_counter()
        got = client.get_many_into(keys[at : at + K], bufs)
        walls.append((time.perf_counter() - t) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
        assert got == [2 * MiB] * K and bytes(bufs[-1]) == vals[at + K - 1]
    return (
        round(statistics.median(walls), 1),
        round(statistics.median(cpus), 1),
        [round(w) for w in walls],
    )


base = Path("/var/tmp/ssdrows-task")
base.mkdir(exist_ok=True)
for trial in range(2):
    url = f"local://{base}/l{trial}?dram=64MiB&max_value=4MiB&ssd={ssd >> 20}MiB&admit=1"
    with Client.connect(url) as c:
        c.put_many(zip(keys, vals, strict=True))
    with Client.connect(url) as c:
        print("local:// task ms (wall median, client CPU median, walls)", timed(c))
    home = base / f"k{trial}"
    with _daemon(home, ssd) as u, Client.connect(u) as c:
        c.put_many(zip(keys, vals, strict=True))
    with _daemon(home, ssd) as u, Client.connect(u) as c:
        print("kv://    task ms (wall median, client CPU median, walls)", timed(c))
