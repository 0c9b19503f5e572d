"""A tier listener that raises (a KV-event sink that failed) on the demotion path (issue 30,
found in review): the writer's pins and planned SSD slots are given back whatever it raises,
its error is logged once and counted (`listener_errors`), the blocks stay readable, and the
writer keeps working. A real engine over a tmp dir, on io_uring and on the thread path."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.extents import slot_bytes
from tests.unit.kvstore.test_engine_demote_batch import idle, wait_until

BLOCK = 200_000
DRAM = 4 << 20
# Puts that leave less than `demote_low` (5%) of DRAM free: the last one wakes the writer.
FILL = DRAM * 95 // 100 // slot_bytes(BLOCK) + 1

ENGINES = [
    pytest.param("io_uring", marks=pytest.mark.skipif(core.io_uring_unavailable() is not None,
                                                      reason="no io_uring")),
    "threads",
]  # fmt: skip


def key(i: int) -> bytes:
    return (9100 + i).to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(900 + i).bytes(BLOCK)


def config(path: Path, io_engine: str) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=DRAM, max_value_bytes=256 << 10, prefault=False,
                   demote_low=0.05, demote_high=0.5),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, read_depth=4,
                  io_engine=io_engine, flush_on_close=False),
        data_dir=str(path / "store"),
    )  # fmt: skip


def settled(engine: Engine) -> None:
    """No pin left in either tier, no SSD slot planned but never committed or given back."""
    ssd = engine._ssd
    assert ssd is not None
    with engine._lock:
        assert not engine._dram.pinned
        assert all(e.pins == 0 for e in (engine._dram.index.lookup(key(i)) for i in range(2 * FILL))
                   if e is not None)  # fmt: skip
        assert not ssd.pinned and not any(ssd.cat._planned.values())


@pytest.mark.parametrize("io_engine", ENGINES)
@pytest.mark.parametrize("raises_on", [("stored", "ssd"), ("removed", "dram")])
def test_a_listener_that_raises_leaves_no_pin_and_the_writer_working(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, io_engine: str,
    raises_on: tuple[str, str],
) -> None:  # fmt: skip
    calls: list[tuple[str, str]] = []

    def listener(kind: str, k: bytes, tier: str) -> None:
        calls.append((kind, tier))
        if (kind, tier) == raises_on:
            raise RuntimeError("the event sink is gone")

    caplog.set_level(logging.ERROR)
    with Engine(config(tmp_path, io_engine)) as engine:
        engine.set_tier_listener(listener)
        for i in range(FILL):  # they fit: the last one wakes the writer, none evicts
            engine.put(key(i), value(i))
        wait_until(lambda: idle(engine))
        settled(engine)
        first = engine.stats()
        assert first.demotions_background > 1 and first.demotions_inline == 0
        errors = first.listener_errors
        assert errors == calls.count(raises_on) > 1
        # The writer is alive: puts that fill the free slots again (none evicts) wake it, and
        # it demotes once more.
        more = FILL + engine._dram.free_bytes // slot_bytes(BLOCK)
        for i in range(FILL, more):
            engine.put(key(i), value(i))
        wait_until(lambda: idle(engine) and engine.stats().demotions_background
                   > first.demotions_background)  # fmt: skip
        settled(engine)
        later = engine.stats()
        assert later.listener_errors > errors and later.demotions_inline == 0
        assert later.tiers[1].io_errors == 0
        buf = bytearray(BLOCK)
        for i in range(more):  # from DRAM or from the SSD, every one whole
            assert engine.get_into(key(i), buf) == BLOCK and buf == value(i)
    # Logged once, however often it raised.
    logged = [r for r in caplog.records if "listener" in r.getMessage()]
    assert len(logged) == 1
