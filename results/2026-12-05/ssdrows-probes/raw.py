"""Raw O_DIRECT preadv from a thread pool on /var/tmp: the disk's rate at a given depth."""

import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

path = "/var/tmp/ssdrows-raw.bin"
total = 256 << 20
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
buf = mmap.mmap(-1, 4 << 20)
buf.write(os.urandom(4 << 20))
for off in range(0, total, 4 << 20):
    os.pwrite(fd, buf, off)
os.fsync(fd)
out = {}


def _read(bufs, depth, size, i):
    return os.preadv(fd, [bufs[i % depth]], i * size)


for size, depth in [(2 << 20, 8), (2 << 20, 32), (640 << 10, 8)]:
    n = total // size
    bufs = [mmap.mmap(-1, size) for _ in range(depth)]
    rates = []
    for _ in range(5):
        with ThreadPoolExecutor(depth) as pool:
            t = time.perf_counter()
            list(pool.map(partial(_read, bufs, depth, size), range(n)))
            rates.append(n * size / (time.perf_counter() - t) / 1e9)
    out[f"{size >> 10}KiB x{depth}"] = (
        round(statistics.median(rates), 3),
        [round(x, 2) for x in rates],
        round(size / (statistics.median(rates) * 1e9) * 1e3, 3),
    )
os.close(fd)
os.unlink(path)
for k, v in out.items():
    print(k, "median GB/s", v[0], "rounds", v[1], "ms/block at that rate", v[2])
