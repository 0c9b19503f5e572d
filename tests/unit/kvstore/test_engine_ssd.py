"""The engine with its SSD tier: tiering, restarts, durability, faults, prefetch, admission."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvoffload import core
from kvoffload.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    StorageIOError,
)
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig

BLOCK = 200_000
# KVOFFLOAD_PURE_PYTHON=1 or a kernel that refuses io_uring: the ring cases have nothing to run.
IO_ENGINES = [
    pytest.param("io_uring", marks=pytest.mark.skipif(core.io_uring_unavailable() is not None,
                                                      reason="no io_uring")),
    "threads",
]  # fmt: skip


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int, version: int = 0) -> bytes:
    return np.random.default_rng(i * 1000 + version).bytes(BLOCK)


def config(path: Path, *, admit: int = 1, flush: bool = True, policy: str = "lru",
           ssd: int = 64 << 20, io_engine: str = "auto",
           background: bool = True) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, policy=policy,
                   prefault=False, demote_background=background),
        SsdConfig(capacity_bytes=ssd, admission_min_uses=admit, flush_on_close=flush,
                  io_engine=io_engine),
        data_dir=str(path),
    )  # fmt: skip


def read(engine: Engine, i: int) -> bytes | None:
    buf = bytearray(BLOCK)
    n = engine.get_into(key(i), buf)
    return None if n is None else bytes(buf[:n])


def slot_file(path: Path) -> Path:
    return path / "ssd.slots"


def test_working_set_larger_than_dram_is_served_from_ssd(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(60):  # 12 MB through a 4 MiB DRAM tier
            engine.put(key(i), value(i), parent=key(i - 1) if i else None)
        dram, ssd = engine.stats().tiers
        assert dram.entries < 60 and dram.demotions > 0 and ssd.entries == dram.demotions
        assert engine.lookup([key(i) for i in range(60)]) == 60
        assert all(read(engine, i) == value(i) for i in range(60))
        dram, ssd = engine.stats().tiers
        assert ssd.hits > 0 and dram.promotions == ssd.hits and ssd.corrupt_blocks == 0
        assert dram.used_bytes <= dram.capacity_bytes and ssd.used_bytes <= ssd.capacity_bytes


def test_data_survives_a_clean_restart(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(40):
            engine.put(key(i), value(i))
        engine.delete(key(3))
        engine.put(key(4), value(4, version=1))
    with Engine(config(tmp_path)) as engine:
        recovery = engine.recovery
        assert recovery is not None and recovery.blocks == 39 and recovery.torn_bytes == 0
        assert read(engine, 3) is None
        assert read(engine, 4) == value(4, version=1)
        assert all(read(engine, i) == value(i) for i in range(40) if i not in (3, 4))


def test_without_flush_only_demoted_blocks_survive(tmp_path: Path) -> None:
    with Engine(config(tmp_path, flush=False)) as engine:
        for i in range(40):
            engine.put(key(i), value(i))
        on_ssd = engine.stats().tiers[1].entries
    with Engine(config(tmp_path, flush=False)) as engine:
        survivors = [i for i in range(40) if read(engine, i) is not None]
        # The background writer may demote more before close stops it; never all of them.
        assert on_ssd <= len(survivors) < 40
        assert all(read(engine, i) == value(i) for i in survivors)


def test_reopen_without_size_uses_the_stores_geometry(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.put(key(1), value(1))
    plain = EngineConfig(DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10,
                                    prefault=False), data_dir=str(tmp_path))  # fmt: skip
    with Engine(plain) as engine:
        assert read(engine, 1) == value(1)
        assert engine.stats().tiers[1].capacity_bytes > 0


def test_durable_put_is_on_ssd_before_it_returns(tmp_path: Path) -> None:
    with Engine(config(tmp_path, admit=5)) as engine:
        engine.put(key(1), value(1), durable=True)
        stats = engine.stats()
        assert stats.durable_puts == 1 and stats.tiers[1].entries == 1
        # The journal record is on disk now; a second process could replay it.
        journals = list(tmp_path.glob("journal.*"))
        assert journals and max(p.stat().st_size for p in journals) >= 256


def test_corrupted_slot_is_a_counted_miss(tmp_path: Path) -> None:
    with Engine(config(tmp_path, flush=True)) as engine:
        for i in range(3):
            engine.put(key(i), value(i), durable=True)
    with open(slot_file(tmp_path), "r+b") as fh:  # flip payload bytes of every slot
        data = bytearray(fh.read())
        for start in range(4096, len(data), 4096 * 8):
            data[start + 100] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    with Engine(config(tmp_path)) as engine:
        got = [read(engine, i) for i in range(3)]
        assert all(g is None or g == value(i) for i, g in enumerate(got))
        ssd = engine.stats().tiers[1]
        assert ssd.corrupt_blocks == got.count(None) > 0
        assert engine.lookup([key(i) for i in range(3)]) < 3  # the bad copies are gone


def eio_on(plan: Path, op: str | None) -> None:
    """Make every slot operation `op` fail with EIO (None: none), through the fault seam that
    both I/O engines honour (KVOFFLOAD_FAULTS)."""
    tmp = plan.with_suffix(".tmp")
    tmp.write_text(json.dumps({op: "EIO"} if op else {}))
    os.replace(tmp, plan)


@pytest.mark.parametrize("io_engine", IO_ENGINES)
def test_eio_on_durable_put_fails_it_and_keeps_older_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_engine: str
) -> None:
    plan = tmp_path / "faults.json"
    eio_on(plan, None)
    monkeypatch.setenv("KVOFFLOAD_FAULTS", str(plan))
    with Engine(config(tmp_path / "data", io_engine=io_engine)) as engine:
        engine.put(key(1), value(1), durable=True)
        engine.put(key(2), value(2), durable=True)
        assert engine.stats().tiers[1].io_engine == io_engine
        eio_on(plan, "slot.write")
        with pytest.raises(StorageIOError, match="Input/output error"):
            engine.put(key(2), value(2, version=1), durable=True)
        with pytest.raises(StorageIOError):
            engine.put(key(3), value(3), durable=True)
        eio_on(plan, None)
        assert read(engine, 1) == value(1)
        assert read(engine, 2) == value(2)  # the failed put left the old value
        assert read(engine, 3) is None
        assert engine.stats().tiers[1].io_errors == 2


@pytest.mark.parametrize("io_engine", IO_ENGINES)
def test_eio_on_demotion_loses_only_that_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_engine: str
) -> None:
    plan = tmp_path / "faults.json"
    eio_on(plan, None)
    monkeypatch.setenv("KVOFFLOAD_FAULTS", str(plan))
    with Engine(config(tmp_path / "data", io_engine=io_engine)) as engine:
        engine.put(key(0), value(0), durable=True)
        eio_on(plan, "slot.write")
        for i in range(1, 40):
            engine.put(key(i), value(i))  # evictions try to demote, and fail
        eio_on(plan, None)
        assert read(engine, 0) == value(0)
        assert engine.stats().tiers[1].io_errors > 0
        for i in range(1, 40):
            got = read(engine, i)
            assert got is None or got == value(i)


def test_full_disk_on_the_journal_fails_durable_puts(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    engine.put(key(1), value(1), durable=True)
    ssd = engine._ssd
    assert ssd is not None and ssd.journal is not None

    def enospc(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    ssd.journal._write = enospc
    with pytest.raises(StorageIOError, match="No space left"):
        engine.put(key(2), value(2), durable=True)
    assert read(engine, 1) == value(1)
    with pytest.raises(StorageIOError):
        engine.close()
    with Engine(config(tmp_path)) as again:
        assert read(again, 1) == value(1)


def test_durable_put_flushes_its_slot_before_its_record_is_synced(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        ssd = engine._ssd
        assert ssd is not None and ssd.journal is not None
        journal_fd = ssd.journal._fd
        calls: list[str] = []
        real_flush, real_sync = ssd.slots._fdatasync, ssd.journal._sync
        ssd.slots._fdatasync = lambda fd: (calls.append("slots"), real_flush(fd))[1]
        ssd.journal._sync = lambda fd: (calls.append("journal"), real_sync(fd))[1]
        engine.put(key(1), value(1), durable=True)
        assert calls and calls[-2:] == ["slots", "journal"]
        assert journal_fd == ssd.journal._fd
    with Engine(config(tmp_path)) as again:
        assert read(again, 1) == value(1)


def test_failed_slot_flush_fails_durable_puts_and_keeps_older_blocks(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    engine.put(key(1), value(1), durable=True)
    ssd = engine._ssd
    assert ssd is not None

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    # Which slots reached the device is unknown after a failed flush: the tier stops taking
    # durable puts rather than acknowledge one it cannot vouch for.
    ssd.slots._fdatasync = eio
    with pytest.raises(StorageIOError, match="Input/output error"):
        engine.put(key(2), value(2), durable=True)
    with pytest.raises(StorageIOError):
        engine.put(key(3), value(3), durable=True)
    assert read(engine, 1) == value(1)
    assert read(engine, 2) is None and read(engine, 3) is None
    for i in range(10, 40):  # fast puts go on; their demotions fail and count
        engine.put(key(i), value(i))
    assert all(read(engine, i) in (None, value(i)) for i in range(10, 40))
    assert engine.stats().tiers[1].io_errors > 2
    with pytest.raises(StorageIOError):
        engine.close()
    with Engine(config(tmp_path)) as again:
        assert read(again, 1) == value(1)


def test_ssd_quota_evicts_only_the_tenants_own_coldest_blocks(tmp_path: Path) -> None:
    # Demotions on the requests' thread: the usage read before close must still hold after it.
    with Engine(config(tmp_path, background=False)) as engine:
        ssd = engine._ssd
        assert ssd is not None
        slot = 4096 + -(-BLOCK // 4096) * 4096  # a header page and the value's pages
        quota = 6 * slot
        engine.set_quota("a", None, ssd_bytes=quota)
        for i in range(100, 110):  # tenant b: no quota
            engine.put(key(i), value(i), tenant="b", durable=True)
        for i in range(40):  # durable puts go to the SSD at once
            engine.put(key(i), value(i), tenant="a", durable=True)
            used = engine.stats().ssd_tenant_bytes
            assert used["a"] <= quota and used["b"] == 10 * slot
        on_ssd = [i for i in range(40) if ssd.find(key(i)) != -1]
        assert 39 in on_ssd and 4 <= len(on_ssd) <= 6 and 0 not in on_ssd
        assert engine.stats().tiers[1].evictions >= 34
        assert all(ssd.find(key(i)) != -1 for i in range(100, 110))  # b lost nothing
        assert read(engine, on_ssd[0]) == value(on_ssd[0])
        # (Reading promotes, which may demote a's blocks and so evict others of a's there.)
        assert all(read(engine, i) in (None, value(i)) for i in range(40))
        before = engine.stats().ssd_tenant_bytes
    with Engine(config(tmp_path)) as again:  # the accounting is rebuilt from the index
        assert again.stats().ssd_tenant_bytes == before


def test_quota_arguments_are_checked(tmp_path: Path) -> None:
    dram_only = Engine(EngineConfig(DramConfig(capacity_bytes=4 << 20, prefault=False)))
    with dram_only, pytest.raises(InvalidArgumentError, match="SSD tier"):
        dram_only.set_quota("a", None, ssd_bytes=1 << 20)
    with Engine(config(tmp_path)) as engine:
        with pytest.raises(InvalidArgumentError, match="negative"):
            engine.set_quota("a", None, ssd_bytes=-1)
        engine.set_quota("a", None, ssd_bytes=100)  # smaller than one slot
        with pytest.raises(CapacityError, match="SSD quota"):
            engine.put(key(1), value(1), tenant="a", durable=True)
        assert read(engine, 1) is None


def test_torn_journal_tail_is_cut_and_reported(tmp_path: Path) -> None:
    with Engine(config(tmp_path, flush=False)) as engine:
        engine.checkpoint()
        for i in range(5):
            engine.put(key(i), value(i), durable=True)
        journal = max(tmp_path.glob("journal.*"))
        engine._ssd.close(checkpoint=False)  # type: ignore[union-attr]  # a crash: no checkpoint
        engine._ssd = None
    with open(journal, "ab") as fh:
        fh.write(os.urandom(77))
    with Engine(config(tmp_path)) as engine:
        recovery = engine.recovery
        assert recovery is not None
        assert recovery.torn_bytes == 77 and recovery.journal_records >= 5
        assert all(read(engine, i) == value(i) for i in range(5))


def test_prefetch_promotes_in_background_once(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(40):
            engine.put(key(i), value(i))
        cold = [i for i in range(40) if not engine._index.lookup(key(i))][:8]  # fits in DRAM
        assert len(cold) == 8
        keys = [key(i) for i in cold]
        assert engine.prefetch(keys + [key(999)]) == 8
        assert engine.prefetch(keys) == 8  # queued or in flight: not read twice
        deadline = time.monotonic() + 30
        while engine.stats().tiers[0].prefetches < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        dram = engine.stats().tiers[0]
        assert dram.prefetches == dram.promotions == 8
        assert all(read(engine, i) == value(i) for i in cold)
        assert engine.stats().tiers[0].promotions == 8  # the reads found them in DRAM


def test_admission_filter_keeps_one_hit_blocks_off_the_ssd(tmp_path: Path) -> None:
    with Engine(config(tmp_path, admit=2)) as engine:
        for i in range(10):
            engine.put(key(i), value(i))
            assert read(engine, i) == value(i)  # used twice: admitted
        for i in range(10, 40):
            engine.put(key(i), value(i))  # used once
        stats = engine.stats()
        assert stats.admission_rejected > 0
        assert engine.lookup([key(i) for i in range(10)]) == 10  # the reused blocks are kept


def test_prefix_policy_on_both_tiers(tmp_path: Path) -> None:
    # Demotion inline: with the background writer still moving blocks into the full SSD after
    # `lookup`, its evictions could take a chain block before it is read (a flaky miss, seen
    # 1 in 15 on threads and 8 in 15 once slot writes went through io_uring).
    cfg = config(tmp_path, policy="prefix", ssd=8 << 20, background=False)
    with Engine(cfg) as engine:
        chain = [key(100 + i) for i in range(8)]
        for i, k in enumerate(chain):
            engine.put(k, value(100 + i), parent=chain[i - 1] if i else None)
        for i in range(60):
            engine.put(key(i), value(i))
        hit = engine.lookup(chain)
        assert all(read(engine, 100 + j) == value(100 + j) for j in range(hit))


def test_bad_data_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="parent"):
        Engine(config(tmp_path / "missing" / "store"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "photo.jpg").write_bytes(b"not ours")
    with pytest.raises(ConfigError, match="not a kvoffload store"):
        Engine(config(foreign))
    with Engine(config(tmp_path / "store")), pytest.raises(ConfigError, match="in use"):
        Engine(config(tmp_path / "store"))
    with pytest.raises(ConfigError, match="created with capacity_bytes"):
        Engine(config(tmp_path / "store", ssd=32 << 20))
    (tmp_path / "store" / "kvoffload.meta").write_text("{broken")
    with pytest.raises(ConfigError, match="store description"):
        Engine(config(tmp_path / "store"))
    with pytest.raises(ConfigError, match="data directory"):
        EngineConfig(ssd=SsdConfig(capacity_bytes=1 << 30))


def test_durable_needs_ssd() -> None:
    engine = Engine(EngineConfig(DramConfig(capacity_bytes=8 << 20, prefault=False)))
    with engine, pytest.raises(InvalidArgumentError, match="SSD tier"):
        engine.put(key(1), b"x", durable=True)


def test_tier_listener_follows_blocks_across_tiers(tmp_path: Path) -> None:
    heard: list[tuple[str, bytes, str]] = []
    with Engine(config(tmp_path)) as engine:
        engine.set_tier_listener(lambda kind, k, tier: heard.append((kind, k, tier)))
        engine.put(key(0), value(0), durable=True)
        # The SSD copy is stable before the block is published in DRAM.
        assert heard == [("stored", key(0), "ssd"), ("stored", key(0), "dram")]
        for i in range(1, 30):
            engine.put(key(i), value(i))
        moves = [(kind, tier) for kind, k, tier in heard if k == key(1)]
        # The put, then a demotion.
        assert moves == [("stored", "dram"), ("stored", "ssd"), ("removed", "dram")]
        heard.clear()
        assert read(engine, 1) == value(1)
        assert ("stored", key(1), "dram") in heard  # a promotion
        engine.delete(key(1))
        assert not [h for h in heard if h[0] == "removed" and h[1] == key(1)]  # caller's own


def test_ssd_tier_holds_mixed_sizes(tmp_path: Path) -> None:
    # Values of 16-256 KiB through 4 MiB of DRAM into 32 MiB of SSD, 3x over: the SSD keeps
    # most of its capacity live (size-classed slabs kept one or two classes' worth).
    rng = np.random.default_rng(3)
    with Engine(config(tmp_path, ssd=32 << 20)) as engine:
        for i in range(700):
            engine.put(key(i), bytes(int(rng.integers(16 << 10, 256 << 10))))
        ssd = engine.stats().tiers[1]
        assert ssd.evictions > 0
        assert ssd.stored_bytes >= 0.85 * ssd.capacity_bytes


def test_store_format_1_opens_and_is_upgraded(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(30):
            engine.put(key(i), value(i), durable=True)
    meta_path = tmp_path / "kvoffload.meta"
    meta = json.loads(meta_path.read_text())
    meta.update(format="kvoffload-store-1", slab_bytes=2 << 20, class_growth=1.05)
    meta_path.write_text(json.dumps(meta))
    with Engine(config(tmp_path)) as engine:
        assert all(read(engine, i) == value(i) for i in range(30))
    assert json.loads(meta_path.read_text())["format"] == "kvoffload-store-3"
    meta_path.write_text(json.dumps({**meta, "format": "kvoffload-store-9"}))
    with pytest.raises(ConfigError, match="unknown store format"):
        Engine(config(tmp_path))


def test_a_closed_engine_has_no_ssd_tier_left(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    engine.put(key(1), value(1), durable=True)
    open_put = engine.reserve(key(1), BLOCK)  # a front's reservation left open across close
    open_put.array[:] = np.frombuffer(value(1, 1), dtype=np.uint8)
    engine.close()
    assert [t.name for t in engine.stats().tiers] == ["dram"]
    with pytest.raises(InvalidArgumentError, match="SSD tier"):
        engine.set_quota("a", None, ssd_bytes=1 << 20)
    engine.set_quota("new tenant", 1 << 20)  # no SSD books to touch
    # Committed after close: refused (it would be in no tier), and the closed SSD tier is not
    # touched; the reopened store has the durable value.
    with pytest.raises(KVOffloadError, match="closed"):
        open_put.commit()
    with Engine(config(tmp_path)) as reopened:
        assert read(reopened, 1) == value(1)
