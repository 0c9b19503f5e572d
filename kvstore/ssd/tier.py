"""The SSD tier: a preallocated slot file, its books (`kvstore.ssd.catalog`), the store's
files (`kvstore.ssd.store`), and the coarse operations the engine calls.

Every operation expects the engine's lock held and holds it again on return; those that do
I/O (`write_through`, `demote`, `read_into`, `wipe`) release it meanwhile, on a slot set aside
or a row pinned beforehand. Nothing here knows about DRAM.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.errors import StorageIOError
from kvoffload.kvstore.config import EngineConfig
from kvoffload.kvstore.ssd.catalog import WritePlan, restore_slots
from kvoffload.kvstore.ssd.index import EMPTY, RankFn
from kvoffload.kvstore.ssd.nixl_io import SlotBackend
from kvoffload.kvstore.ssd.recovery import Recovery, SsdStore
from kvoffload.kvstore.ssd.store import META_NAME
from kvoffload.kvstore.tier import TierStats

__all__ = ["META_NAME", "Recovery", "SsdRead", "SsdTier", "SsdWipe", "WritePlan", "restore_slots"]

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class SsdRead:
    """A block being read back (`find_block` .. `finish_read`): its row as it was indexed."""

    row: int
    snap: tuple[bytes, int, int, int, int]  # key, page, length, seq, crc
    parent: bytes | None
    tenant: str
    meta: bytes | None = None

    @property
    def length(self) -> int:
        return self.snap[2]


@dataclass(frozen=True, slots=True)
class SsdWipe:
    """A deleted block's slot, kept out of reuse until its header page is wiped."""

    key: bytes
    journal: jr.Journal
    ticket: int
    offset: int
    size: int


