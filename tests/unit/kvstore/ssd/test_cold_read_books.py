"""The per-block books of a cold read, cut for small blocks (issue 30): the SSD index's key
hash in C against its Python reference, the read latch against the `threading.Event` it
replaced, and `SsdTier.finish_read`'s "still the key's block" check (no second index probe)
against the probe it replaced, over random deletes, rewrites and reused rows."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.kvstore import BlockView, DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.mover import ReadLatch
from kvoffload.kvstore.ssd import keyhash
from kvoffload.kvstore.ssd.tier import SsdRead

WAIT_S = 30  # a hang guard, never a timing assertion


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


@pytest.mark.parametrize("make", [ReadLatch, threading.Event], ids=["latch", "event"])
def test_a_read_latch_does_what_an_event_did(make: type[ReadLatch] | type[threading.Event]) -> None:
    # The same script against threading.Event (what Manager.inflight held) and ReadLatch.
    latch = make()
    assert not latch.is_set()
    assert latch.wait(0) is False and latch.wait(0.01) is False  # not set: no wait succeeds
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait())) for _ in range(8)]
    timed = [threading.Thread(target=lambda: woke.append(latch.wait(WAIT_S))) for _ in range(4)]
    for t in waiters + timed:
        t.start()
    latch.set()
    for t in waiters + timed:
        t.join(WAIT_S)  # a hang guard, not a timing assertion
        assert not t.is_alive()
    assert woke == [True] * 12  # every waiter woke, once
    latch.set()  # a second set changes nothing
    assert latch.is_set() and latch.wait() and latch.wait(0) and latch.wait(0.01)


def test_a_set_latch_answers_true_while_another_waiter_holds_its_lock() -> None:
    # After set, an Event's wait is True at once; the latch's waiters pass its lock on, and one
    # holding it for that moment (or interrupted while it did) must not fail another's wait
    # (review of the ssdsmall merge: wait(0) was False here).
    latch = ReadLatch()
    latch.set()
    assert latch._lock.acquire(False)  # a waiter mid-pass
    try:
        assert latch.wait(0) is True and latch.wait(0.01) is True and latch.wait() is True
    finally:
        latch._lock.release()


def test_a_blocking_wait_is_not_stranded_by_a_lock_left_held() -> None:
    # A waiter interrupted between its acquire and release leaves the lock held for good: a
    # blocking wait on the set latch still returns (it re-checks the flag).
    latch = ReadLatch()
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(latch.wait()))
    t.start()
    latch._done = True  # set, with the lock never released (the stranded case)
    t.join(WAIT_S)  # a hang guard, not a timing assertion
    assert not t.is_alive() and woke == [True]


def test_a_get_waits_on_the_latch_of_a_read_in_flight(tmp_path: Path) -> None:
    # A key in flight is waited for, not read twice: its latch, set by read_done, wakes the get.
    config = EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=64 << 10, prefault=False),
        SsdConfig(capacity_bytes=32 << 20, admission_min_uses=1, flush_on_close=False),
        data_dir=str(tmp_path),
    )
    with Engine(config) as engine:
        engine.put(key(1), b"v" * 5000, durable=True)
    with Engine(config) as engine:
        m = engine._m
        with m.lock:
            plan = m.prepare_read(key(1), False)
            assert plan is not None and isinstance(m.inflight[key(1)], ReadLatch)
        got: list[object] = []
        getter = threading.Thread(target=lambda: got.append(engine.get(key(1))))
        getter.start()
        ok = engine._ssd.read_unlocked(plan.block, plan.dst)  # type: ignore[union-attr]
        with m.lock:
            m.read_done(plan)
            m.keep_read(plan, ok, out := {})
            m.unpin_locked(out[key(1)])
        getter.join(WAIT_S)
        assert not getter.is_alive()
        view = got[0]
        assert isinstance(view, BlockView) and bytes(view.data) == b"v" * 5000
        view.release()
        stats = engine.stats().tiers[1]
        assert stats.bytes_read == 5000 and stats.promotions == 1  # read once, by the plan
