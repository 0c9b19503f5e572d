"""`kvoffload fsck DIR`: verify a store offline, or rebuild its index from the slots alone.

Verification replays checkpoint and journal exactly as an open would (without cutting torn
tails) and reads back every indexed block, checking its slot header and payload checksum.
Rebuilding ignores checkpoint and journal for the index: it scans every slot header on the
device, keeps per key the newest version (by seq) whose payload checksum holds, writes a fresh
checkpoint and retires the journals. Slot headers carry no block metadata, so the rebuild takes
it from the META records that survive in the checkpoint and journals (up to each file's first
damaged record): a kept block keeps the metadata journaled with its version (same seq). A
damaged checkpoint is set aside as ``checkpoint.damaged`` (and still read for metadata).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.errors import StorageIOError
from kvoffload.kvstore.config import PAGE, DramConfig, EngineConfig
from kvoffload.kvstore.extents import ExtentAllocator, slot_bytes
from kvoffload.kvstore.ssd.catalog import restore_slots
from kvoffload.kvstore.ssd.index import ssd_slot_bytes
from kvoffload.kvstore.ssd.metabook import MetaBook
from kvoffload.kvstore.ssd.slotio import AlignedBuffer, unpack_header
from kvoffload.kvstore.ssd.store import _write_atomic
from kvoffload.kvstore.ssd.tier import SsdTier

__all__ = ["FsckReport", "fsck"]


@dataclass
class FsckReport:
    """What fsck found and what it changed."""

    directory: str
    checkpoint_records: int = 0
    journal_records: int = 0
    torn_bytes: int = 0
    indexed_blocks: int = 0
    good_blocks: int = 0
    bad_blocks: list[tuple[str, str]] = field(default_factory=list)  # (key hex, reason)
    rebuilt: bool = False
    headers_found: int = 0  # valid slot headers seen by the rebuild scan
    superseded: int = 0  # older versions of a key
    dropped: int = 0  # newest version failed its checksum, or did not fit the slot layout
    described: int = 0  # kept blocks whose metadata the rebuild kept
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.bad_blocks and not self.torn_bytes and not self.dropped


def _open(directory: str) -> SsdTier:
    config = EngineConfig(DramConfig(prefault=False, capacity_bytes=64 << 20), data_dir=directory)
    return SsdTier(config, rank=lambda index, row: 2, read_only=True)


def fsck(directory: str, *, rebuild: bool = False) -> FsckReport:
    """Check the store in `directory` (which no process may have open).

    Raises:
        ConfigError: not a store, or in use.
        StorageIOError: the device or a file could not be read.
    """
    started = time.perf_counter()
    report = FsckReport(directory)
    try:
        tier = _open(directory)
    except StorageIOError as exc:
        checkpoint = Path(directory) / "checkpoint"
        if not rebuild or "is damaged" not in str(exc) or not checkpoint.exists():
            raise
        # The rebuild needs no checkpoint; the damaged one stays for its metadata.
        os.replace(checkpoint, Path(directory) / _DAMAGED)
        report.notes.append(f"{exc}: set aside as {_DAMAGED}")
        tier = _open(directory)
    try:
        rec = tier.recovery
        report.checkpoint_records = rec.checkpoint_records
        report.journal_records = rec.journal_records
        report.torn_bytes = rec.torn_bytes
        report.notes += rec.notes
        report.dropped += rec.rejected_rows
        report.indexed_blocks = len(tier.index)
        _verify(tier, report)
        if rebuild:
            _rebuild(tier, report)
    finally:
        tier.close(checkpoint=False)
    report.seconds = time.perf_counter() - started
    return report


def _verify(tier: SsdTier, report: FsckReport) -> None:
    buf = AlignedBuffer(slot_bytes(tier.max_value_bytes))
    try:
        for row in tier.index.live_rows():
            snap = tier.cat.snapshot(int(row))
            pages = -(-snap[2] // PAGE) * PAGE
            if tier.io.read(snap, buf.view[:pages]):
                report.good_blocks += 1
            else:
                report.bad_blocks.append((snap[0].hex(), "slot header or checksum mismatch"))
    finally:
        buf.close()


_DAMAGED = "checkpoint.damaged"
_Found = tuple[int, bytes, "bytes | None", int, int, int, str]  # seq key parent page len crc tenant


def _scan(tier: SsdTier, report: FsckReport) -> list[_Found]:
    """Every valid slot header on the device; page -1 marks a damaged payload.

    Every page is examined (an old header inside a newer, larger slot is still found; replay
    order decides). The device is read in windows that overlap by one largest slot, so a block
    that starts near a window's end is still read whole.
    """
    reach = ssd_slot_bytes(tier.max_value_bytes)
    step = max(4 << 20, reach)  # so no window reads more than twice what it advances
    buf = AlignedBuffer(step + reach)
    found: list[_Found] = []
    try:
        for start in range(0, tier.capacity, step):
            size = min(step + reach, tier.capacity - start)
            tier.slots.read(start, [buf.view[:size]])
            for at in range(0, min(step, size), PAGE):
                if bytes(buf.view[at + 4 : at + 8]) != b"KVSL":
                    continue
                header = unpack_header(buf.view[at : at + PAGE])
                if header is None:
                    continue
                report.headers_found += 1
                end = at + PAGE + header.length
                if end > size:
                    report.dropped += 1
                    continue
                intact = crc32c.crc32c(buf.view[at + PAGE : end]) == header.crc
                found.append((header.seq, header.key, header.parent,
                              (start + at) // PAGE if intact else -1, header.length, header.crc,
                              header.tenant_name))  # fmt: skip
    finally:
        buf.close()
    return found


def _rebuild(tier: SsdTier, report: FsckReport) -> None:
    newest: dict[bytes, _Found] = {}
    found = _scan(tier, report)
    for item in found:
        best = newest.get(item[1])
        if best is None or item[0] > best[0]:
            newest[item[1]] = item
    report.superseded = len(found) - len(newest)
    # A damaged newest version drops the key: an older version would be a stale value.
    kept = sorted((v for v in newest.values() if v[3] >= 0), key=lambda v: v[0])
    report.dropped += len(newest) - len(kept)
    names: dict[str, int] = {"": 0}
    recs = np.zeros(len(kept), dtype=jr.RECORD)
    for i, (seq, key, parent, page_no, length, crc, name) in enumerate(kept):
        tid = names.setdefault(name, len(names))
        recs[i] = (0, jr.PUT, jr.HAS_PARENT if parent is not None else 0, tid, seq, key,
                   parent or b"", page_no, length, crc, b"")  # fmt: skip
    # Keep only what fits the slot layout, exactly as an open would.
    ok = restore_slots(
        ExtentAllocator(tier.capacity), recs["page"], recs["length"], tier.max_value_bytes
    )
    report.dropped += int((~ok).sum())
    tenants = [jr.record(jr.TENANT, 0, tenant=i, name=n.encode()) for n, i in names.items() if i]
    metas = _surviving_meta(tier, recs[ok])
    report.described = len(metas)
    body = np.concatenate([*tenants, metas.export(), recs[ok]])
    journals = tier.files.journal_paths()
    generation = max([g for g, _ in journals] + [0]) + 1
    seq = int(recs["seq"].max()) if len(recs) else 0
    data = jr.file_header(tier.store_id, generation, seq, len(body)) + jr.pack(body)
    _write_atomic(Path(tier.dir) / "checkpoint", data, "checkpoint")
    for _, path in journals:
        path.unlink()
    report.rebuilt = True
    report.notes.append(
        f"rebuilt the index from {report.headers_found} slot headers: kept {int(ok.sum())}, "
        f"{report.superseded} older versions ignored, {report.dropped} dropped; "
        f"{report.described} kept their block metadata"
    )


def _surviving_meta(tier: SsdTier, kept: np.ndarray) -> MetaBook:
    """The metadata of the `kept` PUT records, from the META records of the same seq that the
    checkpoint (or a damaged one) and the journals still hold, each read up to its first
    damaged record. A block whose records are not all there keeps none."""
    found = []
    for path in [Path(tier.dir) / "checkpoint", Path(tier.dir) / _DAMAGED,
                 *(p for _, p in tier.files.journal_paths())]:  # fmt: skip
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageIOError(f"cannot read {path}: {exc}") from exc
        records, _ = jr.parse(data)
        found.append(records[records["type"] == jr.META])
    records = np.concatenate(found) if found else np.zeros(0, jr.RECORD)
    # A record in two files (a checkpoint and a journal it did not retire) counts once.
    records = records[np.lexsort((records["tenant"], records["seq"]))]
    first = np.ones(len(records), bool)
    first[1:] = (records["seq"][1:] != records["seq"][:-1]) | (
        records["tenant"][1:] != records["tenant"][:-1]
    )
    book = MetaBook()
    book.install(records[first], kept)
    return book
