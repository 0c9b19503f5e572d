"""The SSD tier's journal and checkpoints: fixed-size checksummed records, group commit.

Every record is 128 bytes, little-endian, CRC32C over bytes 4..127:

====== ===== ==============================================================
offset bytes field
====== ===== ==============================================================
0      4     CRC32C of bytes 4..127
4      1     type: 1 PUT, 2 DEL, 3 TENANT, 4 FILE (journal/checkpoint header), 5 META
5      1     flags (bit 0: the block has a parent)
6      2     tenant id
8      8     seq (global order of changes; for FILE: the covered seq)
16     16    key (FILE: magic + format version)
32     16    parent key (FILE: store id)
48     4     slot start page (FILE: journal generation)
52     4     value length (FILE: records that follow, for checkpoints)
56     4     CRC32C of the value
60     68    tenant name (TENANT), NUL-padded
====== ===== ==============================================================

A META record carries a slice of a block's metadata (store format 3): bytes 6..7 hold the
slice's number, seq and key are those of the PUT it describes, and bytes 32..127 are 96 bytes
of ``u16 length ‖ metadata``, zero-padded, cut into as many records as needed. META records
precede their PUT in the same batch, so a PUT that replays has all of its metadata.

Fixed records make replay a vectorised numpy pass: a million records parse in well under a
second. A torn or corrupt tail stops replay at the last good record and is cut.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import crc32c
import numpy as np
import numpy.typing as npt

import kvoffload.kvstore.faults as faults
from kvoffload.errors import StorageIOError

__all__ = [
    "DEL",
    "FILE",
    "META",
    "PUT",
    "RECORD",
    "RECORD_BYTES",
    "TENANT",
    "Journal",
    "Replay",
    "file_header",
    "meta_of_records",
    "meta_records",
    "parse",
    "pack",
]

log = logging.getLogger(__name__)

PUT, DEL, TENANT, FILE, META = 1, 2, 3, 4, 5
HAS_PARENT = 1
RECORD = np.dtype(
    [
        ("crc", "<u4"),
        ("type", "u1"),
        ("flags", "u1"),
        ("tenant", "<u2"),
        ("seq", "<u8"),
        ("key", "S16"),
        ("parent", "S16"),
        ("page", "<u4"),
        ("length", "<u4"),
        ("pcrc", "<u4"),
        ("name", "S68"),
    ]
)
RECORD_BYTES = RECORD.itemsize
assert RECORD_BYTES == 128
FILE_MAGIC = b"kvoffload-jrnl-1"
META_SLICE = RECORD_BYTES - 32  # metadata bytes per META record
_META_HEAD = np.dtype([("crc", "<u4"), ("type", "u1"), ("flags", "u1"), ("part", "<u2"),
                       ("seq", "<u8"), ("key", "S16"), ("body", "V96")])  # fmt: skip
assert _META_HEAD.itemsize == RECORD_BYTES
MAX_META_BYTES = 0xFFFF


def meta_records(key: bytes, seq: int, meta: bytes) -> bytes:
    """`meta` as packed META records for the PUT of `key` at `seq` (CRCs filled in)."""
    assert len(meta) <= MAX_META_BYTES
    body = len(meta).to_bytes(2, "little") + meta
    count = -(-len(body) // META_SLICE)
    recs = np.zeros(count, dtype=_META_HEAD)
    recs["type"] = META
    recs["part"] = np.arange(count)
    recs["seq"] = seq
    recs["key"] = key
    recs["body"] = np.frombuffer(body.ljust(count * META_SLICE, b"\0"), dtype="V96")
    return pack(recs.view(RECORD))


def meta_of_records(packed: bytes) -> bytes:
    """The metadata that `meta_records` packed (records in part order)."""
    if len(packed) == RECORD_BYTES:  # the common case: one record
        return packed[34 : 34 + int.from_bytes(packed[32:34], "little")]
    raw = b"".join(packed[i + 32 : i + RECORD_BYTES] for i in range(0, len(packed), RECORD_BYTES))
    return raw[2 : 2 + int.from_bytes(raw[:2], "little")]


_CRC_CHUNK = 1 << 16  # records per bulk CRC pass (bounds the temporary bytes objects)


def _crcs(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint32]:
    """CRC32C of bytes 4..127 of each 128-byte row. One C call per record over bytes objects
    made in bulk: indexing numpy scalars per record cost twice as much (a checkpoint of 1M
    blocks holds 2M records)."""
    items = np.ascontiguousarray(rows[:, 4:]).view(f"V{RECORD_BYTES - 4}")[:, 0].tolist()
    return np.fromiter(map(crc32c.crc32c, items), np.uint32, len(items))


def _rows(data: bytes | bytearray | memoryview, count: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(data, np.uint8, count=count * RECORD_BYTES).reshape(count, RECORD_BYTES)


def pack(records: npt.NDArray[np.void]) -> bytes:
    """Fill in each record's CRC and return the bytes to append."""
    raw = bytearray(records.tobytes())
    if len(records) <= 8:  # a put's few records: numpy calls would cost more than they save
        view = memoryview(raw)
        for start in range(0, len(raw), RECORD_BYTES):
            crc = crc32c.crc32c(view[start + 4 : start + RECORD_BYTES])
            view[start : start + 4] = crc.to_bytes(4, "little")
        return bytes(raw)
    rows = _rows(raw, len(records))
    crcs = rows[:, :4].view("<u4")[:, 0]
    for at in range(0, len(records), _CRC_CHUNK):
        crcs[at : at + _CRC_CHUNK] = _crcs(rows[at : at + _CRC_CHUNK])
    return bytes(raw)