class SsdTier:
    """Blocks on SSD: who is where (index), how to find room (allocator + eviction), and how
    the index survives crashes (journal + checkpoints). A `kvstore.tier.Tier`."""

    name = "ssd"

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: RankFn,
        lock: threading.Lock | None = None,
        on_stored: Callable[[bytes], None] = lambda key: None,
        on_removed: Callable[[bytes], None] = lambda key: None,
        read_only: bool = False,
    ) -> None:
        self.config = config
        # The lock every coarse operation expects held (the engine's); released for I/O.
        self._lock = lock or threading.Lock()
        self._on_stored = on_stored
        backend = SlotBackend(config.ssd)  # the one reader of `ssd.io_backend`
        self.store = store = SsdStore(
            config,
            rank=rank,
            on_removed=on_removed,
            lock=self._lock,
            read_only=read_only,
            open_slots=backend.open_file,
        )
        self.files, self.dir, self.meta = store.files, store.files.dir, store.meta
        self.recovery, self.store_id = store.recovery, store.store_id
        self.capacity, self.max_value_bytes = store.capacity, store.max_value_bytes
        try:
            io = backend.open_io(store.slots)
        except BaseException:
            store.abandon()  # NIXL or its backend is missing: a store made just now goes
            raise
        self.slots, self.io, self.cat = store.slots, io, store.cat
        # The books' parts that callers read (never rebound by the catalog).
        cat = self.cat
        self.index, self.alloc, self.pinned = cat.index, cat.alloc, cat.pinned
        self.tenants, self.counters = cat.tenants, cat.counters

    def abandon(self) -> None:
        """Close without a checkpoint; a store that this open created is removed again."""
        self.io.close()
        self.store.abandon()

    def register_memory(self, view: memoryview) -> None:
        """`view` (the DRAM arena) is where most blocks move from and to: a slot I/O backend
        that registers memory does it once, here."""
        self.io.register_memory(view)

    def begin_checkpoint(self) -> Callable[[], None]:
        """See `SsdStore.begin_checkpoint` (lock held; returns the part to run without it)."""
        return self.store.begin_checkpoint()

    def checkpoint_if_due(self) -> None:
        self.store.checkpoint_if_due()

    def close(self, *, checkpoint: bool = True) -> None:
        """See `SsdStore.close`."""
        self.io.close()  # no slot I/O is left by now; the file closes with the store
        self.store.close(checkpoint=checkpoint)

    @property
    def journal(self) -> jr.Journal | None:
        """The journal changes are appended to now (a checkpoint starts a new one)."""
        return self.cat.journal

    def find(self, key: bytes) -> int:
        return self.index.find(key)

    def plan_write(
        self,
        key: bytes,
        length: int,
        parent: bytes | None,
        tenant: str,
        meta: bytes | None = None,
    ) -> WritePlan:
        """See `SsdCatalog.plan_write`; `meta` is journaled with the block."""
        plan = self.cat.plan_write(key, length, parent, tenant)
        plan.meta = meta
        return plan

    def commit_write(self, plan: WritePlan) -> int | None:
        """See `SsdCatalog.commit_write`."""
        return self.cat.commit_write(plan)

    def set_quota(self, tenant: str, quota_bytes: int | None) -> None:
        """See `SsdCatalog.set_quota`."""
        self.cat.set_quota(tenant, quota_bytes)

    # ------------------------------------------------------------------ coarse operations
    # What the engine calls (see the module's docstring for the locking).

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def contains(self, key: bytes) -> bool:
        return self.index.find(key) != EMPTY

    def meta_of(self, key: bytes) -> bytes | None:
        return self.cat.meta.get(key)

    def parent_of(self, key: bytes) -> bytes | None:
        row = self.index.find(key)
        return None if row == EMPTY else self.index.parent_of(row)

    def keys(self) -> list[bytes]:
        """Every key the tier holds (under the engine's lock)."""
        return [self.index.key_of(int(row)) for row in self.index.live_rows()]

    def length_of(self, key: bytes) -> int | None:
        row = self.index.find(key)
        return None if row == EMPTY else int(self.index.rows["length"][row])

    def seq_of(self, key: bytes) -> int:
        """The seq of the key's SSD copy; -1 if there is none."""
        row = self.index.find(key)
        return int(self.index.rows["seq"][row]) if row != EMPTY else -1

    def drop_older(self, key: bytes, seq: int | None) -> None:
        """A new value of `key` was published in DRAM: an SSD copy of an older value goes. For
        a durable put (`seq` of its own write) a copy older than that write; for a fast put
        (None) any copy but one that a durable put of the key is still writing (those are
        newer or overlap it)."""
        row = self.index.find(key)
        if row == EMPTY:
            return
        row_seq = int(self.index.rows["seq"][row])
        if row_seq < seq if seq is not None else row_seq not in self.cat.writing.get(key, ()):
            self.cat.remove_row(row)

    def write_through(
        self,
        key: bytes,
        length: int,
        parent: bytes | None,
        tenant: str,
        payload: memoryview,
        meta: bytes | None = None,
    ) -> int:
        """Write a block and wait until it and its journal record are durable; returns the
        write's seq, registered as in flight until `write_through_done`. Releases the lock for
        the write and the wait.

        Raises:
            CapacityError: no slot could be freed.
            StorageIOError: the device or the journal failed; the key keeps its old copy.
        """
        plan = self.plan_write(key, length, parent, tenant, meta)
        self.cat.writing.setdefault(key, set()).add(plan.seq)
        try:
            with self._unlocked():
                self.io.write(plan, self.tenants[plan.tenant], payload)
            self._raise_if_closed(key)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.cat.abort_write(plan)
            self.counters.io_errors += 1
            raise
        try:
            ticket = self.cat.commit_write(plan)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.counters.io_errors += 1
            raise
        journal = self.journal
        assert journal is not None
        if ticket is not None:
            self._on_stored(key)
        try:
            with self._unlocked():
                # None: a newer version of the key won the race; its record is queued already.
                journal.wait(ticket)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.counters.io_errors += 1
            # The journal is dead: no DEL record can be written; the key keeps its old copy.
            if self.cat.undo_commit(plan):
                self._on_stored(key)
            raise
        return plan.seq

    def _raise_if_closed(self, key: bytes) -> None:
        """A slow write (a delayed completion) can outlast the engine's close, which does not
        wait for writes: its slot cannot be journaled any more, so the block is not stored.

        Raises:
            StorageIOError: the tier closed while the block was being written.
        """
        if self.cat.journal is None:
            raise StorageIOError(
                f"the SSD tier closed while block {key.hex()} was being written: not stored"
            )

    def write_through_done(self, key: bytes, seq: int) -> None:
        """The durable put that wrote `seq` has published (or failed)."""
        seqs = self.cat.writing[key]
        seqs.discard(seq)
        if not seqs:
            del self.cat.writing[key]

    def demote(self, plan: WritePlan, payload: memoryview, keep: Callable[[], bool]) -> bool:
        """Write a planned block from DRAM (pinned by the caller) and commit it unless it
        failed, `keep()` no longer holds, or a durable put of the key is writing a newer copy,
        which ours must not replace. True if committed. Releases the lock for the write."""
        try:
            with self._unlocked():
                self.io.write(plan, self.tenants[plan.tenant], payload)
            self._raise_if_closed(plan.key)
            error = None
        except StorageIOError as exc:
            error = exc
        return self._finish_demotion(plan, error, keep)

    @property
    def write_batch(self) -> int:
        """Demotions `demote_batch` puts in flight at once (1: one after another)."""
        return self.io.write_batch_slots

    def demote_batch(
        self, writes: Sequence[tuple[WritePlan, memoryview, Callable[[], bool]]]
    ) -> list[bool]:
        """`demote` of each (plan, payload, keep), their slot writes in one submission on the
        io_uring path; each is committed or given back on its own (a failed or short write
        of one never stops the others'). Releases the lock for the writes."""
        names = [self.tenants[plan.tenant] for plan, _, _ in writes]
        try:
            with self._unlocked():
                errors = self.io.write_batch(
                    [(plan, name, payload) for (plan, payload, _), name in zip(writes, names,
                                                                              strict=True)]
                )  # fmt: skip
        except StorageIOError as exc:  # no ring to submit on: every slot is given back
            errors = [exc] * len(writes)
        out = []
        for (plan, _, keep), error in zip(writes, errors, strict=True):
            if error is None:
                try:
                    self._raise_if_closed(plan.key)
                except StorageIOError as exc:
                    error = exc
            out.append(self._finish_demotion(plan, error, keep))
        return out

    def _finish_demotion(
        self, plan: WritePlan, error: StorageIOError | None, keep: Callable[[], bool]
    ) -> bool:
        """Commit a demotion's written slot, or give it back (see `demote`)."""
        key = plan.key
        if error is not None:
            log.error("demotion of block %s failed: %s", key.hex(), error)
        if error is not None or not keep() or key in self.cat.writing:
            self.cat.abort_write(plan)
            self.counters.io_errors += error is not None
            return False
        try:
            committed = self.cat.commit_write(plan) is not None
        except StorageIOError as exc:  # the journal failed: the block is only in DRAM
            log.error("demotion of block %s failed: %s", key.hex(), exc)
            self.counters.io_errors += 1
            return False
        if committed:
            self._on_stored(key)
        return committed

    def find_block(self, key: bytes) -> SsdRead | None:
        """The key's block as indexed now, to read back; None if the SSD does not hold it."""
        row = self.index.find(key)
        if row == EMPTY:
            return None
        tenant = self.tenants[int(self.index.rows["tenant"][row])]
        return SsdRead(row, self.cat.snapshot(row), self.index.parent_of(row), tenant,
                       self.cat.meta.get(key))  # fmt: skip

    def pin(self, read: SsdRead) -> None:
        """Keep the block's slot from eviction until `unpin`."""
        self.pinned[read.row] = self.pinned.get(read.row, 0) + 1

    def unpin(self, read: SsdRead) -> None:
        left = self.pinned.pop(read.row) - 1
        if left:
            self.pinned[read.row] = left

    def read_into(self, read: SsdRead, dst: memoryview, value: bool = True) -> bool | None:
        """Read a pinned block into `dst` (page-aligned, whole pages): whether it verified
        (`value` False: its slot header only, the caller sums the value), or None if the
        device failed. Releases the lock for the read."""
        try:
            with self._unlocked():
                return self.io.read(read.snap, dst, value)
        except StorageIOError as exc:
            log.error("reading block %s from the SSD failed: %s", read.snap[0].hex(), exc)
            return None

    def read_unlocked(self, read: SsdRead, dst: memoryview, value: bool = True) -> bool | None:
        """`read_into` for a caller that does not hold the lock (a batch's read threads)."""
        try:
            return self.io.read(read.snap, dst, value)
        except StorageIOError as exc:
            log.error("reading block %s from the SSD failed: %s", read.snap[0].hex(), exc)
            return None

    @property
    def batches(self) -> bool:
        """Whether `read_batch_unlocked` puts a batch in one submission (io_uring)."""
        return self.io.batches

    def read_batch_unlocked(
        self, reads: Sequence[SsdRead], dsts: Sequence[memoryview], value: bool = True
    ) -> list[bool | None]:
        """`read_unlocked` of each read into its dst, in one submission on the io_uring path;
        a block whose I/O failed or came back short is None (`finish_read` counts it)."""
        try:
            return self.io.read_batch(
                [(read.snap, dst) for read, dst in zip(reads, dsts, strict=True)], value
            )
        except StorageIOError as exc:
            log.error("reading %d blocks from the SSD failed: %s", len(reads), exc)
            return [None] * len(reads)

    def finish_read(self, read: SsdRead, ok: bool | None) -> bool | None:
        """Account for a `read_into` that returned `ok` (the block unpinned by now): None if
        the read failed, else whether the block is still the key's indexed copy. A block that
        failed verification while still indexed as read is corrupt and is dropped; one that
        was deleted or replaced meanwhile may hold another block by now: a miss, not damage."""
        # Keys are unique among live rows, so the read's row live and still holding its
        # snapshot (key included) is exactly "find(key) is that row": no second probe.
        row = read.row
        same = bool(self.index.live[row]) and self.cat.snapshot(row) == read.snap
        if not ok:
            if ok is None:
                self.counters.io_errors += 1
            elif same:
                self.counters.corrupt += 1
                log.warning("SSD block %s failed its checksum; dropped, served as a miss",
                            read.snap[0].hex())  # fmt: skip
                self.cat.remove_row(read.row)
            return None
        self.counters.bytes_read += read.length
        return same

    def touch(self, read: SsdRead) -> None:
        """The block was read back into DRAM: it is recently used."""
        self.index.touch(read.row, self.cat.next_tick())

    def detach(self, key: bytes) -> SsdWipe | None:
        """Delete `key`'s block from the index (no removal callback: the caller's own delete);
        its slot stays out of reuse until `wipe`. None if the SSD does not hold it."""
        row = self.index.find(key)
        if row == EMPTY:
            return None
        return SsdWipe(key, *self.cat.detach_row(row, notify=False))

    def wipe(self, wipe: SsdWipe) -> None:
        """Zero a detached block's header page, then let its slot be reused. Called without
        the lock; takes it for the last step."""
        try:
            self.io.wipe(wipe.offset)
        except StorageIOError as exc:
            # Still deleted from the index; only a rebuild from slot headers could revive it.
            log.error("could not wipe the slot of deleted block %s: %s", wipe.key.hex(), exc)
        with self._lock:
            self.cat.release_slot(wipe.journal, wipe.ticket, wipe.offset, wipe.size)

    def stats(self, n: Mapping[str, int]) -> TierStats:
        """This tier's counters; `n` holds the engine's (hits, misses, moves between tiers)."""
        return _tier_stats(self, n)

    def tenant_usage(self) -> dict[str, int]:
        """SSD slot bytes held per tenant name (tenants that hold anything)."""
        return {self.tenants[t]: b for t, b in self.index.tenant_bytes.items()}

    @property
    def used_bytes(self) -> int:
        return self.alloc.used_bytes

    def stored_bytes(self) -> int:
        return int(self.index.rows["length"][self.index.live_rows()].sum())


