"""Races between a key's puts, gets and its DRAM->SSD demotion, made deterministic by holding
one SSD slot write until the test lets it go."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig

BLOCK = 200_000
K = (7).to_bytes(16, "little")


def key(i: int) -> bytes:
    return (1000 + i).to_bytes(16, "little")


def config(path: Path) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        # The held write replaces the thread path's `SlotFile.write` (the ring's writes do not
        # pass through it).
        SsdConfig(
            capacity_bytes=64 << 20,
            admission_min_uses=1,
            sync_interval_s=0.02,
            io_engine="threads",
        ),
        data_dir=str(path),
    )


class HeldWrite:
    """Holds the first SSD slot write whose payload starts with `marker` until `release()`."""

    def __init__(self, engine: Engine, marker: bytes) -> None:
        slots = engine._ssd.slots  # type: ignore[union-attr]
        self._write: Callable[[int, Sequence[memoryview]], None] = slots.write
        self.marker = marker
        self.started = threading.Event()
        self._go = threading.Event()
        self._armed = True
        slots.write = self  # type: ignore[method-assign]

    def __call__(self, offset: int, buffers: Sequence[memoryview]) -> None:
        if self._armed and len(buffers) > 1 and bytes(buffers[1][:8]) == self.marker:
            self._armed = False
            self.started.set()
            assert self._go.wait(30)
        self._write(offset, buffers)

    def release(self) -> None:
        self._go.set()


def fill(engine: Engine, start: int, n: int = 30) -> None:
    """Push everything older out of the 4 MiB DRAM tier (each put here is 200 KB)."""
    for i in range(start, start + n):
        engine.put(key(i), bytes([i % 251]) * BLOCK)


def read(engine: Engine, k: bytes) -> bytes | None:
    buf = bytearray(BLOCK)
    n = engine.get_into(k, buf)
    return None if n is None else bytes(buf[:n])


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    with Engine(config(tmp_path)) as e:
        yield e


def test_durable_overwrite_racing_the_old_values_demotion_is_kept(tmp_path: Path) -> None:
    v1, v2 = b"v1......" * (BLOCK // 8), b"v2......" * (BLOCK // 8)
    engine = Engine(config(tmp_path))
    engine.put(K, v1)
    held = HeldWrite(engine, v2[:8])
    put = threading.Thread(target=engine.put, args=(K, v2), kwargs={"durable": True})
    put.start()
    assert held.started.wait(30)  # the durable put planned its slot and is writing it
    fill(engine, 0)  # v1 is demoted now: its SSD write plans and commits after the put's plan
    held.release()
    put.join(30)
    assert read(engine, K) == v2
    fill(engine, 100)  # v2 leaves DRAM: it must be the SSD's copy, not v1
    assert read(engine, K) == v2
    engine.close()
    with Engine(config(tmp_path)) as reopened:
        assert read(reopened, K) == v2


def test_get_while_the_key_is_being_demoted(engine: Engine) -> None:
    v1 = b"v1......" * (BLOCK // 8)
    engine.put(K, v1)
    held = HeldWrite(engine, v1[:8])
    pusher = threading.Thread(target=fill, args=(engine, 0, 1))
    # One more 200 KB put than DRAM holds: the coldest block (K) is evicted, i.e. demoted.
    fill(engine, 200, 19)
    pusher.start()
    assert held.started.wait(30)
    try:
        assert read(engine, K) == v1  # the policy no longer holds K; DRAM still does
    finally:
        held.release()
        pusher.join(30)
    assert read(engine, K) == v1


def test_get_of_an_ssd_block_with_dram_all_pinned_is_served(engine: Engine) -> None:
    v1 = b"v1......" * (BLOCK // 8)
    engine.put(K, v1)
    fill(engine, 0)  # K is on the SSD only now
    views = [engine.get(key(i)) for i in range(30)]
    pinned = [v for v in views if v is not None]
    assert sum(len(v) for v in pinned) > (4 << 20) - BLOCK  # no room left to promote into
    try:
        with engine.get(K) as view:  # type: ignore[union-attr]
            assert bytes(view.data) == v1
        assert read(engine, K) == v1
    finally:
        for v in pinned:
            v.release()
    assert engine.stats().tiers[0].entries == 20


def test_fast_put_during_a_durable_put_never_brings_back_an_older_value(tmp_path: Path) -> None:
    v0, v1, v2 = (t * (BLOCK // 8) for t in (b"v0......", b"v1......", b"v2......"))
    with Engine(config(tmp_path)) as engine:
        engine.put(K, v0, durable=True)  # on the SSD
        held = HeldWrite(engine, v2[:8])
        put = threading.Thread(target=engine.put, args=(K, v2), kwargs={"durable": True})
        put.start()
        assert held.started.wait(30)
        engine.put(K, v1)  # acknowledged while v2 writes through
        assert read(engine, K) == v1
        fill(engine, 0)  # v1 leaves DRAM while v2 still writes: a miss, never v0
        assert read(engine, K) in (None, v1)
        held.release()
        put.join(30)
        assert read(engine, K) == v2


def test_overlapping_durable_puts_read_the_same_before_and_after_a_crash(tmp_path: Path) -> None:
    va, vb = b"vA......" * (BLOCK // 8), b"vB......" * (BLOCK // 8)
    engine = Engine(config(tmp_path))
    held = HeldWrite(engine, va[:8])
    a = threading.Thread(target=engine.put, args=(K, va), kwargs={"durable": True})
    a.start()
    assert held.started.wait(30)  # A planned its SSD write first
    engine.put(K, vb, durable=True)  # B planned later: the newer SSD version
    held.release()
    a.join(30)
    before = read(engine, K)
    assert before in (va, vb)
    # A crash: the SSD tier goes without flushing DRAM or checkpointing.
    assert engine._pool is not None and engine._ssd is not None
    engine._pool.shutdown()
    engine._m.stop_writer()  # a crashed process has no demotion writer left running either
    engine._ssd.close(checkpoint=False)
    with Engine(config(tmp_path)) as reopened:
        assert read(reopened, K) == before


def test_a_delete_across_a_checkpoint_does_not_hang_later_writes(tmp_path: Path) -> None:
    cfg = EngineConfig(
        DramConfig(capacity_bytes=1 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(  # the held wipe replaces the thread path's `SlotFile.write`
            capacity_bytes=4 << 20,
            admission_min_uses=1,
            sync_interval_s=0.02,
            io_engine="threads",
        ),
        data_dir=str(tmp_path),
    )
    with Engine(cfg) as engine:
        for i in range(40):  # many journal batches in the first journal
            engine.put(key(i), bytes([i]) * BLOCK, durable=True)
        slots = engine._ssd.slots  # type: ignore[union-attr]
        write = slots.write
        started, go = threading.Event(), threading.Event()

        def held_wipe(offset: int, buffers: Sequence[memoryview]) -> None:
            if len(buffers) == 1 and not started.is_set():  # the delete's header wipe
                started.set()
                assert go.wait(30)
            write(offset, buffers)

        slots.write = held_wipe  # type: ignore[method-assign]
        victim = next(key(i) for i in range(40) if engine._ssd.find(key(i)) != -1)  # type: ignore[union-attr]
        deleter = threading.Thread(target=engine.delete, args=(victim,))
        deleter.start()
        assert started.wait(30)
        engine.checkpoint()  # a new journal: its tickets start again at 1
        go.set()
        deleter.join(30)
        # A full SSD reuses the deleted slot: it must wait on the old journal's ticket.
        writer = threading.Thread(
            target=lambda: [
                engine.put(key(i), bytes([i % 251]) * BLOCK, durable=True) for i in range(100, 140)
            ]
        )
        writer.start()
        writer.join(60)
        assert not writer.is_alive(), "durable puts hung on a ticket of the previous journal"
        assert read(engine, key(139)) == bytes([139 % 251]) * BLOCK
