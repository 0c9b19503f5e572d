"""The background demotion writer in batches (issue 30): on io_uring it takes up to a ring's
depth of victims, writes them in one submission and publishes each one that was written
whole; a failed or short write of one victim leaves the others published; a victim deleted
while its batch is in flight is not published; close during an in-flight batch waits for it
and frees no buffer under it. A real engine over a tmp dir, the ring's fault seam
(KVOFFLOAD_FAULTS `ring.write`) for failures and delays."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.errors import StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults
from kvoffload.kvstore.extents import slot_bytes
from kvoffload.kvstore.ssd.fsck import fsck
from kvoffload.kvstore.ssd.ringpages import RingPages

UNAVAILABLE = core.io_uring_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no io_uring: {UNAVAILABLE}")

WAIT_S = 30  # a hang guard, never a timing assertion
BLOCK = 200_000
DRAM = 4 << 20
DEPTH = 4  # ssd.read_depth: a ring of 8 entries, batches of 4 slots
# Puts that leave less than `demote_low` (5%) of DRAM free: the last one wakes the writer.
FILL = DRAM * 95 // 100 // slot_bytes(BLOCK) + 1


def key(i: int) -> bytes:
    return (7700 + i).to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(500 + i).bytes(BLOCK)


def config(path: Path, io_engine: str = "io_uring", *, high: float = 0.5) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=DRAM, max_value_bytes=256 << 10, prefault=False,
                   demote_low=0.05, demote_high=high),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, read_depth=DEPTH,
                  io_engine=io_engine, flush_on_close=False),
        data_dir=str(path / "store"),  # the fault plan lives beside it
    )  # fmt: skip


def set_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: dict[str, object]) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(plan))
    monkeypatch.setenv(faults.ENV, str(path))


def ring_counts(engine: Engine) -> tuple[int, int]:
    ssd = engine._ssd
    assert ssd is not None and isinstance(ssd.io.pages, RingPages)
    return ssd.io.pages.counts()


def wait_until(done: Callable[[], object]) -> None:
    """Poll `done()` (a wait on the writer's progress, with a hang guard, not a clock)."""
    event = threading.Event()
    for _ in range(WAIT_S * 1000):
        if done():
            return
        event.wait(0.001)
    raise AssertionError("the demotion writer made no progress")


def idle(engine: Engine) -> bool:
    """The writer's pass is over: nothing pinned, free DRAM at the high watermark."""
    with engine._lock:
        return not engine._dram.pinned and engine._dram.free_bytes >= engine._m._high


def in_flight(engine: Engine) -> list[bytes]:
    """The victims of the batch being written (pinned by the writer), once there is one."""
    with engine._lock:
        return list(engine._dram.pinned)


def batch_in_flight(engine: Engine) -> list[bytes]:
    """The victims of the writer's first batch, seen while its (delayed) writes are in
    flight: all planned under the lock at once, so never a part of them."""
    seen: list[bytes] = []
    wait_until(lambda: seen.extend(in_flight(engine)) or seen)
    assert len(seen) == DEPTH
    return seen


def fill(engine: Engine) -> None:
    for i in range(FILL):
        engine.put(key(i), value(i))


def reopened(path: Path) -> dict[int, bytes | None]:
    """Each key's bytes in the store reopened on the thread path (DRAM cold)."""
    out: dict[int, bytes | None] = {}
    with Engine(config(path, "threads")) as engine:
        for i in range(FILL):
            buf = bytearray(BLOCK)
            got = engine.get_into(key(i), buf)
            out[i] = None if got is None else bytes(buf[:got])
        assert engine.stats().tiers[1].corrupt_blocks == 0
    return out


def test_a_batch_publishes_every_victim_once_with_its_bytes(tmp_path: Path) -> None:
    stored: Counter[bytes] = Counter()
    with Engine(config(tmp_path)) as engine:
        engine.set_tier_listener(
            lambda kind, k, tier: stored.update([k]) if (kind, tier) == ("stored", "ssd") else None
        )
        before = ring_counts(engine)
        fill(engine)
        wait_until(lambda: idle(engine))
        stats = engine.stats()
        ssd = stats.tiers[1]
        submissions, entries = (a - b for a, b in zip(ring_counts(engine), before, strict=True))
        # Enough victims to free half of DRAM, all by the writer, in batches of DEPTH slots:
        # two entries each, one submission a batch (one at a time it was one a slot).
        assert ssd.demotions == stats.demotions_background > DEPTH and stats.demotions_inline == 0
        assert entries == 2 * ssd.demotions
        assert submissions == -(-ssd.demotions // DEPTH)
        assert engine._ssd is not None and engine._ssd.write_batch == DEPTH
        assert ssd.io_errors == 0 and ssd.entries == ssd.demotions
        # Each victim published below exactly once, and every block reads back whole.
        assert len(stored) == ssd.demotions and set(stored.values()) == {1}
        buf = bytearray(BLOCK)
        for i in range(FILL):
            assert engine.get_into(key(i), buf) == BLOCK and buf == value(i)
        demoted = {int.from_bytes(k, "little") - 7700 for k in stored}
    # The SSD copies are whole after a reopen (no flush on close: only the writer's).
    got = reopened(tmp_path)
    assert {i for i, v in got.items() if v is not None} >= demoted
    assert all(got[i] == value(i) for i in demoted)
    assert fsck(str(tmp_path / "store")).clean


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param({"errno": "EIO", "entries": [3]}, id="eio-value"),
        pytest.param({"errno": "ENOSPC", "entries": [2]}, id="enospc-header"),
        pytest.param({"short": True, "entries": [3]}, id="short-value"),
    ],
)
def test_one_failed_write_in_a_batch_leaves_the_others_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: dict[str, object]
) -> None:
    # The high watermark asks for exactly one batch of DEPTH victims; the second slot of the
    # submission (entries 2 and 3) fails or comes back short.
    high = (DRAM * 0.05 + (DEPTH - 0.5) * slot_bytes(BLOCK)) / DRAM
    set_plan(tmp_path, monkeypatch, {"ring.write": fault})
    with Engine(config(tmp_path, high=high)) as engine:
        before = ring_counts(engine)
        fill(engine)
        wait_until(lambda: idle(engine))
        ssd = engine.stats().tiers[1]
        assert [a - b for a, b in zip(ring_counts(engine), before, strict=True)] == [1, 2 * DEPTH]
        # The failed victim is counted and never published, its slot given back; the
        # others are on the SSD.
        assert ssd.io_errors == 1 and ssd.demotions == ssd.entries == DEPTH - 1
        assert ssd.used_bytes == (DEPTH - 1) * (slot_bytes(BLOCK) + 4096)
        buf = bytearray(BLOCK)
        readable = [i for i in range(FILL) if engine.get_into(key(i), buf) == BLOCK]
        # The one victim that failed left DRAM with no copy below (a miss, as one at a time).
        assert len(readable) == FILL - 1
        missing = set(range(FILL)) - set(readable)
        monkeypatch.delenv(faults.ENV)
    got = reopened(tmp_path)
    assert sum(v is not None for v in got.values()) == DEPTH - 1
    assert all(v is None or v == value(i) for i, v in got.items())
    assert all(got[i] is None for i in missing)
    report = fsck(str(tmp_path / "store"))
    assert report.clean and report.good_blocks == DEPTH - 1


