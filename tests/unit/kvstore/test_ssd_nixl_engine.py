"""The engine's SSD tier on each slot I/O backend: the thread path ("posix") and NIXL's POSIX
backend ("nixl-posix") must keep the same promises (put/get through the SSD, restarts,
corruption is a counted miss, I/O faults fail only what they touch, slot flush before journal
sync).

The NIXL cases skip where NIXL is not installed, unless KVOFFLOAD_REQUIRE_NIXL=1 (CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvoffload.errors import StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults

needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
    reason="NIXL not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1; "
    "CI sets KVOFFLOAD_REQUIRE_NIXL=1)",
)
BACKENDS = ["posix", pytest.param("nixl-posix", marks=needs_nixl)]
BLOCK = 150_000


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int, version: int = 0) -> bytes:
    return np.random.default_rng(i * 1000 + version).bytes(BLOCK)


def config(path: Path, io: str, *, flush: bool = True) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=2 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(
            capacity_bytes=32 << 20, admission_min_uses=1, flush_on_close=flush, io_backend=io
        ),  # fmt: skip
        data_dir=str(path),
    )


def read(engine: Engine, i: int) -> bytes | None:
    buf = bytearray(BLOCK)
    n = engine.get_into(key(i), buf)
    return None if n is None else bytes(buf[:n])


def fault_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fault plan's path, named before the engine opens (the thread path wraps its calls
    then); no faults until the file is written, none once it is removed."""
    path = tmp_path / "faults.json"
    monkeypatch.setenv(faults.ENV, str(path))
    return path


@pytest.mark.parametrize("io", BACKENDS)
def test_working_set_larger_than_dram_round_trips_through_ssd(tmp_path: Path, io: str) -> None:
    with Engine(config(tmp_path, io)) as engine:
        for i in range(40):  # 6 MB through a 2 MiB DRAM tier
            engine.put(key(i), value(i))
        dram, ssd = engine.stats().tiers
        assert dram.demotions > 0 and ssd.entries == dram.demotions
        assert all(read(engine, i) == value(i) for i in range(40))
        dram, ssd = engine.stats().tiers
        assert ssd.hits > 0 and dram.promotions == ssd.hits
        assert ssd.corrupt_blocks == ssd.io_errors == 0


@pytest.mark.parametrize("io", BACKENDS)
def test_restart_keeps_blocks_and_deletes(tmp_path: Path, io: str) -> None:
    with Engine(config(tmp_path, io)) as engine:
        for i in range(20):
            engine.put(key(i), value(i), durable=i % 3 == 0)
        engine.delete(key(3))
        engine.put(key(4), value(4, version=1))
    with Engine(config(tmp_path, io)) as engine:
        assert engine.recovery is not None and engine.recovery.blocks == 19
        assert read(engine, 3) is None
        assert read(engine, 4) == value(4, version=1)
        assert all(read(engine, i) == value(i) for i in range(20) if i not in (3, 4))


@needs_nixl
def test_a_store_moves_between_backends(tmp_path: Path) -> None:
    with Engine(config(tmp_path, "posix")) as engine:
        for i in range(20):
            engine.put(key(i), value(i))
    with Engine(config(tmp_path, "nixl-posix")) as engine:
        assert all(read(engine, i) == value(i) for i in range(20))
        engine.put(key(20), value(20), durable=True)
    with Engine(config(tmp_path, "posix", flush=False)) as engine:
        assert all(read(engine, i) == value(i) for i in range(21))


@pytest.mark.parametrize("io", BACKENDS)
def test_corrupted_slots_are_counted_misses(tmp_path: Path, io: str) -> None:
    with Engine(config(tmp_path, io)) as engine:
        for i in range(3):
            engine.put(key(i), value(i), durable=True)
    with open(tmp_path / "ssd.slots", "r+b") as fh:  # flip a payload byte of every slot
        data = bytearray(fh.read())
        for start in range(4096, len(data), 4096 * 8):
            data[start + 100] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    with Engine(config(tmp_path, io)) as engine:
        got = [read(engine, i) for i in range(3)]
        assert all(g is None or g == value(i) for i, g in enumerate(got))
        ssd = engine.stats().tiers[1]
        assert ssd.corrupt_blocks == got.count(None) > 0 and ssd.io_errors == 0
        assert engine.lookup([key(i) for i in range(3)]) == 3 - got.count(None)


