"""EIO in slot and journal I/O, injected through KVOFFLOAD_FAULTS, through an engine in this
process and through a daemon subprocess: a failed operation is reported or served as a miss,
never as wrong data; the store keeps serving; a restart recovers every acknowledged durable
put (and no put that failed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stores import FaultPlan, io_engine, io_errors

from kvoffload.core import io_uring_unavailable
from kvoffload.errors import StorageIOError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BLOCK = 100_000  # about 40 fit the 4 MiB DRAM tier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int, version: int = 0) -> bytes:
    return np.random.default_rng(i * 1000 + version).bytes(BLOCK)


def assert_reads_back(store: Any, acked: dict[bytes, bytes]) -> None:
    wrong = [k.hex() for k, v in acked.items() if store.get(k) != v]
    assert not wrong, f"acknowledged durable puts lost: {wrong}"


def put_durable(store: Any, ids: range) -> dict[bytes, bytes]:
    for i in ids:
        store.put(key(i), value(i), durable=True)
    return {key(i): value(i) for i in ids}


def test_eio_on_demotion_loses_nothing_acknowledged(
    open_store: Callable[..., Any], fault_plan: FaultPlan, tmp_path: Path
) -> None:
    store = open_store(tmp_path / "data", env=fault_plan.env)
    acked = put_durable(store, range(3))
    fault_plan.set(slot_write="EIO")
    for i in range(10, 70):  # 6 MB through 4 MiB of DRAM: evictions demote, and fail
        store.put(key(i), value(i))
    assert io_errors(store.stats()) > 0
    for i in range(10, 70):
        assert store.get(key(i)) in (None, value(i))  # still in DRAM, or a miss
    assert_reads_back(store, acked)
    fault_plan.set()
    acked |= put_durable(store, range(100, 102))
    store.restart()
    assert_reads_back(store, acked)


def test_eio_on_promotion_is_a_counted_miss(
    open_store: Callable[..., Any], fault_plan: FaultPlan, tmp_path: Path
) -> None:
    store = open_store(tmp_path / "data", env=fault_plan.env)
    acked = put_durable(store, range(80))  # the older half is on the SSD only
    default = "threads" if io_uring_unavailable() else "io_uring"
    assert io_engine(store.stats()) == getattr(store, "io_engine", "auto").replace("auto", default)
    before = io_errors(store.stats())
    fault_plan.set(slot_read="EIO")
    got = [store.get(key(i)) for i in range(80)]
    assert all(g in (None, value(i)) for i, g in enumerate(got))
    misses = got.count(None)
    assert misses > 0 and io_errors(store.stats()) - before == misses
    fault_plan.set()
    assert_reads_back(store, acked)  # a failed read dropped nothing
    store.restart()
    assert_reads_back(store, acked)


def test_eio_on_a_durable_puts_slot_write_keeps_the_old_value(
    open_store: Callable[..., Any], fault_plan: FaultPlan, tmp_path: Path
) -> None:
    store = open_store(tmp_path / "data", env=fault_plan.env)
    acked = put_durable(store, range(3))
    fault_plan.set(slot_write="EIO")
    with pytest.raises(StorageIOError, match=r"ssd\.slots.*Input/output error"):
        store.put(key(1), value(1, version=1), durable=True)
    assert store.get(key(1)) == value(1)
    fault_plan.set()
    acked |= put_durable(store, range(3, 6))  # the tier takes durable puts again
    assert_reads_back(store, acked)
    store.restart()
    assert_reads_back(store, acked)


@pytest.mark.parametrize(
    ("op", "said"),
    [
        ("journal_sync", r"syncing journal .*journal\.\d{8}: Input/output error"),
        ("journal_write", r"appending to journal .*journal\.\d{8}: Input/output error"),
        ("slot_flush", r"flushing .*ssd\.slots: Input/output error"),
    ],
)
def test_eio_in_the_group_commit_fails_the_put_for_good(
    open_store: Callable[..., Any], fault_plan: FaultPlan, tmp_path: Path, op: str, said: str
) -> None:
    store = open_store(tmp_path / "data", env=fault_plan.env)
    acked = put_durable(store, range(80))  # key 1 is on the SSD only by now
    fault_plan.set(**{op: "EIO"})
    with pytest.raises(StorageIOError, match=said):
        store.put(key(1), value(1, version=1), durable=True)
    assert store.get(key(1)) == value(1)  # its old copy, still indexed
    fault_plan.set()
    # Which records reached the device is unknown after a failed sync: the journal takes no
    # more durable puts until the store is reopened.
    with pytest.raises(StorageIOError):
        store.put(key(99), value(99), durable=True)
    store.put(key(100), value(100))  # fast puts and reads go on
    assert store.get(key(100)) == value(100)
    assert_reads_back(store, acked)
    store.restart()
    assert_reads_back(store, acked)  # key 1 has its old value: the failed put did not return
    assert store.get(key(99)) is None
    acked |= put_durable(store, range(110, 112))
    store.restart()
    assert_reads_back(store, acked)


def test_eio_on_the_checkpoint_keeps_the_old_one_and_the_journals(
    open_store: Callable[..., Any], fault_plan: FaultPlan, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    store = open_store(data, env=fault_plan.env)
    acked = put_durable(store, range(10))
    assert store.restart() == ""  # a clean stop writes a checkpoint
    old = (data / "checkpoint").read_bytes()
    acked |= put_durable(store, range(10, 20))
    fault_plan.set(checkpoint_write="EIO")
    said = store.stop()  # the checkpoint of a clean stop fails, and says so
    assert "writing the checkpoint" in said and "checkpoint.tmp: Input/output error" in said
    assert (data / "checkpoint").read_bytes() == old and not (data / "checkpoint.tmp").exists()
    fault_plan.set()
    store.restart()
    assert_reads_back(store, acked)


def test_eio_on_an_engine_checkpoint_leaves_the_engine_serving(
    fault_plan: FaultPlan, tmp_path: Path
) -> None:
    from stores import EngineStore

    store = EngineStore(tmp_path / "data", dram=4 << 20, ssd=32 << 20)
    try:
        acked = put_durable(store, range(10))
        fault_plan.set(checkpoint_write="EIO")
        with pytest.raises(StorageIOError, match=r"checkpoint\.tmp: Input/output error"):
            store.engine.checkpoint()
        acked |= put_durable(store, range(10, 20))  # on the new journal
        assert_reads_back(store, acked)
        fault_plan.set()
        assert store.restart() == ""
        assert_reads_back(store, acked)
    finally:
        store.stop()