def _tier_stats(tier: SsdTier, n: Mapping[str, int]) -> TierStats:
    c = tier.counters
    ring = tier.io.ring_stats()
    return TierStats(
        name="ssd",
        capacity_bytes=tier.capacity,
        used_bytes=tier.used_bytes,
        stored_bytes=tier.stored_bytes(),
        entries=len(tier.index),
        pinned=len(tier.pinned),
        hits=n["ssd_hits"],
        misses=n["misses"],
        evictions=c.evictions,
        bytes_written=c.bytes_written,
        bytes_read=c.bytes_read,
        demotions=n["demotions"],
        promotions=n["promotions"],
        prefetches=n["prefetches"],
        corrupt_blocks=c.corrupt,
        io_errors=c.io_errors,
        io_engine=tier.io.engine,
        io_rings=ring.get("rings", 0),
        io_rings_with_file=ring.get("rings_with_file", 0),
        io_rings_with_memory=ring.get("rings_with_memory", 0),
        io_files_refused=ring.get("files_refused", 0),
        io_memory_refused=ring.get("memory_refused", 0),
        io_clone_unsupported=ring.get("clone_unsupported", 0),
        io_fixed_file_entries=ring.get("fixed_file_entries", 0),
        io_fixed_memory_entries=ring.get("fixed_memory_entries", 0),
        io_submissions=ring.get("submissions", 0),
        io_entries=ring.get("entries", 0),
    )
