from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvoffload.errors import StorageIOError
from kvoffload.kvstore.ssd import journal as jr

STORE = bytes(range(16))


def _records(n: int) -> bytes:
    recs = [jr.record(jr.PUT, i + 1, i.to_bytes(16, "little"), page=i, length=i * 10, pcrc=i)
            for i in range(n)]  # fmt: skip
    return jr.pack(np.concatenate(recs))


def test_pack_parse_round_trip() -> None:
    data = _records(50)
    records, good = jr.parse(data)
    assert good == len(data) == 50 * jr.RECORD_BYTES
    assert records["seq"].tolist() == list(range(1, 51))
    assert records["page"][7] == 7 and records["length"][7] == 70


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_torn_or_corrupt_tail_stops_parsing(damage: str) -> None:
    data = bytearray(_records(20))
    if damage == "truncate":
        data = data[: 17 * jr.RECORD_BYTES + 60]
    elif damage == "flip":
        data[17 * jr.RECORD_BYTES + 30] ^= 0x10
    else:
        data += os.urandom(300)
    records, good = jr.parse(bytes(data))
    assert len(records) == (17 if damage != "garbage" else 20)
    assert good == len(records) * jr.RECORD_BYTES


def test_read_file_checks_owner_and_reports_tail(tmp_path: Path) -> None:
    path = tmp_path / "journal.00000001"
    path.write_bytes(jr.file_header(STORE, 1, 0) + _records(5) + b"torn")
    replay = jr.read_file(str(path), STORE)
    assert len(replay.records) == 5 and replay.dropped_bytes == 4 and replay.generation == 1
    with pytest.raises(StorageIOError, match="another store"):
        jr.read_file(str(path), bytes(16))
    (tmp_path / "junk").write_bytes(b"not a journal")
    with pytest.raises(StorageIOError, match="not a kvoffload journal"):
        jr.read_file(str(tmp_path / "junk"), STORE)


def test_durable_appends_from_many_threads(tmp_path: Path) -> None:
    journal = jr.Journal(str(tmp_path / "j"), sync_interval=0.01)
    late: list[int] = []

    def writer() -> None:
        for _ in range(20):
            ticket = journal.append(_records(1), durable=True)
            if journal.durable_ticket < ticket:
                late.append(ticket)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    journal.close()
    assert not late, "a durable append returned before its batch was synced"
    records, _ = jr.parse((tmp_path / "j").read_bytes())
    assert len(records) == 160


def test_one_sync_covers_everything_queued(tmp_path: Path) -> None:
    journal = jr.Journal(str(tmp_path / "j"), sync_interval=10)
    synced: list[int] = []
    real = journal._sync
    journal._sync = lambda fd: (synced.append(fd), real(fd))[1]
    for _ in range(50):
        journal.append(_records(1))  # fast: queued, no waiting
    assert synced == []
    journal.append(_records(1), durable=True)  # one group commit for all 51
    assert synced == [journal._fd]
    journal.close()
    assert len(jr.parse((tmp_path / "j").read_bytes())[0]) == 51


def test_write_failure_fails_waiters_and_later_appends(tmp_path: Path) -> None:
    journal = jr.Journal(str(tmp_path / "j"))

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    journal._write = full_disk
    with pytest.raises(StorageIOError, match="No space left"):
        journal.append(_records(1), durable=True)
    with pytest.raises(StorageIOError):
        journal.append(_records(1))
    with pytest.raises(StorageIOError):
        journal.close()
