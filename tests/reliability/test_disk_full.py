"""A full disk, for real: a 64 MiB ext4 file system of the test's own (loop-mounted, so root;
CI is root; the first start also on a size-limited tmpfs) filled by the store or a filler file.
ENOSPC is reported naming the file and what was being done; nothing acknowledged is lost; the
store serves on; freeing space and restarting brings everything acknowledged back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stores import DaemonStore, EngineStore, fill, free_bytes

from kvoffload.errors import StorageIOError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SMALL = 4000  # values of the journal-filling runs: a slot page each, the journal 128 B each


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(i: int, size: int = SMALL) -> bytes:
    return np.random.default_rng(i).bytes(size)


def assert_reads_back(store: Any, acked: dict[bytes, bytes]) -> None:
    wrong = [k.hex() for k, v in acked.items() if store.get(k) != v]
    assert not wrong, f"{len(wrong)} of {len(acked)} acknowledged durable puts lost: {wrong[:5]}"


def durable_store(
    start_daemon: Callable[..., Any], data: Path
) -> tuple[DaemonStore, dict[bytes, bytes]]:
    """A daemon's store holding 20 acknowledged durable puts, and what they put."""
    store = DaemonStore(start_daemon, data, dram=4 << 20, ssd=16 << 20, env={})
    acked = {}
    for i in range(20):
        store.put(key(i), value(i), durable=True)
        acked[key(i)] = value(i)
    return store, acked


def serve_and_fail(data: Path, ssd: str) -> subprocess.CompletedProcess[str]:
    """Run `kvoffload serve` on `data`, expecting it to refuse to start."""
    argv = [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0",
            "--nvme-port", "0", "--metrics-port", "0", "--dram", "16MiB", "--ssd", ssd,
            "--data-dir", str(data)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("where", ["new-dir", "empty-dir", "new-parents"])
@pytest.mark.parametrize("small_fs", ["ext4", "tmpfs"], indirect=True)
def test_a_first_start_too_big_for_the_disk_leaves_nothing_behind(
    small_fs: Path, start_daemon: Callable[..., Any], where: str
) -> None:
    before = sorted(small_fs.iterdir())
    data = small_fs / "a" / "b" / "store" if where == "new-parents" else small_fs / "store"
    if where == "empty-dir":
        data.mkdir()
    free = free_bytes(small_fs)
    proc = serve_and_fail(data, "1GiB")
    if where == "empty-dir":
        assert sorted(data.iterdir()) == []  # left as it was found
    else:
        assert sorted(small_fs.iterdir()) == before  # made, then removed
    assert free_bytes(small_fs) >= free - (64 << 10)  # the partial slot file is gone
    assert re.search(
        rf"allocating 1\.0 GiB for {re.escape(str(data))}/ssd\.slots: No space left on device",
        proc.stderr,
    ), proc.stderr
    if where == "empty-dir":  # the store the too-big one would have blocked (once per fs)
        store = DaemonStore(start_daemon, data, dram=16 << 20, ssd=16 << 20, env={})
        store.put(key(1), value(1), durable=True)
        store.restart()
        assert store.get(key(1)) == value(1)


def test_a_journal_that_fills_the_disk_fails_durable_puts_and_loses_nothing(
    small_fs: Path, start_daemon: Callable[..., Any]
) -> None:
    data = small_fs / "store"
    store, acked = durable_store(start_daemon, data)
    filler = fill(small_fs, leave=32 << 10)
    failure: StorageIOError | None = None
    for i in range(20, 1500):  # 32 KiB hold 256 records; 1500 slots fit the 16 MiB tier
        try:
            store.put(key(i), value(i), durable=True)
        except StorageIOError as exc:
            failure = exc
            break
        acked[key(i)] = value(i)
    assert failure is not None, "the file system never filled up"
    assert re.search(rf"{re.escape(str(data))}/\S+: No space left on device", str(failure))
    # The daemon serves on: reads, and puts into DRAM; durable puts wait for a restart.
    assert_reads_back(store, acked)
    store.put(key(50_000), value(50_000))
    assert store.get(key(50_000)) == value(50_000)
    with pytest.raises(StorageIOError):
        store.put(key(50_001), value(50_001), durable=True)
    filler.unlink()
    store.crash_and_restart()  # a kill, not a clean stop: the journal on disk is all there is
    assert_reads_back(store, acked)
    store.put(key(50_002), value(50_002), durable=True)  # room again
    acked[key(50_002)] = value(50_002)
    store.restart()
    assert_reads_back(store, acked)


def test_a_checkpoint_that_does_not_fit_keeps_the_old_one_and_the_journals(
    small_fs: Path,
) -> None:
    data = small_fs / "store"
    store = EngineStore(data, dram=4 << 20, ssd=16 << 20)
    try:
        acked = {}
        for i in range(200):
            store.put(key(i), value(i), durable=True)
            acked[key(i)] = value(i)
        store.engine.checkpoint()
        old = (data / "checkpoint").read_bytes()
        for i in range(200, 1200):
            store.put(key(i), value(i), durable=True)
            acked[key(i)] = value(i)
        # Room for the next journal, not for a checkpoint of 1200 records (150 KiB).
        filler = fill(small_fs, leave=48 << 10)
        with pytest.raises(
            StorageIOError, match=r"writing the checkpoint .*checkpoint\.tmp: No space left"
        ):
            store.engine.checkpoint()
        assert (data / "checkpoint").read_bytes() == old
        assert not (data / "checkpoint.tmp").exists()
        store.put(key(5000), value(5000), durable=True)  # on the new journal
        acked[key(5000)] = value(5000)
        assert_reads_back(store, acked)
        said = store.stop()  # the checkpoint of the clean stop does not fit either
        assert "checkpoint.tmp: No space left on device" in said
        filler.unlink()
        store.restart()  # replays the old checkpoint and every journal since
        assert_reads_back(store, acked)
        assert store.engine.stats().recovery["checkpoint_records"] == 200
    finally:
        store.stop()


def test_a_restart_on_a_full_disk_names_the_file_and_changes_nothing(
    small_fs: Path, start_daemon: Callable[..., Any]
) -> None:
    data = small_fs / "store"
    store, acked = durable_store(start_daemon, data)
    assert store.stop() == ""
    files = {p.name: p.read_bytes() for p in data.iterdir() if p.name != "ssd.slots"}
    filler = fill(small_fs, leave=0)
    proc = serve_and_fail(data, "16MiB")  # a new journal needs a block
    assert re.search(
        rf"writing the journal {re.escape(str(data))}/journal\.\d{{8}}\.tmp: No space left",
        proc.stderr,
    ), proc.stderr
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.name != "ssd.slots"} == files
    filler.unlink()
    store.restart()
    assert_reads_back(store, acked)
