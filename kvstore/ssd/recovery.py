"""An open store: its directory, slot file, books and journals. Opening creates the store or
replays its checkpoint and journals into the books; a checkpoint snapshots the books and starts
a new journal; closing checkpoints and releases the directory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore.config import PAGE, EngineConfig
from kvoffload.kvstore.ssd.catalog import SsdCatalog, export_records
from kvoffload.kvstore.ssd.index import RankFn, ssd_slot_bytes
from kvoffload.kvstore.ssd.slotio import SlotFile
from kvoffload.kvstore.ssd.store import StoreDir

__all__ = ["Recovery", "SsdStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """What opening the store found (also what `kvoffload fsck` reports)."""

    checkpoint_records: int = 0
    journal_records: int = 0  # PUT and DEL records replayed from journals
    torn_bytes: int = 0  # cut from journal tails
    rejected_rows: int = 0  # rows whose slot lies outside the file or overlaps another
    blocks: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = ()


class SsdStore:
    """The store the SSD tier works on, from open to close."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: RankFn,
        on_removed: Callable[[bytes], None],
        lock: threading.Lock,
        read_only: bool,
        open_slots: Callable[[str, int], SlotFile],
    ) -> None:
        self.config = config
        self._lock = lock  # the engine's: checkpoint threads count their failures under it
        self.files = StoreDir(config, read_only)
        try:
            self._open(rank, on_removed, read_only, open_slots)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Close without a checkpoint, releasing the directory; a store that this open created
        is removed again (the slot file if it was made, else shrunk back)."""
        cat: SsdCatalog | None = getattr(self, "cat", None)
        journal = cat.journal if cat is not None else None
        if cat is not None:
            cat.journal = None
        if journal is not None:
            with contextlib.suppress(StorageIOError):
                journal.close()
        slots: SlotFile | None = getattr(self, "slots", None)
        if slots is not None:
            slots.discard() if self.files.creating else slots.close()
        if self.files.creating:
            self.files.undo_create()
        self.files.unlock()

    def _open(
        self,
        rank: RankFn,
        on_removed: Callable[[bytes], None],
        read_only: bool,
        open_slots: Callable[[str, int], SlotFile],
    ) -> None:
        files = self.files
        self.meta, creating = files.load_or_create_meta()
        self.capacity = self.meta.capacity_bytes // PAGE * PAGE
        largest = ssd_slot_bytes(self.meta.max_value_bytes)
        if self.capacity < largest:
            raise ConfigError(f"SSD capacity must hold at least one slot of {largest} bytes")
        self.store_id = bytes.fromhex(self.meta.store_id)
        self.max_value_bytes = self.meta.max_value_bytes
        self.cat = cat = SsdCatalog(self.config, self.capacity, self.max_value_bytes, rank,
                                    on_removed)  # fmt: skip
        slot_path = self.meta.slot_path or str(files.dir / "ssd.slots")
        self.slots = open_slots(slot_path, self.meta.capacity_bytes)
        self.recovery = self._recover()
        if not read_only:
            self._generation += 1
            if creating:
                files.made.append(files.journal_path(self._generation))
            cat.journal = self._open_journal(self._generation)
        if creating:
            files.write_meta(self.meta)

    def _recover(self) -> Recovery:
        started = time.perf_counter()
        replay = self.files.replay(self.store_id)
        self._generation = replay.generation
        rejected = self.cat.apply(replay.records)
        if rejected:
            replay.notes.append(f"{rejected} rows did not fit the slot layout and were dropped")
        self.cat.records_since_checkpoint = replay.journal_records
        return Recovery(replay.checkpoint_records, replay.journal_records, replay.torn_bytes,
                        rejected, len(self.cat.index), time.perf_counter() - started,
                        tuple(replay.notes))  # fmt: skip

    def _open_journal(self, generation: int) -> jr.Journal:
        cat = self.cat
        return self.files.open_journal(self.store_id, generation, cat.seq, cat.tenants,
                                       self.slots.flush)  # fmt: skip

    def begin_checkpoint(self) -> Callable[[], None]:
        """Snapshot the index and switch to a new journal (lock held; a numpy copy).

        Returns the slow part, to run without the lock: flush the old journal, write the
        checkpoint file atomically, delete the journals it covers.
        """
        cat = self.cat
        assert cat.journal is not None
        # Pending frees hold tickets of the current journal; settle them before it changes.
        cat.release_pending(wait=True)
        old = cat.journal
        self._generation += 1
        gen = self._generation
        body = export_records(cat)
        seq = cat.seq
        cat.journal = self._open_journal(gen)
        cat.records_since_checkpoint = 0

        def finish() -> None:
            old.close()  # the snapshot already holds its records; this only flushes them
            self.files.write_checkpoint(self.store_id, gen, seq, body)
            cat.counters.checkpoints += 1

        return finish

    def checkpoint_if_due(self) -> None:
        """Checkpoint once the journal has grown enough; the slow part runs on a thread."""
        if not self.cat.checkpoint_due():
            return
        try:
            finish = self.begin_checkpoint()
        except StorageIOError as exc:  # no new journal (disk full?): keep the current one
            log.error("checkpoint failed: %s", exc)
            self.cat.counters.io_errors += 1
            return

        def run() -> None:
            try:
                finish()
            except StorageIOError as exc:  # the old checkpoint and the journals still replay
                log.error("checkpoint failed: %s", exc)
                with self._lock:
                    self.cat.counters.io_errors += 1

        threading.Thread(target=run, name="kvoffload-checkpoint", daemon=True).start()

    def close(self, *, checkpoint: bool = True) -> None:
        """Checkpoint (optionally), flush and close the journal, release the store.

        Raises:
            StorageIOError: the checkpoint or the journal failed; the store is still released.
        """
        try:
            if self.cat.journal is not None:
                try:
                    if checkpoint:
                        self.begin_checkpoint()()
                finally:
                    journal, self.cat.journal = self.cat.journal, None
                    journal.close()
        finally:
            self.slots.close()
            self.files.unlock()
