"""Creating an SSD store is atomic: a create that fails leaves nothing behind, and every file
error names the file and what was being done. (On a real full file system:
tests/reliability/test_disk_full.py.)"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults


def config(path: Path, ssd: int = 16 << 20, slot_path: str = "") -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=ssd, path=slot_path),
        data_dir=str(path),
    )


@pytest.fixture
def no_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """posix_fallocate fails as it does on a file system with too little room."""

    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


def fault_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plan: dict[str, str]) -> Path:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(plan))
    monkeypatch.setenv(faults.ENV, str(path))
    return path


def test_failed_allocation_leaves_an_empty_data_dir_empty(
    tmp_path: Path, no_space: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(
        StorageIOError, match=r"allocating 1\.0 GiB for .*ssd\.slots: No space left on device"
    ):
        Engine(config(data, ssd=1 << 30))
    assert list(data.iterdir()) == []
    monkeypatch.undo()  # room again: a smaller store is created in the same directory
    with Engine(config(data)) as engine:
        engine.put(bytes(16), b"x" * 1000, durable=True)
    with Engine(config(data)) as engine:
        assert engine.contains(bytes(16))


def test_failed_create_removes_the_data_dir_it_made(tmp_path: Path, no_space: None) -> None:
    data = tmp_path / "new"
    with pytest.raises(StorageIOError, match="No space left"):
        Engine(config(data))
    assert list(tmp_path.iterdir()) == []


def test_failed_meta_write_removes_slot_file_and_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    plan = fault_plan(monkeypatch, tmp_path, {"meta.write": "ENOSPC"})
    with pytest.raises(StorageIOError, match=r"writing the meta .*kvoffload\.meta\.tmp: No space"):
        Engine(config(data))
    assert not data.exists()
    plan.unlink()
    with Engine(config(data)):
        pass
    assert (data / "kvoffload.meta").exists()


def test_failed_create_keeps_a_slot_file_it_did_not_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = tmp_path / "device"
    slots.write_bytes(b"\x01" * 4096)
    fault_plan(monkeypatch, tmp_path, {"journal.write": "EIO"})
    with pytest.raises(StorageIOError, match=r"writing the journal .*journal\.00000001\.tmp"):
        Engine(config(tmp_path / "data", slot_path=str(slots)))
    assert not (tmp_path / "data").exists()
    assert slots.read_bytes() == b"\x01" * 4096  # there, and no longer than before


def test_restart_that_cannot_write_its_journal_names_it_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    with Engine(config(data)) as engine:
        engine.put(bytes(16), b"v" * 5000, durable=True)
    before = sorted(p.name for p in data.iterdir())
    plan = fault_plan(monkeypatch, tmp_path, {"journal.write": "ENOSPC"})
    with pytest.raises(StorageIOError, match=r"journal\.\d{8}\.tmp: No space left on device"):
        Engine(config(data))
    assert sorted(p.name for p in data.iterdir()) == before  # the store is intact
    plan.unlink()
    with Engine(config(data)) as engine:
        assert engine.contains(bytes(16))


def test_a_bad_fault_plan_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fault_plan(monkeypatch, tmp_path, {"slot.write": "ENOTANERRNO"})
    with pytest.raises(ConfigError, match="is not an operation .* mapped to an errno name"):
        faults.check("slot.write")


def test_a_store_created_for_an_engine_that_then_fails_to_start_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.kvstore import dram as dram_module

    def no_memory(size: int, *, prefault: bool) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setattr(dram_module, "Arena", no_memory)  # the DRAM tier cannot be mapped
    with pytest.raises(ConfigError, match="cannot map a DRAM arena.*Cannot allocate memory"):
        Engine(config(data, ssd=1 << 30))
    assert list(data.iterdir()) == []
    monkeypatch.undo()
    with Engine(config(data)):  # another size is no conflict: nothing of the first was kept
        pass


KILLED_BEFORE_META = """
import os, sys
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.ssd import store as ssd

real = ssd._write_atomic
def write_atomic(path, data, what):
    if what == "meta":
        os._exit(9)  # killed between the first journal and the meta
    real(path, data, what)
ssd._write_atomic = write_atomic
Engine(EngineConfig(DramConfig(capacity_bytes=4 << 20, prefault=False),
                    SsdConfig(capacity_bytes=64 << 20), data_dir=sys.argv[1]))
"""


def test_a_create_killed_before_the_meta_is_cleared_by_the_next_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.run([sys.executable, "-c", KILLED_BEFORE_META, str(data)], timeout=120)
    assert proc.returncode == 9
    assert {p.name for p in data.iterdir()} == {"LOCK", "ssd.slots", "journal.00000001"}
    with Engine(config(data)) as engine:  # another size: the killed create left no store
        engine.put(bytes(16), b"x" * 1000, durable=True)
    with Engine(config(data)) as engine:
        assert engine.contains(bytes(16))


def test_a_directory_with_a_journal_of_blocks_but_no_meta_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Engine(config(data)) as engine:
        engine.put(bytes(16), b"x" * 1000, durable=True)
        journal = (data / "journal.00000001").read_bytes()  # holds the PUT
    for path in data.iterdir():
        if path.name not in ("LOCK", "ssd.slots"):
            path.unlink()
    (data / "journal.00000001").write_bytes(journal)
    with pytest.raises(ConfigError, match="not empty and holds no kvoffload.meta"):
        Engine(config(data))
    assert (data / "ssd.slots").exists()