def record(
    kind: int,
    seq: int,
    key: bytes = b"",
    *,
    parent: bytes | None = None,
    page: int = 0,
    length: int = 0,
    pcrc: int = 0,
    tenant: int = 0,
    name: bytes = b"",
) -> npt.NDArray[np.void]:
    """One record as a length-1 array (CRC still zero; `pack` fills it)."""
    out = np.zeros(1, dtype=RECORD)
    out[0] = (0, kind, HAS_PARENT if parent is not None else 0, tenant, seq, key,
              parent or b"", page, length, pcrc, name)  # fmt: skip
    return out


def file_header(store_id: bytes, generation: int, covered_seq: int, count: int = 0) -> bytes:
    return pack(
        record(FILE, covered_seq, FILE_MAGIC, parent=store_id, page=generation, length=count)
    )


def parse(data: bytes | memoryview) -> tuple[npt.NDArray[np.void], int]:
    """The valid records at the start of `data`, and how many bytes they span.

    Parsing stops at the first partial record or CRC mismatch (a torn or corrupt tail).
    """
    whole = len(data) // RECORD_BYTES
    records = np.frombuffer(data, dtype=RECORD, count=whole)
    rows = _rows(data, whole)
    good = whole
    for at in range(0, whole, _CRC_CHUNK):
        got = _crcs(rows[at : at + _CRC_CHUNK])
        bad = np.flatnonzero(got != records["crc"][at : at + _CRC_CHUNK])
        if len(bad):
            good = at + int(bad[0])
            break
    return records[:good], good * RECORD_BYTES


@dataclass(frozen=True)
class Replay:
    """What reading one journal or checkpoint file found."""

    records: npt.NDArray[np.void]  # valid records after the FILE header
    generation: int
    covered_seq: int
    declared: int  # record count the header declares (checkpoints)
    dropped_bytes: int  # bytes after the last good record (torn or corrupt tail)


