"""The per-block books of a cold read, cut for small blocks (issue 30): the SSD index's key
hash in C against its Python reference, and `SsdTier.finish_read`'s "still the key's block"
check (no second index probe) against the probe it replaced, over random deletes, rewrites
and reused rows."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.ssd import keyhash
from kvoffload.kvstore.ssd.tier import SsdRead


def test_the_c_key_hash_is_the_python_one() -> None:
    c_hash = core.hash_key_c()
    if c_hash is None:
        pytest.skip("the C core is not built here (KVOFFLOAD_PURE_PYTHON or no compiler)")
    assert keyhash.hash_key is c_hash  # what the index, sketch and ghost filter call
    rng = random.Random(30)
    keys = [b"", b"\x00" * 16, b"\xff" * 16, b"\xff" * 8, b"\xff" * 9, (5).to_bytes(16, "little")]
    keys += [rng.randbytes(rng.choice([16, 16, 16, 1, 7, 8, 9, 15, 17, 24])) for _ in range(3000)]
    for key in keys:
        want = keyhash.hash_key_py(key)
        assert c_hash(key) == want, key.hex()
        assert c_hash(bytearray(key)) == want and c_hash(memoryview(key)) == want
    sixteen = [k for k in keys if len(k) == 16]
    column = np.array(sixteen, dtype="S16")
    assert keyhash.hash_keys(column).tolist() == [c_hash(k) for k in sixteen]
    with pytest.raises(TypeError):
        c_hash("not bytes")  # type: ignore[arg-type]


def key(i: int) -> bytes:
    return (9000 + i).to_bytes(16, "little")


def test_finish_read_says_what_a_second_probe_said(tmp_path: Path) -> None:
    # Reads planned, then keys deleted, rewritten, or their rows reused by other keys before
    # the reads finish: `finish_read` must answer exactly what find(key) == row and the
    # row's snapshot unchanged answered (the check it had before).
    config = EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=64 << 10, prefault=False),
        SsdConfig(capacity_bytes=32 << 20, admission_min_uses=1, flush_on_close=False),
        data_dir=str(tmp_path),
    )
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    reused = 0  # reads whose row another key holds by the end: live, but not the key's block
    with Engine(config) as engine:
        tier = engine._ssd
        assert tier is not None
        for i in range(40):
            engine.put(key(i), bytes([i]) * 5000, durable=True)
        fresh = 40
        for _ in range(300):
            reads: list[SsdRead] = []
            picked = rng.sample(range(fresh), 6)
            with engine._m.lock:
                for i in picked:
                    block = tier.find_block(key(i))
                    if block is not None:
                        reads.append(block)
            for _ in range(rng.randrange(4)):  # what happens while the reads are in flight
                i, op = rng.choice(picked), rng.random()
                if op < 0.4:
                    engine.delete(key(i))
                elif op < 0.7:
                    engine.put(key(i), bytes([i % 251]) * rng.choice([3000, 5000]), durable=True)
                else:  # a new key, which may take the row a delete just freed
                    engine.put(key(fresh), b"n" * 4000, durable=True)
                    fresh += 1
            with engine._m.lock:
                for read in reads:
                    row = tier.index.find(read.snap[0])
                    want = row == read.row and tier.cat.snapshot(row) == read.snap
                    assert tier.finish_read(read, True) is want
                    seen[want] += 1
                    reused += (
                        bool(tier.index.live[read.row])
                        and tier.index.key_of(read.row) != read.snap[0]
                    )
    assert seen[True] > 100 and seen[False] > 100 and reused > 10  # every case was exercised
