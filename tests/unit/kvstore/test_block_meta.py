"""Block metadata in the engine: kept with the block in DRAM, on the SSD, across restarts and
checkpoints, dropped with the block, and the store format that carries it (store 3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.engine import MAX_META_BYTES
from kvoffload.kvstore.ssd import journal as jr

BLOCK = 100_000


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def meta(i: int, size: int = 70) -> bytes:
    # Sizes around the 94 bytes one META record holds, and far above it.
    return np.random.default_rng(i).bytes(size)


def config(path: Path, *, ssd: int = 64 << 20) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=2 << 20, max_value_bytes=128 << 10, prefault=False),
        SsdConfig(capacity_bytes=ssd, admission_min_uses=1, flush_on_close=True),
        data_dir=str(path),
    )


def test_meta_records_round_trip_at_every_size() -> None:
    for size in (0, 1, 93, 94, 95, 188, 189, 1000, MAX_META_BYTES):
        blob = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        packed = jr.meta_records(key(7), 42, blob)
        records, good = jr.parse(packed)
        assert good == len(packed) and set(records["type"].tolist()) == {jr.META}
        assert jr.meta_of_records(packed) == blob


def test_meta_follows_the_block_through_dram_ssd_and_restarts(tmp_path: Path) -> None:
    sizes = [10, 94, 300, 2000]
    with Engine(config(tmp_path)) as engine:
        for i in range(60):  # 6 MB through 2 MiB of DRAM: most blocks are demoted
            engine.put(key(i), bytes(BLOCK), meta=meta(i, sizes[i % 4]) if i % 5 else None,
                       parent=key(i - 1) if i else None)  # fmt: skip
        assert engine.stats().tiers[0].demotions > 0
        for i in range(60):
            assert engine.meta_of(key(i)) == (meta(i, sizes[i % 4]) if i % 5 else None)
        described = {b.key: b for b in engine.described_blocks()}
        assert set(described) == {key(i) for i in range(60) if i % 5}
        assert {t for b in described.values() for t in b.tiers} == {"ssd", "dram"}
    # Reopened from the journal, then from a checkpoint (close writes one): same metadata.
    for _ in range(2):
        with Engine(config(tmp_path)) as engine:
            blocks = engine.described_blocks()
            assert {b.key: b.meta for b in blocks} == {
                key(i): meta(i, sizes[i % 4]) for i in range(60) if i % 5
            }
            assert all(b.tiers == ("ssd",) for b in blocks)  # nothing read into DRAM yet
            got = engine.get(key(1))  # promoted: the DRAM copy carries it too
            assert got is not None
            got.release()
            assert engine.meta_of(key(1)) == meta(1, sizes[1])
            engine.checkpoint()


def test_replacing_or_deleting_a_block_replaces_or_drops_its_meta(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.put(key(1), b"a", meta=meta(1), durable=True)
        engine.put(key(2), b"b", meta=meta(2), durable=True)
        engine.put(key(3), b"c", meta=meta(3), durable=True)
        engine.put(key(1), b"a2", durable=True)  # a new value without metadata
        engine.put(key(2), b"b2", meta=meta(22), durable=True)
        assert engine.delete(key(3))
        assert engine.meta_of(key(1)) is None and engine.meta_of(key(3)) is None
    with Engine(config(tmp_path)) as engine:
        assert engine.meta_of(key(1)) is None
        assert engine.meta_of(key(2)) == meta(22)
        assert engine.meta_of(key(3)) is None and not engine.contains(key(3))
        assert [b.key for b in engine.described_blocks()] == [key(2)]


def test_bad_meta_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        with pytest.raises(InvalidArgumentError, match="metadata"):
            engine.put(key(1), b"x", meta=bytes(MAX_META_BYTES + 1))
        with pytest.raises(InvalidArgumentError, match="metadata"):
            engine.put(key(1), b"x", meta="tokens")  # type: ignore[arg-type]
        assert not engine.contains(key(1)) and engine.meta_of(key(1)) is None


def test_a_store_2_is_migrated_and_keeps_its_blocks(tmp_path: Path) -> None:
    # A store-2 directory as the previous release wrote it: the same files, no META records,
    # format "kvoffload-store-2" in its description.
    with Engine(config(tmp_path)) as engine:
        for i in range(10):
            engine.put(key(i), bytes([i]) * 1000, durable=True)
    meta_path = tmp_path / "kvoffload.meta"
    description = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**description, "format": "kvoffload-store-2"}))
    with Engine(config(tmp_path)) as engine:
        assert all(engine.get_into(key(i), bytearray(1000)) == 1000 for i in range(10))
        assert engine.described_blocks() == []
        engine.put(key(99), b"new", meta=meta(99), durable=True)
    assert json.loads(meta_path.read_text())["format"] == "kvoffload-store-3"
    with Engine(config(tmp_path)) as engine:
        assert engine.meta_of(key(99)) == meta(99)


def test_a_store_of_a_newer_format_is_refused_clearly(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.put(key(1), b"x", meta=meta(1), durable=True)
    meta_path = tmp_path / "kvoffload.meta"
    description = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**description, "format": "kvoffload-store-4"}))
    with pytest.raises(ConfigError, match="newer kvoffload"):
        Engine(config(tmp_path))
    meta_path.write_text(json.dumps(description))  # nothing was changed by the refusal
    with Engine(config(tmp_path)) as engine:
        assert engine.meta_of(key(1)) == meta(1)