def read_file(path: str, store_id: bytes) -> Replay:
    """Parse a journal or checkpoint file written by this store.

    Raises:
        StorageIOError: unreadable, no valid header, or written by another store.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise StorageIOError(f"cannot read {path}: {exc}") from exc
    records, good = parse(data)
    if not len(records) or int(records["type"][0]) != FILE or records["key"][0] != FILE_MAGIC:
        raise StorageIOError(f"{path} is not a kvoffload journal or checkpoint")
    if bytes(records["parent"][0]).ljust(16, b"\x00") != store_id:
        raise StorageIOError(f"{path} belongs to another store")
    head = records[0]
    return Replay(records[1:], int(head["page"]), int(head["seq"]), int(head["length"]),
                  len(data) - good)  # fmt: skip


class Journal:
    """Append-only journal with group commit.

    `append` queues packed records; one committer thread writes whatever has queued in a single
    `write` and, when a waiter asked for durability (or `sync_interval` passed), calls
    fdatasync. Many concurrent durable puts thus share one sync. `before_sync` runs before
    each sync: the SSD tier flushes its slot file there, so the slots that a batch's records
    name are stable before the records are, with one device flush for the whole batch.
    """

    def __init__(
        self,
        path: str,
        *,
        sync_interval: float = 0.05,
        before_sync: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self._before_sync = before_sync
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageIOError(f"opening journal {path}: {exc.strerror}") from exc
        self._interval = sync_interval
        # File length on stable storage: a failure cuts the journal back to it (committer only).
        self._synced_bytes = self._bytes = os.fstat(self._fd).st_size
        self._cond = threading.Condition()
        self._pending: list[bytes] = []
        self._queued = 0  # batches queued so far; a batch's number is its ticket
        self._written = 0  # batches written
        self._durable = 0  # batches on stable storage
        self._want = 0  # highest ticket somebody waits on
        self._error: StorageIOError | None = None  # the first failure; the journal stays failed
        self._closing = False
        self._last_sync = time.monotonic()
        # Fault-injection seams: tests replace these, or name a plan in KVOFFLOAD_FAULTS.
        self._write = faults.wrap("journal.write", os.write)
        self._sync = faults.wrap("journal.sync", os.fdatasync)
        self._thread = threading.Thread(target=self._run, name="kvoffload-journal", daemon=True)
        self._thread.start()

    def append(self, data: bytes, *, durable: bool = False) -> int:
        """Queue records; with `durable`, return only once they are on stable storage.
        Returns the batch's ticket for `wait`.

        Raises:
            StorageIOError: the journal failed earlier or while waiting.
        """
        with self._cond:
            self._raise_if_failed()
            self._pending.append(data)
            self._queued += 1
            ticket = self._queued
            self._cond.notify_all()
        if durable:
            self.wait(ticket)
        return ticket

    def wait(self, ticket: int | None = None) -> None:
        """Block until batch `ticket` (default: everything queued) is durable.

        Raises:
            StorageIOError: the journal failed.
        """
        with self._cond:
            target = self._queued if ticket is None else ticket
            self._want = max(self._want, target)
            self._cond.notify_all()
            while self._durable < target:
                self._raise_if_failed()
                self._cond.wait()

    @property
    def durable_ticket(self) -> int:
        """Every batch up to this ticket is on stable storage."""
        with self._cond:
            return self._durable

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            # A fresh exception per caller: waiters on several threads raise it at once.
            raise StorageIOError(str(self._error)) from self._error.__cause__

    def _due(self) -> bool:
        return time.monotonic() - self._last_sync >= self._interval

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._pending
                    or self._want > self._durable
                    or (self._written > self._durable and self._due())
                    or self._closing
                ):
                    self._cond.wait(timeout=self._interval)
                if self._closing and not self._pending and self._written == self._durable:
                    return
                batch, self._pending = self._pending, []
                upto = self._queued
                sync = self._want > self._durable or self._closing or self._due()
            doing = "appending to"
            try:
                if batch:
                    self._write_all(b"".join(batch))
                if sync:
                    if self._before_sync is not None:
                        doing = "flushing the slot file before syncing"
                        self._before_sync()
                    doing = "syncing"
                    self._sync(self._fd)
                    self._synced_bytes = self._bytes
            except (OSError, StorageIOError) as exc:
                # Records that never became durable were never acknowledged: cut them (and a
                # partly written one), so a reopen does not bring back puts that failed.
                # Nothing is appended after a failure; if the cut fails too, replay still
                # stops at a torn record.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._synced_bytes)
                if isinstance(exc, OSError):
                    error = StorageIOError(f"{doing} journal {self.path}: {exc.strerror or exc}")
                    error.__cause__ = exc
                else:
                    error = StorageIOError(f"{exc} (journal {self.path} stopped)")
                    error.__cause__ = exc.__cause__ or exc
                log.error("%s", error)
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                self._written = upto
                if sync:
                    self._durable = upto
                    self._last_sync = time.monotonic()
                self._cond.notify_all()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self._write(self._fd, view)
            self._bytes += n
            view = view[n:]

    def close(self) -> None:
        """Write and sync everything queued, then stop the committer.

        Raises:
            StorageIOError: the journal failed (what was queued may be lost).
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        os.close(self._fd)
        with self._cond:
            self._raise_if_failed()
