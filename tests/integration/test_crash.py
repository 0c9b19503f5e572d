"""Crash safety: SIGKILL an engine under a stream of durable puts, many times, and reopen.

Every acknowledged durable put must read back bit-exact; nothing ever reads back wrong; `fsck`
finds the store clean after the last round. The slot I/O runs through io_uring (the default
where the kernel allows it: reads, durable writes and demotions) for every round, and on the
thread path for a few (both share everything above the slot I/O).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.ssd.fsck import fsck

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = int(os.environ.get("KVOFFLOAD_CRASH_ROUNDS", "10"))
THREAD_ROUNDS = min(ROUNDS, 3)  # the thread path's subset
# Each round writes at most this many blocks (~30 KB each), so 60 rounds stay well within the
# SSD and no acknowledged block is evicted to make room (durable means crash-safe, not pinned).
OPS_PER_ROUND = 150


def config(path: str, io_engine: str = "auto") -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=64 << 10, prefault=False),
        SsdConfig(
            capacity_bytes=256 << 20,
            admission_min_uses=1,
            sync_interval_s=0.02,
            io_engine=io_engine,
        ),
        data_dir=path,
    )


def key(k: int) -> bytes:
    return k.to_bytes(16, "little")


def value(k: int, version: int) -> bytes:
    rng = np.random.default_rng(k * 1_000_003 + version)
    return rng.bytes(int(rng.integers(1, 60_000)))


CHILD = """
import random, sys, time
from kvoffload.kvstore import Engine
sys.path.insert(0, {testdir!r})
from test_crash import config, key, value
from test_crash import OPS_PER_ROUND
path, round_, seed, io_engine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)
engine = Engine(config(path, io_engine))
print("READY", engine.stats().tiers[1].io_engine, flush=True)
i = 0
while True:
    i += 1
    if i > OPS_PER_ROUND:  # stay far below the SSD's capacity: durable is not pinned
        time.sleep(1)
        continue
    r = rng.random()
    if r < 0.45:  # a durable put of a fresh key: acknowledged once it returns
        k = round_ * 100_000 + i
        engine.put(key(k), value(k, 0), durable=True)
        print("ACK", k, flush=True)
    elif r < 0.6:  # a durable overwrite of a shared key
        k = 80_000 + rng.randrange(30)
        v = round_ * 100_000 + i
        print("DPUT", k, v, flush=True)
        engine.put(key(k), value(k, v), durable=True)
        print("DACK", k, v, flush=True)
    elif r < 0.9:  # a fast put over a small, shared key range (versions change)
        k = 90_000 + rng.randrange(50)
        print("PUT", k, i, flush=True)
        engine.put(key(k), value(k, i))
    elif r < 0.97:
        k = 90_000 + rng.randrange(50)
        print("DEL", k, flush=True)
        engine.delete(key(k))
    else:
        engine.checkpoint()
"""


@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_acknowledged_durable_puts_survive_sigkill(tmp_path: Path, io_engine: str) -> None:
    if io_engine == "io_uring" and core.io_uring_unavailable() is not None:
        pytest.skip(f"no io_uring here: {core.io_uring_unavailable()}")
    rounds = ROUNDS if io_engine == "io_uring" else THREAD_ROUNDS
    store = str(tmp_path / "store")
    acked: set[int] = set()
    versions: dict[int, set[int]] = {}  # fast keys: every version ever written
    durable: dict[int, int] = {}  # overwritten durable keys: last acknowledged version
    attempted: dict[int, set[int]] = {}  # ... and every version ever started
    rng = random.Random(1234)
    child = CHILD.format(testdir=str(Path(__file__).parent))
    for round_ in range(1, rounds + 1):
        errors = tmp_path / f"stderr.{round_}"
        with open(errors, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", child, store, str(round_), str(rng.randrange(1 << 30)),
                 io_engine],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["READY", io_engine], errors.read_text()
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        # Read through the same file object: readline() may have buffered lines already.
        out = proc.stdout.read()
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, errors.read_text()
        for line in out.splitlines():
            parts = line.split()
            if parts[0] == "ACK":
                acked.add(int(parts[1]))
            elif parts[0] == "PUT":
                versions.setdefault(int(parts[1]), set()).add(int(parts[2]))
            elif parts[0] == "DPUT":
                attempted.setdefault(int(parts[1]), set()).add(int(parts[2]))
            elif parts[0] == "DACK":
                durable[int(parts[1])] = int(parts[2])
        with Engine(config(store, io_engine)) as engine:
            buf = bytearray(64 << 10)
            for k in acked:
                n = engine.get_into(key(k), buf)
                assert n is not None, (
                    f"round {round_}: acknowledged durable block {k} lost; "
                    f"{engine.recovery}, {engine.stats().tiers[1]}"
                )
                assert bytes(buf[:n]) == value(k, 0)
            for k, last in durable.items():
                n = engine.get_into(key(k), buf)
                assert n is not None, f"round {round_}: durable overwrite of {k} lost"
                # The last acknowledged version, or a newer one that was in flight.
                newer = [v for v in attempted[k] if v >= last]
                assert any(bytes(buf[:n]) == value(k, v) for v in newer), f"stale bytes for {k}"
            for k, vs in versions.items():
                n = engine.get_into(key(k), buf)
                if n is not None:
                    assert any(bytes(buf[:n]) == value(k, v) for v in vs), f"wrong bytes for {k}"
            stats = engine.stats()
            assert stats.tiers[1].corrupt_blocks == 0
    assert len(acked) > rounds and durable  # the test really exercised durable puts
    report = fsck(store)
    assert report.clean and report.good_blocks == report.indexed_blocks > 0, report