def test_a_victim_deleted_during_its_batch_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    high = (DRAM * 0.05 + (DEPTH - 0.5) * slot_bytes(BLOCK)) / DRAM
    # Completions reaped late: the batch stays in flight while the delete runs.
    set_plan(tmp_path, monkeypatch, {"ring.write": {"delay_s": 2.0}})
    with Engine(config(tmp_path, high=high)) as engine:
        fill(engine)
        victims = batch_in_flight(engine)
        gone = victims[1]
        assert engine.delete(gone)
        wait_until(lambda: idle(engine))
        ssd = engine.stats().tiers[1]
        assert ssd.io_errors == 0 and ssd.demotions == ssd.entries == DEPTH - 1
        assert engine.get(gone) is None
        buf = bytearray(BLOCK)
        for k in victims:
            if k != gone:
                i = int.from_bytes(k, "little") - 7700
                assert engine.get_into(k, buf) == BLOCK and buf == value(i)
        monkeypatch.delenv(faults.ENV)
    got = reopened(tmp_path)
    assert got[int.from_bytes(gone, "little") - 7700] is None
    assert sum(v is not None for v in got.values()) == DEPTH - 1
    assert fsck(str(tmp_path / "store")).clean


def test_close_during_a_batch_waits_for_it_and_frees_no_buffer_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_plan(tmp_path, monkeypatch, {"ring.write": {"delay_s": 1.0}})
    engine = Engine(config(tmp_path))
    fill(engine)
    victims = batch_in_flight(engine)
    arena = engine._dram.arena
    # close() stops the writer first: the batch in flight is reaped and completed before
    # the arena it writes from is unmapped (an unmap under it would tear those slots).
    engine.close()
    assert not [t for t in threading.enumerate() if t.name == "kvoffload-demote"]
    del arena
    monkeypatch.delenv(faults.ENV)
    got = reopened(tmp_path)
    for k in victims:
        i = int.from_bytes(k, "little") - 7700
        assert got[i] == value(i)
    assert all(v is None or v == value(i) for i, v in got.items())
    assert fsck(str(tmp_path / "store")).clean


def test_a_batch_the_ring_refuses_gives_every_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ring that broke (or could not be set up) refuses the whole submission: each planned
    # slot goes back to the allocator and the tenant's quota, as one demotion's does, instead
    # of staying allocated with no block in it until a restart.
    def broken(*args: object, **kwargs: object) -> list[int]:
        raise StorageIOError("io_uring: the ring broke")

    high = (DRAM * 0.05 + (DEPTH - 0.5) * slot_bytes(BLOCK)) / DRAM
    monkeypatch.setattr(RingPages, "submit", broken)
    with Engine(config(tmp_path, high=high)) as engine:
        fill(engine)
        wait_until(lambda: idle(engine))
        ssd = engine._ssd
        assert ssd is not None
        stats = engine.stats().tiers[1]
        assert stats.io_errors >= DEPTH and stats.demotions == stats.entries == 0
        assert stats.used_bytes == 0 and not any(ssd.cat._planned.values())
