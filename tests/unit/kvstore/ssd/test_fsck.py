"""`kvoffload fsck`: verification, and rebuilding the index from slot headers alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvoffload.cli import main
from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.ssd.fsck import fsck


def config(path: Path) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=128 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1),
        data_dir=str(path),
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int, v: int = 0) -> bytes:
    rng = np.random.default_rng(i * 7 + v)
    return rng.bytes(int(rng.integers(1, 100_000)))


def index_of(path: Path) -> dict[bytes, tuple[int, int, int]]:
    """key -> (page, length, seq) as an open replays it."""
    with Engine(config(path)) as engine:
        ssd = engine._ssd
        assert ssd is not None
        rows = ssd.index.rows
        out = {
            ssd.index.key_of(int(r)): (int(rows["page"][r]), int(rows["length"][r]),
                                       int(rows["seq"][r]))
            for r in ssd.index.live_rows()
        }  # fmt: skip
        engine.config = EngineConfig(  # close without flushing or checkpointing anew
            config(path).dram, SsdConfig(capacity_bytes=64 << 20, flush_on_close=False),
            data_dir=str(path),
        )  # fmt: skip
    return out


def populate(path: Path, crash: bool) -> None:
    engine = Engine(config(path))
    for i in range(60):
        engine.put(key(i), value(i), parent=key(i - 1) if i else None, tenant=f"t{i % 3}",
                   durable=i % 2 == 0)  # fmt: skip
    for i in range(0, 60, 5):
        engine.put(key(i), value(i, 1), durable=True)  # new versions
    for i in range(1, 60, 7):
        engine.delete(key(i))
    if crash:
        engine._ssd.close(checkpoint=False)  # type: ignore[union-attr]  # no final checkpoint
        engine._ssd = None
    engine.close()


@pytest.mark.parametrize("crash", [False, True])
def test_clean_store_verifies(tmp_path: Path, crash: bool) -> None:
    populate(tmp_path, crash)
    report = fsck(str(tmp_path))
    assert report.clean and not report.rebuilt
    assert report.good_blocks == report.indexed_blocks > 0
    assert (report.journal_records > 0) == crash


@pytest.mark.parametrize("crash", [False, True])
def test_rebuild_from_slot_headers_matches_the_journal(tmp_path: Path, crash: bool) -> None:
    populate(tmp_path, crash)
    before = index_of(tmp_path)
    report = fsck(str(tmp_path), rebuild=True)
    assert report.rebuilt and report.headers_found >= len(before)
    assert not list(tmp_path.glob("journal.*"))
    assert index_of(tmp_path) == before
    with Engine(config(tmp_path)) as engine:
        for i in range(60):
            buf = bytearray(100_000)
            n = engine.get_into(key(i), buf)
            durable = i % 2 == 0 or i % 5 == 0
            if i % 7 == 1:
                assert n is None  # deleted blocks stay deleted
            elif durable or not crash:  # a crash may lose blocks that were only in DRAM
                assert n is not None and bytes(buf[:n]) == value(i, 1 if i % 5 == 0 else 0)
            elif n is not None:
                assert bytes(buf[:n]) == value(i)


def test_rebuild_keeps_the_newest_version(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.put(key(1), value(1, 0), durable=True)
        engine.put(key(1), value(1, 1), durable=True)  # the old slot keeps its old header
    report = fsck(str(tmp_path), rebuild=True)
    assert report.superseded == 1
    with Engine(config(tmp_path)) as engine:
        buf = bytearray(100_000)
        n = engine.get_into(key(1), buf)
        assert n is not None and bytes(buf[:n]) == value(1, 1)


def test_damage_is_found_and_rebuild_drops_it(tmp_path: Path) -> None:
    populate(tmp_path, crash=False)
    page = min(page for page, _, _ in index_of(tmp_path).values())  # a live block's slot
    slots = tmp_path / "ssd.slots"
    with open(slots, "r+b") as fh:
        data = bytearray(fh.read())
    data[page * 4096 + 4096 + 10] ^= 0xFF  # its payload
    slots.write_bytes(bytes(data))
    report = fsck(str(tmp_path))
    assert len(report.bad_blocks) == 1 and not report.clean
    rebuilt = fsck(str(tmp_path), rebuild=True)
    assert rebuilt.dropped >= 1
    assert fsck(str(tmp_path)).clean


def test_cli_reports_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    populate(tmp_path, crash=True)
    assert main(["fsck", str(tmp_path)]) == 0
    assert "clean" in capsys.readouterr().out
    journal = max(tmp_path.glob("journal.*"))
    with open(journal, "ab") as fh:
        fh.write(b"\x01" * 50)  # a torn tail
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["torn_bytes"] == 50
    assert main(["fsck", str(tmp_path), "--rebuild"]) == 0
    assert "rebuilt" in capsys.readouterr().out
    with pytest.raises(ConfigError):
        fsck(str(tmp_path / "nothing"))
