"""`kvoffload fsck --rebuild` keeps block metadata: slot headers carry none, so the rebuild takes
it from the META records that survive in the checkpoint and journals; a restarted daemon then
still announces and replays the blocks with their token ids."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from kvoffload.client_sdk import BlockMeta
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.ssd.fsck import fsck
from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events.publisher import KVEvents

BLOCK = 100_000


def config(path: Path) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=2 << 20, max_value_bytes=128 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, flush_on_close=True),
        data_dir=str(path),
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def meta(i: int) -> BlockMeta:
    # Block 3's metadata spans several META records (300 token ids).
    tokens = tuple(range(i * 1000, i * 1000 + (300 if i == 3 else 16)))
    return BlockMeta(tokens, block_hash=i + 100, parent_hash=i + 99 if i else None)


def populate(path: Path, crash: bool) -> None:
    engine = Engine(config(path))
    for i in range(12):
        engine.put(key(i), bytes([i]) * BLOCK, parent=key(i - 1) if i else None,
                   meta=meta(i).encode(), durable=True)  # fmt: skip
    engine.put(key(5), b"new" * 1000, parent=key(4), meta=meta(50).encode(), durable=True)
    if crash:  # no final checkpoint: the metadata is only in the journal
        engine._ssd.close(checkpoint=False)  # type: ignore[union-attr]
        engine._ssd = None
    engine.close()


def announced(path: Path) -> dict[int, dict[str, object]]:
    """What a daemon restarted on the store announces (and replays), by block hash."""
    events = KVEvents(EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*"))
    try:
        with Engine(config(path)) as engine:
            events.announce(engine.described_blocks())
        batches = [msgpack.unpackb(p)[1] for _, _, p in events.snapshot()]
    finally:
        asyncio.run(events.close())
    return {e["block_hashes"][0]: e for batch in batches for e in batch}


@pytest.mark.parametrize("damage", ["checkpoint", "journal_tail", "none"])
def test_rebuild_keeps_the_token_ids(tmp_path: Path, damage: str) -> None:
    populate(tmp_path, crash=damage == "journal_tail")
    if damage == "checkpoint":  # cut in half: an open refuses it, the rebuild sets it aside
        checkpoint = tmp_path / "checkpoint"
        data = checkpoint.read_bytes()
        checkpoint.write_bytes(data[: len(data) // 2])
        with pytest.raises(Exception, match="damaged"):
            Engine(config(tmp_path))
    elif damage == "journal_tail":
        with open(max(tmp_path.glob("journal.*")), "ab") as fh:
            fh.write(b"\x05" * 77)
    report = fsck(str(tmp_path), rebuild=True)
    assert report.rebuilt
    # A checkpoint cut in half lost the metadata of some blocks (META records come first in
    # it, PUTs after; the journals were retired): those are announced without being named.
    if damage != "checkpoint":
        assert report.described == 12
    got = announced(tmp_path)
    assert got, "nothing announced after the rebuild"
    for i in range(12):
        m = meta(50 if i == 5 else i)
        event = got.get(m.block_hash)
        if event is None:
            assert damage == "checkpoint"
            continue
        assert event["token_ids"] == list(m.token_ids)  # the version the slot holds
        assert event["parent_block_hash"] == m.parent_hash
    assert meta(5).block_hash not in got  # the older version's metadata is not revived
    if damage == "checkpoint":
        assert (tmp_path / "checkpoint.damaged").exists()
        assert report.described == len(got) > 0
