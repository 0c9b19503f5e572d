"""The background demotion writer: a real engine with a small DRAM arena and an SSD tier in a
tmp dir; the SSD slowed through the fault seam (KVOFFLOAD_FAULTS, `delay:<s>`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults
from kvoffload.nvmeof_target.config import load_config
from kvoffload.nvmeof_target.metrics import Metrics

BLOCK = 100_000
DRAM = 4 << 20  # ~38 blocks' slots: a 100-block burst demotes ~60 of them


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def config(path: Path, *, background: bool = True, flush: bool = True) -> EngineConfig:
    return EngineConfig(
        DramConfig(
            capacity_bytes=DRAM,
            max_value_bytes=256 << 10,
            prefault=False,
            demote_background=background,
        ),
        SsdConfig(capacity_bytes=64 << 20, flush_on_close=flush),
        data_dir=str(path / "data"),  # the fault plan lives beside it
    )


def writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvoffload-demote"]


def slow_ssd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every slot write waits `seconds` first (set before the engine opens its slot file)."""
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"slot.write": f"delay:{seconds}"}))
    monkeypatch.setenv(faults.ENV, str(plan))


def all_readable(engine: Engine, keys: range) -> bool:
    buf = bytearray(BLOCK)
    return all(engine.get_into(key(i), buf) == BLOCK and buf == value(i) for i in keys)


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("demote_low", -0.1, r"demote_low must be in \[0, 0.5\]"),
        ("demote_high", 0.9, r"demote_high must be in \[0, 0.5\]"),
        ("demote_low", "5%", "demote_low must be a fraction"),
        ("demote_high", True, "demote_high must be a fraction"),
        ("demote_background", "yes", "demote_background must be true or false"),
    ],
)
def test_watermarks_are_validated(field: str, bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DramConfig(**{field: bad})


def test_low_watermark_above_high_is_refused() -> None:
    with pytest.raises(ConfigError, match="must not exceed dram.demote_high"):
        DramConfig(demote_low=0.3, demote_high=0.2)
    DramConfig(demote_low=0, demote_high=0)  # the writer only makes room a request needs


def settled(engine: Engine) -> bool:
    """Whether free DRAM is back above the low watermark: a claim below it woke the writer,
    which frees up to the high one before it rests."""
    dram = engine.stats().tiers[0]
    return dram.capacity_bytes - dram.used_bytes >= 0.05 * DRAM


def test_put_burst_larger_than_dram_is_demoted_in_background(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        assert len(writers()) == 1
        for i in range(100):
            engine.put(key(i), value(i))
            # Puts no faster than the writer writes (a wait on its progress, not on a clock).
            while not settled(engine):
                threading.Event().wait(0.001)
        stats = engine.stats()
        # Every demotion was written by the writer: no request wrote one on its own thread.
        assert stats.demotions_inline == stats.room_waits == 0
        assert stats.demotions_background == stats.tiers[0].demotions >= 50
        assert all_readable(engine, range(100))
    assert writers() == []


def test_an_unpaced_burst_is_whole_and_readable(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(100):  # faster than the SSD: requests may write victims themselves
            engine.put(key(i), value(i))
        stats = engine.stats()
        assert stats.demotions_background + stats.demotions_inline == stats.tiers[0].demotions
        assert stats.tiers[0].demotions >= 50
        assert all_readable(engine, range(100))


def test_inline_mode_demotes_on_the_requests_thread(tmp_path: Path) -> None:
    with Engine(config(tmp_path, background=False)) as engine:
        assert writers() == []
        for i in range(100):
            engine.put(key(i), value(i))
        stats = engine.stats()
        assert stats.demotions_background == 0
        # Each was a wait on the SSD for the request that needed the room.
        assert stats.room_waits == stats.demotions_inline == stats.tiers[0].demotions >= 50
        assert all_readable(engine, range(100))


def test_a_slow_ssd_makes_requests_wait_never_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_ssd(tmp_path, monkeypatch, 0.03)
    with Engine(config(tmp_path, flush=False)) as engine:
        for i in range(60):  # 30 ms a slot write, microseconds a put
            engine.put(key(i), value(i))
        stats = engine.stats()
        # Requests that found no room wrote their victim (one slot write each) and went on.
        assert stats.room_waits == stats.demotions_inline > 0 and stats.room_wait_seconds > 0
        assert stats.demotions_background > 0
        assert all_readable(engine, range(60))


def test_a_pinned_block_stays_in_dram_under_its_reader(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        engine.put(key(0), value(0))
        view = engine.get(key(0))
        assert view is not None
        with view:
            for i in range(1, 100):
                engine.put(key(i), value(i))
            assert bytes(view.data) == value(0)
            with engine._lock:
                assert key(0) in engine._dram.pinned
                entry = engine._m.index.lookup(key(0))
                assert entry is not None and not entry.on_ssd  # never written, never moved
        assert all_readable(engine, range(100))


def test_close_during_heavy_demotion_loses_no_acknowledged_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_ssd(tmp_path, monkeypatch, 0.01)
    done: dict[int, bool] = {}  # acknowledged puts (durable ones True)
    failed: list[BaseException] = []
    engine = Engine(config(tmp_path))
    started = threading.Barrier(3)

    def put(first: int) -> None:
        started.wait()
        for i in range(first, first + 1000):
            try:
                engine.put(key(i), value(i), durable=i % 7 == 0)
            except KVOffloadError:
                return  # the engine closed: this put was not acknowledged
            except BaseException as exc:
                failed.append(exc)
                return
            done[i] = i % 7 == 0

    threads = [threading.Thread(target=put, args=(n * 1000,)) for n in (1, 2)]
    for t in threads:
        t.start()
    started.wait()
    while len(done) < 80:  # DRAM overflowed twice: the writer is busy, requests write too
        threading.Event().wait(0.01)
    assert engine.stats().room_waits > 0
    engine.close()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert failed == [] and writers() == []
    monkeypatch.delenv(faults.ENV)
    with Engine(config(tmp_path)) as again:  # the clean close flushed the rest
        buf = bytearray(BLOCK)
        for i in done:
            assert again.get_into(key(i), buf) == BLOCK and buf == value(i), i


def test_ssd_quota_counts_writes_in_flight(tmp_path: Path) -> None:
    """Two writes planned before either commits (the writer's and a request's) must not both
    fit a quota that holds one more block."""
    with Engine(config(tmp_path)) as engine:
        ssd = engine._ssd
        assert ssd is not None
        slot = 4096 + -(-BLOCK // 4096) * 4096
        engine.set_quota("a", None, ssd_bytes=3 * slot)
        for i in range(2):
            engine.put(key(i), value(i), tenant="a", durable=True)
        with engine._lock:
            plans = [ssd.plan_write(key(10 + i), BLOCK, None, "a") for i in range(2)]
            for plan in plans:
                ssd.commit_write(plan)
            assert ssd.tenant_usage()["a"] <= 3 * slot


def test_demotion_counters_are_prometheus_counters(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        for i in range(60):
            engine.put(key(i), value(i))
        text = generate_latest(Metrics(lambda: engine.stats().as_dict()).registry).decode()
    assert "# TYPE kvoffload_engine_demotions_background_total counter" in text
    assert "# TYPE kvoffload_engine_demotions_inline_total counter" in text
    assert "# TYPE kvoffload_engine_room_wait_seconds_total counter" in text


@pytest.mark.parametrize("bad", ["delay:", "delay:soon", "delay:61", "delay:-1"])
def test_a_bad_delay_in_the_fault_plan_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"slot.write": bad}))
    monkeypatch.setenv(faults.ENV, str(plan))
    with pytest.raises(ConfigError, match="delay:<seconds>"):
        faults.check("slot.write")


def test_the_keys_load_from_the_one_config_tree(tmp_path: Path) -> None:
    env = {"KVOFFLOAD_DRAM__DEMOTE_LOW": "0.02", "KVOFFLOAD_DRAM__DEMOTE_BACKGROUND": "false",
           "KVOFFLOAD_DATA_DIR": str(tmp_path)}  # fmt: skip
    dram = load_config(None, env).dram
    assert (dram.demote_low, dram.demote_high, dram.demote_background) == (0.02, 0.10, False)
    with pytest.raises(ConfigError, match="demote_low .0.2. must not exceed"):
        load_config(None, {**env, "KVOFFLOAD_DRAM__DEMOTE_LOW": "0.2"})
