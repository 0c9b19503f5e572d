"""Profile cold 160 KiB blocks through Engine.get_many_into (io_uring, read_depth 8, 32 a call):
cProfile on every thread, differenced between two batch counts; CPU from /proc/self/stat."""

import cProfile
import os
import pstats
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.getcwd())
from bench.micro.ssd_bench import _aligned, _drop_cache, _engine, _parallel, _settle

SIZE = 160 << 10
B = 32
d = Path(sys.argv[1])
nb = [int(x) for x in sys.argv[2].split(",")]
mode = sys.argv[3]
store = d / "store"
shutil.rmtree(store, ignore_errors=True)
N = max(nb) * B
keys = [i.to_bytes(16, "little") for i in range(N)]
val = np.frombuffer(os.urandom(SIZE), dtype=np.uint8)
ssd_bytes = int(N * (SIZE + 8192) * 1.3) + (64 << 20)
with _engine(store, ssd_bytes) as e:
    _parallel(N, SIZE, lambda i, _: e.put(keys[i], val, durable=True))
bufs = [_aligned(SIZE) for _ in range(B)]
for b in bufs:
    b[:] = val.data


def ticks():
    with open("/proc/self/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return int(f[11]), int(f[12])  # utime, stime


out = {}
for nbatch in nb:
    _drop_cache(store / "ssd.slots")
    profs = []
    if mode == "prof":
        lock = threading.Lock()

        def tp(*a, lock=lock, profs=profs):
            p = cProfile.Profile(time.thread_time)
            with lock:
                profs.append(p)
            p.enable()

        threading.setprofile(tp)  # every thread the engine starts
    with _engine(store, ssd_bytes, "posix", depth=8, engine="io_uring") as e:
        _settle(e)
        if mode == "prof":
            main = cProfile.Profile(time.thread_time)
            profs.append(main)
            main.enable()
        u0, s0 = ticks()
        c0 = time.process_time()
        for first in range(0, nbatch * B, B):
            got = e.get_many_into(keys[first : first + B], bufs)
            assert got == [SIZE] * B, got
        c1 = time.process_time()
        u1, s1 = ticks()
        if mode == "prof":
            for p in profs:
                p.disable()
            threading.setprofile(None)
            st = pstats.Stats(profs[0])
            for p in profs[1:]:
                st.add(p)
            out[nbatch] = {k: (v[1], v[3]) for k, v in st.stats.items()}  # ncalls, cumtime
        n = nbatch * B
        print(
            f"{mode} batches={nbatch} blocks={n} cpu/block={(c1 - c0) / n * 1e6:.1f}us "
            f"user={(u1 - u0) * 1e4 / n:.1f}us sys={(s1 - s0) * 1e4 / n:.1f}us (ticks 10ms)"
        )
if mode == "prof":
    a, b = nb
    dn = (b - a) * B
    rows = []
    for k in set(out[a]) | set(out[b]):
        ca, ta = out[a].get(k, (0, 0.0))
        cb, tb = out[b].get(k, (0, 0.0))
        rows.append(((cb - ca) / dn, (tb - ta) / dn * 1e6, f"{Path(k[0]).name}:{k[1]}({k[2]})"))
    tot_calls = sum(r[0] for r in rows)
    print(f"python calls per block (differenced): {tot_calls:.1f}")
    for r in (
        sorted(rows, key=lambda r: -r[0])[:30] + [("--",)] + sorted(rows, key=lambda r: -r[1])[:45]
    ):
        if r[0] == "--":
            print("---- by cum")
            continue
        print(f"{r[0]:7.2f} calls/blk {r[1]:8.1f} us cum/blk  {r[2]}")
shutil.rmtree(store, ignore_errors=True)
