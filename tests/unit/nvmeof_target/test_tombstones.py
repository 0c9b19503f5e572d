"""`Tombstones`: a read repair is stored only where the key is absent, was not deleted within
the retention, and the node is not holding repairs (it just dropped its blocks)."""

from __future__ import annotations

from pathlib import Path

from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.tombstones import Tombstones

K1, K2, K3 = (bytes([i]) * 16 for i in (1, 2, 3))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(tmp_path: Path) -> Engine:
    return Engine(
        EngineConfig(DramConfig(capacity_bytes=1 << 20, prefault=False), data_dir=str(tmp_path))
    )


def _repair(engine: Engine, stones: Tombstones, key: bytes, value: bytes) -> bool:
    reservation = engine.reserve(key, len(value))
    reservation.buffer[:] = value
    return stones.commit_repair(key, reservation)


def test_a_repair_lands_only_where_the_key_is_absent(tmp_path: Path) -> None:
    stones = Tombstones(clock=Clock())
    with _engine(tmp_path) as engine:
        assert _repair(engine, stones, K1, b"copy")
        assert bytes(engine.get(K1).data) == b"copy"  # type: ignore[union-attr]
        engine.put(K2, b"newer")
        assert not _repair(engine, stones, K2, b"older")  # never over a value
        assert bytes(engine.get(K2).data) == b"newer"  # type: ignore[union-attr]


def test_a_repair_after_a_delete_is_refused_until_the_retention_ends(tmp_path: Path) -> None:
    clock = Clock()
    stones = Tombstones(retention_s=60, clock=clock)
    with _engine(tmp_path) as engine:
        engine.put(K1, b"old")
        stones.deleting(K1)
        engine.delete(K1)
        assert not _repair(engine, stones, K1, b"old")
        assert engine.get(K1) is None
        clock.now += 59
        assert not _repair(engine, stones, K1, b"old")
        clock.now += 2  # past the retention: the tombstone is gone
        assert _repair(engine, stones, K1, b"old")
        assert len(stones) == 0


def test_the_oldest_tombstones_go_past_the_bound(tmp_path: Path) -> None:
    stones = Tombstones(max_keys=2, clock=Clock())
    with _engine(tmp_path) as engine:
        for key in (K1, K2, K3):
            stones.deleting(key)
        assert len(stones) == 2
        assert _repair(engine, stones, K1, b"x")  # the oldest went
        assert not _repair(engine, stones, K2, b"x")


def test_a_hold_refuses_every_repair_for_its_time(tmp_path: Path) -> None:
    clock = Clock()
    stones = Tombstones(hold_s=30, clock=clock)
    with _engine(tmp_path) as engine:
        assert _repair(engine, stones, K1, b"x")  # a new node takes repairs at once
        stones.hold()
        assert not _repair(engine, stones, K2, b"x")
        assert engine.get(K2) is None
        clock.now += 31
        assert _repair(engine, stones, K2, b"x")
