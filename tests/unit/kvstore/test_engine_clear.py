"""`Engine.describe` (a block's parent and metadata, for a cluster's read repair) and
`Engine.clear` (a cluster node that rejoins drops what it held), over DRAM and the SSD tier."""

from __future__ import annotations

from pathlib import Path

from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig

BLOCK = 100_000


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=1 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=16 << 20, admission_min_uses=1),
        data_dir=str(path),
    )


def test_describe_gives_parent_and_metadata_from_either_tier(tmp_path: Path) -> None:
    with Engine(_config(tmp_path)) as engine:
        engine.put(_key(0), b"a" * BLOCK)
        engine.put(_key(1), b"b" * BLOCK, parent=_key(0), meta=b"\x01meta")
        assert engine.describe(_key(1)) == (True, _key(0), b"\x01meta")
        assert engine.describe(_key(0)) == (True, None, None)
        assert engine.describe(_key(99)) == (False, None, None)
        for i in range(2, 40):  # DRAM holds ~10 blocks: the first ones move to the SSD
            engine.put(_key(i), bytes([i]) * BLOCK)
        assert engine.stats().as_dict()["tiers"][0]["demotions"] > 0  # type: ignore[index]
    with Engine(_config(tmp_path)) as engine:  # recovered: from the SSD's books alone
        assert engine.describe(_key(1)) == (True, _key(0), b"\x01meta")


def test_clear_drops_every_block_of_every_tier_for_good(tmp_path: Path) -> None:
    with Engine(_config(tmp_path)) as engine:
        for i in range(40):
            engine.put(_key(i), bytes([i]) * BLOCK, durable=i % 2 == 0)
        assert engine.clear() == 40
        assert all(engine.get(_key(i)) is None for i in range(40))
        assert engine.clear() == 0
        engine.put(_key(7), b"new" * 10)  # the store works on
    with Engine(_config(tmp_path)) as engine:  # nothing cleared comes back on a restart
        assert [i for i in range(40) if engine.contains(_key(i))] == [7]