@pytest.mark.parametrize("io", BACKENDS)
def test_eio_on_slot_writes_fails_that_put_and_keeps_older_blocks(
    tmp_path: Path, io: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = fault_plan(tmp_path, monkeypatch)
    with Engine(config(tmp_path, io)) as engine:
        engine.put(key(1), value(1), durable=True)
        plan.write_text(json.dumps({"slot.write": "EIO"}))
        with pytest.raises(StorageIOError, match=r"write to .*ssd.slots at \d+ failed"):
            engine.put(key(1), value(1, version=1), durable=True)
        for i in range(10, 30):  # demotions fail and count; the blocks stay in DRAM or go
            engine.put(key(i), value(i))
        plan.unlink()
        assert read(engine, 1) == value(1)  # the failed put left the old value
        assert all(read(engine, i) in (None, value(i)) for i in range(10, 30))
        assert engine.stats().tiers[1].io_errors >= 2
        engine.put(key(2), value(2), durable=True)  # the device works again
    with Engine(config(tmp_path, io)) as engine:
        assert read(engine, 1) == value(1) and read(engine, 2) == value(2)


@pytest.mark.parametrize("io", BACKENDS)
def test_eio_on_slot_reads_is_a_miss_that_keeps_the_block(
    tmp_path: Path, io: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Engine(config(tmp_path, io)) as engine:
        for i in range(3):
            engine.put(key(i), value(i), durable=True)
    plan = fault_plan(tmp_path, monkeypatch)
    with Engine(config(tmp_path, io)) as engine:  # DRAM is cold
        plan.write_text(json.dumps({"slot.read": "EIO"}))
        assert read(engine, 0) is None
        ssd = engine.stats().tiers[1]
        assert ssd.io_errors == 1 and ssd.corrupt_blocks == 0
        plan.unlink()
        assert read(engine, 0) == value(0)  # not dropped: the device failed, not the block


@pytest.mark.parametrize("io", BACKENDS)
def test_durable_put_flushes_its_slot_before_its_record_is_synced(tmp_path: Path, io: str) -> None:
    with Engine(config(tmp_path, io)) as engine:
        ssd = engine._ssd
        assert ssd is not None and ssd.journal is not None
        calls: list[str] = []
        real_flush, real_sync = ssd.slots._fdatasync, ssd.journal._sync
        ssd.slots._fdatasync = lambda fd: (calls.append("slots"), real_flush(fd))[1]
        ssd.journal._sync = lambda fd: (calls.append("journal"), real_sync(fd))[1]
        engine.put(key(1), value(1), durable=True)
        assert calls[-2:] == ["slots", "journal"]
    with Engine(config(tmp_path, io, flush=False)) as again:
        assert read(again, 1) == value(1)


@needs_nixl
def test_nixl_engine_registers_the_arena_once(tmp_path: Path) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlPages

    with Engine(config(tmp_path, "nixl-posix")) as engine:
        for i in range(30):
            engine.put(key(i), value(i))
        assert all(read(engine, i) == value(i) for i in range(30))
        ssd = engine._ssd
        assert ssd is not None and isinstance(ssd.io.pages, NixlPages)
        stats = ssd.io.pages.files.stats()
        assert stats.requests > 30 and stats.temp_registrations == 0
        assert stats.failed_transfers == 0


@pytest.mark.parametrize("io", BACKENDS)
def test_a_batched_get_reads_its_ssd_blocks_through_either_backend(tmp_path: Path, io: str) -> None:
    with Engine(config(tmp_path, io)) as engine:
        for i in range(12):
            engine.put(key(i), value(i), durable=True)
    with Engine(config(tmp_path, io)) as engine:  # DRAM cold: every block is on the SSD only
        bufs = [bytearray(BLOCK) for _ in range(12)]
        assert engine.get_many_into([key(i) for i in range(12)], bufs) == [BLOCK] * 12
        assert [bytes(b) for b in bufs] == [value(i) for i in range(12)]
        ssd = engine.stats().tiers[1]
        assert ssd.hits == 12 and ssd.corrupt_blocks == ssd.io_errors == 0
