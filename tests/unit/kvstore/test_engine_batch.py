"""Batched gets of SSD-only blocks: reads in flight together (bounded), each block read once,
damaged blocks are misses that leave no byte of theirs in the caller's buffer."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.reads import side_buffers

BLOCK = 200_000
WAIT_S = 30  # a hang guard, never a timing assertion


def key(i: int) -> bytes:
    return (5000 + i).to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def config(path: Path, depth: int = 4, io_engine: str = "auto") -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(
            capacity_bytes=64 << 20, admission_min_uses=1, read_depth=depth, io_engine=io_engine
        ),
        data_dir=str(path),
    )


def cold_store(path: Path, n: int) -> None:
    """`n` blocks on the SSD; the next open starts with DRAM empty."""
    with Engine(config(path)) as engine:
        for i in range(n):
            engine.put(key(i), value(i), durable=True)


class Reads:
    """Counts slot reads by file offset, the most in flight at once, and can hold reads (the
    thread path's seam: engines under it run `io_engine="threads"`; tests/unit/kvstore/ssd/
    test_uring.py holds the ring's completions)."""

    def __init__(self, engine: Engine, hold: Callable[[int], bool] = lambda n: False) -> None:
        slots = engine._ssd.slots  # type: ignore[union-attr]
        self._read: Callable[[int, Sequence[memoryview]], None] = slots.read
        self._hold = hold
        self._lock = threading.Lock()
        self.offsets: list[int] = []
        self.now = self.most = 0
        self.started = threading.Condition(self._lock)
        self.go = threading.Event()
        slots.read = self  # type: ignore[method-assign]

    def __call__(self, offset: int, buffers: Sequence[memoryview]) -> None:
        with self._lock:
            self.offsets.append(offset)
            self.now += 1
            self.most = max(self.most, self.now)
            held = self._hold(len(self.offsets))
            self.started.notify_all()
        try:
            if held:
                assert self.go.wait(WAIT_S)
            self._read(offset, buffers)
        finally:
            with self._lock:
                self.now -= 1

    def wait_started(self, n: int) -> None:
        with self._lock:
            assert self.started.wait_for(lambda: len(self.offsets) >= n, WAIT_S)


def test_a_batch_reads_its_blocks_together_up_to_the_depth(tmp_path: Path) -> None:
    cold_store(tmp_path, 10)
    with Engine(config(tmp_path, depth=4, io_engine="threads")) as engine:
        reads = Reads(engine, hold=lambda n: n <= 4)  # the first four wait for each other
        out: list[list[bytes | None]] = []

        def get() -> None:
            views = engine.get_many([key(i) for i in range(10)])
            out.append([None if v is None else bytes(v.data) for v in views])
            for v in views:
                if v is not None:
                    v.release()

        t = threading.Thread(target=get)
        t.start()
        reads.wait_started(4)  # four reads in flight before any completed
        reads.go.set()
        t.join(WAIT_S)
        assert out == [[value(i) for i in range(10)]]
        assert reads.most == 4 and len(reads.offsets) == 10
        dram, ssd = engine.stats().tiers
        assert ssd.hits == dram.promotions == 10 and dram.pinned == 0


def test_get_many_into_serves_the_batch_and_counts_like_single_gets(tmp_path: Path) -> None:
    cold_store(tmp_path, 6)
    with Engine(config(tmp_path, io_engine="threads")) as engine:
        reads = Reads(engine)
        keys = [key(i) for i in range(6)] + [key(99), key(2)]  # a miss and a repeat
        bufs = [bytearray(BLOCK) for _ in keys]
        got = engine.get_many_into(keys, bufs)
        assert got == [BLOCK] * 6 + [None, BLOCK]
        assert [bytes(b) for b in bufs[:6]] == [value(i) for i in range(6)]
        assert bytes(bufs[7]) == value(2) and bytes(bufs[6]) == bytes(BLOCK)
        assert len(reads.offsets) == len(set(reads.offsets)) == 6  # key 2 read once
        st = engine.stats()
        assert st.hits == 7 and st.misses == 1 and st.tiers[1].hits == 6
        assert st.tiers[0].pinned == 0


def test_a_block_another_caller_is_reading_is_not_read_again(tmp_path: Path) -> None:
    cold_store(tmp_path, 3)
    with Engine(config(tmp_path, io_engine="threads")) as engine:
        reads = Reads(engine, hold=lambda n: n == 1)  # the single get's read waits
        single: list[int | None] = []
        first = threading.Thread(
            target=lambda: single.append(engine.get_into(key(0), bytearray(BLOCK)))
        )
        first.start()
        reads.wait_started(1)
        batch: list[list[int | None]] = []

        def get_batch() -> None:
            batch.append(
                engine.get_many_into([key(0), key(1), key(2)], [bytearray(BLOCK) for _ in range(3)])
            )

        second = threading.Thread(target=get_batch)
        second.start()
        reads.wait_started(3)  # the batch read its other two blocks while key 0's is held
        reads.go.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
        assert single == [BLOCK] and batch == [[BLOCK] * 3]
        assert len(reads.offsets) == 3 and len(set(reads.offsets)) == 3


def test_a_damaged_block_in_a_batch_is_a_miss_and_its_buffer_is_zeroed(
    tmp_path: Path,
) -> None:
    # Its value is checked as it is copied in (one pass): the buffer holds zeros, never a
    # byte of the damaged block (Engine.get_into's promise).
    cold_store(tmp_path, 4)
    with Engine(config(tmp_path)) as engine:  # find where block 1's payload lies
        assert engine._ssd is not None
        page = int(engine._ssd.index.rows["page"][engine._ssd.find(key(1))])
    with open(tmp_path / "ssd.slots", "r+b") as fh:
        fh.seek((page + 1) * PAGE + 1000)
        byte = fh.read(1)
        fh.seek((page + 1) * PAGE + 1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with Engine(config(tmp_path)) as engine:
        bufs = [bytearray(b"\xab" * BLOCK) for _ in range(4)]
        got = engine.get_many_into([key(i) for i in range(4)], bufs)
        assert got == [BLOCK, None, BLOCK, BLOCK]
        assert bytes(bufs[1]) == bytes(BLOCK)
        assert [bytes(bufs[i]) for i in (0, 2, 3)] == [value(i) for i in (0, 2, 3)]
        ssd = engine.stats().tiers[1]
        assert ssd.corrupt_blocks == 1 and not engine.contains(key(1))


def test_a_batch_is_served_while_pinned_views_hold_all_of_dram(tmp_path: Path) -> None:
    cold_store(tmp_path, 24)
    with Engine(config(tmp_path)) as engine:
        held = [engine.get(key(i)) for i in range(16)]  # ~3.3 MB of the 4 MiB arena pinned
        views = engine.get_many([key(i) for i in range(16, 24)])
        assert [bytes(v.data) if v else None for v in views] == [value(i) for i in range(16, 24)]
        for v in held + views:
            assert v is not None
            v.release()
        assert engine.stats().tiers[0].pinned == 0
        assert engine.get_many_into([key(20)], [bytearray(BLOCK)]) == [BLOCK]


def test_a_batch_failing_part_way_leaves_no_pin(tmp_path: Path) -> None:
    # A get of the batch raising after others were acquired (injected at the third acquire)
    # must release the pins already taken, or those blocks could never be evicted.
    cold_store(tmp_path, 6)
    with Engine(config(tmp_path)) as engine:
        for v in engine.get_many([key(i) for i in range(3)]):  # blocks 0-2 in DRAM, unpinned
            assert v is not None
            v.release()
        manager = engine._reads
        real, calls = manager.acquire, [0]

        def failing(k: bytes, fetched: object = None) -> object:
            calls[0] += 1
            if calls[0] == 3:
                raise OSError("injected")
            return real(k, fetched)  # type: ignore[arg-type]

        manager.acquire = failing  # type: ignore[method-assign,assignment]
        try:
            engine.get_many([key(i) for i in range(6)])
        except OSError:
            pass
        else:
            raise AssertionError("the injected failure did not surface")
        finally:
            manager.acquire = real  # type: ignore[method-assign]
        assert engine.stats().tiers[0].pinned == 0


@contextlib.contextmanager
def _hot_then_cold_batch(tmp_path: Path, cold: int) -> Iterator[tuple[Engine, list[bytes]]]:
    """An engine (SSD admission 2) holding 15 DRAM-only blocks (used once) and `cold`
    SSD-only ones, after one `get_many_into` of all of them, hot first, read back exactly."""
    cold_store(tmp_path, cold)
    cfg = config(tmp_path)
    cfg = dataclasses.replace(cfg, ssd=dataclasses.replace(cfg.ssd, admission_min_uses=2))
    with Engine(cfg) as engine:
        hot = [(9000 + i).to_bytes(16, "little") for i in range(15)]
        for i, k in enumerate(hot):
            engine.put(k, value(100 + i))
        keys = hot + [key(i) for i in range(cold)]
        buffers = [bytearray(BLOCK) for _ in keys]
        assert engine.get_many_into(keys, buffers) == [BLOCK] * (15 + cold)
        assert [bytes(b) for b in buffers] == [value(100 + i) for i in range(15)] + [
            value(i) for i in range(cold)
        ]
        yield engine, hot


def test_a_batch_does_not_evict_its_own_dram_hits(tmp_path: Path) -> None:
    # 15 DRAM-only blocks (used once: SSD admission 2 would drop them if evicted) and 10
    # SSD-only ones in one batch: the room the SSD reads take must not come from the batch's
    # own DRAM hits (pinned first), so every block is served and every DRAM block stays.
    with _hot_then_cold_batch(tmp_path, 10) as (engine, hot):
        assert all(engine.contains(k) for k in hot)
        dram = engine.stats().tiers[0]
        assert dram.evictions == 0 and dram.pinned == 0


def test_a_batch_of_more_ssd_blocks_than_dram_holds_bounds_its_side_buffers(
    tmp_path: Path,
) -> None:
    # Called directly (no SDK window): 15 DRAM hits pin most of the arena, and 60 SSD-only
    # blocks need room DRAM does not have. Each of those takes a side buffer, held until the
    # batch ended before (~55 at once); now one copied out goes before a read takes another.
    with _hot_then_cold_batch(tmp_path, 60) as (engine, hot):
        stats = engine.stats()
        assert stats.staged_gets > side_buffers(4)  # DRAM did run out: the bound is tested
        assert stats.staged_peak <= side_buffers(4)
        assert all(engine.contains(k) for k in hot)  # the batch's own hits were not evicted
        dram = stats.tiers[0]
        assert dram.evictions == 0 and dram.pinned == 0


def test_a_read_failing_oddly_is_a_miss_that_leaves_no_pin_or_slot(tmp_path: Path) -> None:
    # An I/O path raising something other than StorageIOError in the middle of a batch: that
    # read is a miss (the key is then read again on its own), the others are served, and no
    # pin or reserved DRAM slot is left behind.
    cold_store(tmp_path, 4)
    with Engine(config(tmp_path, io_engine="threads")) as engine:
        slots = engine._ssd.slots  # type: ignore[union-attr]
        real, calls = slots.read, [0]

        def read(offset: int, buffers: Sequence[memoryview]) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected")
            real(offset, buffers)

        slots.read = read  # type: ignore[method-assign]
        buffers = [bytearray(BLOCK) for _ in range(4)]
        got = engine.get_many_into([key(i) for i in range(4)], buffers)
        slots.read = real  # type: ignore[method-assign]
        assert got == [BLOCK] * 4 and [bytes(b) for b in buffers] == [value(i) for i in range(4)]
        dram = engine.stats().tiers[0]
        assert dram.pinned == 0 and dram.entries == 4
        assert dram.used_bytes == 4 * (-(-BLOCK // PAGE) * PAGE)  # no slot lost
        assert not engine._m.inflight
