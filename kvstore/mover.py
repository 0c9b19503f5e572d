"""The mover: carries blocks between the tiers once the manager has decided.

Demotions (DRAM -> SSD, on eviction and at a clean close), promotions (SSD -> DRAM, for a get
or a prefetch on the background pool, in-flight reads de-duplicated) and durable puts' writes
through to the SSD. Methods expect the engine's lock held on entry and hold it on return unless
they say otherwise; the bytes move with the lock released, on a DRAM entry and an SSD slot or
row pinned meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.errors import CapacityError, KVOffloadError, StorageIOError
from kvoffload.kvstore.dram import DramEntry
from kvoffload.kvstore.extents import slot_bytes
from kvoffload.kvstore.ssd import SsdTier
from kvoffload.kvstore.ssd.slotio import AlignedBuffer
from kvoffload.kvstore.ssd.tier import SsdRead, SsdWipe

if TYPE_CHECKING:
    from kvoffload.kvstore.manager import Manager

__all__ = ["Mover"]

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Read:
    """A promotion between `_begin` and `_end`: the SSD block, where it lands, and the event
    that other readers of the key wait on."""

    key: bytes
    block: SsdRead
    entry: DramEntry
    dst: memoryview
    event: threading.Event


class Mover:
    """Moves blocks between the manager's DRAM tier and its SSD tier."""

    def __init__(self, manager: Manager) -> None:
        self._m = manager
        self._lock = manager.lock
        self._dram = manager.dram
        self.ssd: SsdTier | None = None
        self._inflight: dict[bytes, threading.Event] = {}  # promotions reading, by key
        self._queued: set[bytes] = set()  # prefetches submitted, not finished
        self.pool: ThreadPoolExecutor | None = None
        self.reads: ThreadPoolExecutor | None = None  # the slot reads of batched gets

    def start(self, io_threads: int, read_depth: int) -> None:
        """Start the prefetch pool and the batch read pool (with an SSD tier)."""
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-prefetch")
        self.reads = ThreadPoolExecutor(read_depth, thread_name_prefix="kvoffload-read")

    def ssd_stored(self, key: bytes) -> None:
        """The SSD tier committed a copy of `key` (its callback, lock held)."""
        self._m.notify("stored", key, "ssd")

    def ssd_removed(self, key: bytes) -> None:
        """The SSD tier dropped its copy of `key` (its callback, lock held)."""
        entry = self._m.index.get(key)
        if entry is not None:
            entry.on_ssd = False  # the SSD copy is gone: evicting the DRAM copy must write it
        self._m.notify("removed", key, "ssd")

    # ------------------------------------------------------------------ DRAM -> SSD

    def demote(self, entry: DramEntry, *, drop: bool) -> None:
        """Write a live DRAM block to the SSD, then with `drop` take it out of DRAM. Releases
        the lock for the write."""
        ssd, m = self.ssd, self._m
        assert ssd is not None
        try:
            plan = ssd.plan_write(entry.key, entry.length, entry.parent, entry.tenant, entry.meta)
        except (CapacityError, StorageIOError) as exc:
            log.warning("cannot demote block %s: %s", entry.key.hex(), exc)
            if drop:
                m.drop(entry)
                m.notify("removed", entry.key, "dram")  # routers must not count on it
            return
        entry.pins += 1
        self._dram.pinned.add(entry.key)
        # Deleted or overwritten while writing: not committed.
        if ssd.demote(plan, self._dram.pages(entry), lambda: entry.live):
            entry.on_ssd = True
            m.n["demotions"] += 1
        m.unpin_locked(entry)
        if drop and entry.live:
            if entry.pins:
                # A reader got here first; keep it evictable later (now a clean copy).
                self._dram.policy.insert(entry.key, m.rank(entry.key, entry.parent))
            else:
                m.drop(entry)
                m.notify("removed", entry.key, "dram")
        ssd.checkpoint_if_due()

    def checkpoint(self) -> None:
        """Snapshot the SSD index now (called without the lock; the file is written without
        it)."""
        assert self.ssd is not None
        with self._lock:
            self._m.check_open()
            finish = self.ssd.begin_checkpoint()
        finish()

    def flush(self) -> None:
        """Write every live DRAM block without an SSD copy to the SSD (clean shutdown; called
        without the lock)."""
        with self._lock:
            for entry in list(self._m.index.values()):
                if entry.live and not entry.on_ssd:
                    self.demote(entry, drop=False)

    def close(self, flush: bool) -> None:
        """The engine's close (called without the lock): stop the prefetch pool, write DRAM-only
        blocks to the SSD (`flush`), then retire every DRAM entry, unmap the arena and detach
        the SSD tier, which is closed last, outside the lock."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.reads is not None:
            self.reads.shutdown(wait=True)
        try:
            if self.ssd is not None and flush:
                self.flush()
        finally:
            m = self._m
            with self._lock:
                m.closed = True
                for entry in m.index.values():
                    entry.live = False  # no longer a neighbour a reserve may evict
                m.index.clear()
                self._dram.arena.close()
                ssd = self.ssd
                m.detach_ssd()
            if ssd is not None:
                ssd.close()

    def delete(self, key: bytes) -> bool:
        """Remove `key` from both tiers (called without the lock); True if it was stored. The
        SSD slot's header is wiped with the lock released."""
        ssd, m = self.ssd, self._m
        wipe: SsdWipe | None = None
        with self._lock:
            m.check_open()
            found = False
            entry = m.index.get(key)
            if entry is not None:
                m.drop(entry)
                found = True
            if ssd is not None:
                wipe = ssd.detach(key)
                found |= wipe is not None
            m.n["deletes"] += found
        if ssd is not None and wipe is not None:
            ssd.wipe(wipe)
        return found

    def commit_durable(self, entry: DramEntry) -> bool:
        """Write a filled reservation through to the SSD, wait for its journal record, then
        publish it in DRAM (called without the lock).

        The SSD decides the order of overlapping durable puts of a key: the highest seq wins in
        both tiers, so what readers see before a crash is what the store holds after it.
        """
        ssd, m = self.ssd, self._m
        assert ssd is not None
        key = entry.key
        with self._lock:
            try:
                m.check_open()
                seq = ssd.write_through(key, entry.length, entry.parent, entry.tenant,
                                        self._dram.pages(entry), entry.meta)  # fmt: skip
            except BaseException:
                m.unpin_locked(entry)  # never published: frees the slot
                raise
            ssd.write_through_done(key, seq)
            m.n["durable"] += 1
            row_seq = ssd.seq_of(key)
            if row_seq > seq:
                # A newer durable put of the key owns the SSD copy: ours comes before it. Until
                # that put publishes, DRAM must not serve anything older than it.
                current = m.index.get(key)
                if current is not None and current.seq != row_seq:
                    m.drop(current)
                    m.notify("removed", key, "dram")
                m.n["puts"] += 1
                m.unpin_locked(entry)
                return True
            entry.on_ssd = entry.durable = row_seq == seq
            entry.seq = seq
            m.publish(entry, put=True, ssd_seq=seq)
        return True

    # ------------------------------------------------------------------ SSD -> DRAM

    def promote(self, key: bytes, *, prefetch: bool = False) -> DramEntry | None:
        """Read an SSD-only block into DRAM; the published entry, or None if it is gone or
        fails verification. Releases the lock for the read."""
        ssd = self.ssd
        assert ssd is not None
        while key in self._inflight:
            event = self._inflight[key]
            self._lock.release()
            try:
                event.wait()
            finally:
                self._lock.acquire()
            done = self._m.index.get(key)
            if done is not None:
                return done
        read = self._begin(key, prefetch)
        if read is None:
            return None
        try:
            ok = ssd.read_into(read.block, read.dst)
        finally:
            self._end_io(read)
        entry = self._end(read, ok, prefetch)
        if entry is not None and entry.staging is not None:
            entry.pins -= 1  # the caller's `acquire` pins it
        return entry

    def promote_many(
        self, keys: Sequence[bytes], ready: Callable[[bytes, DramEntry], None] | None = None
    ) -> dict[bytes, DramEntry]:
        """Read the SSD-only blocks of `keys` into DRAM with up to `ssd.read_depth` reads in
        flight, each finished as it completes (the lock is released while they run). Returns
        the entries read, each pinned once for the caller (`Manager.acquire(fetched=...)`).
        Keys another caller is reading already are left to `promote`, which waits for them:
        no block is read twice. `ready(key, entry)` is called without the lock as each
        overlapped read is published (its entry pinned), so the caller can copy it out while
        the others are still being read."""
        ssd, reads = self.ssd, self.reads
        assert ssd is not None and reads is not None
        todo: list[_Read] = []
        for key in dict.fromkeys(keys):
            if key in self._m.index or key in self._inflight:
                continue
            read = self._begin(key, False)
            if read is not None:
                todo.append(read)
        out: dict[bytes, DramEntry] = {}
        if len(todo) < 2:  # nothing to overlap: read on this thread, as a single get does
            for read in todo:
                try:
                    ok = ssd.read_into(read.block, read.dst)
                finally:
                    self._end_io(read)
                self._keep(read, ok, out)
            return out
        futures: dict[Future[bool | None], _Read] = {}
        ended: set[bytes] = set()
        self._lock.release()
        try:
            for read in todo:
                futures[reads.submit(ssd.read_unlocked, read.block, read.dst)] = read
            for future in as_completed(futures):
                read = futures[future]
                with self._lock:
                    ended.add(read.key)
                    self._end_io(read)
                    self._keep(read, future.result(), out)
                    kept = out.get(read.key)
                if ready is not None and kept is not None:
                    ready(read.key, kept)
        finally:
            # Interrupted (or the pool refused work): every read still set up ends as a miss
            # once its I/O, if started, is over, so that no key stays in flight.
            for future, read in futures.items():
                if read.key not in ended:
                    with contextlib.suppress(BaseException):
                        future.result()
            self._lock.acquire()
            for read in todo:
                if read.key not in ended:
                    self._end_io(read)
                    self._end(read, None, False)
        return out

    def _keep(self, read: _Read, ok: bool | None, out: dict[bytes, DramEntry]) -> None:
        """Finish a read of `promote_many` (lock held), keeping a pin on its entry for the
        caller; a block gone, damaged or replaced meanwhile is left out."""
        entry = self._end(read, ok, False)
        if entry is not read.entry:
            return
        if entry.staging is None:  # published unpinned just now: pinned before anyone evicts
            entry.pins += 1
            self._dram.pinned.add(entry.key)
        out[read.key] = entry

    def _begin(self, key: bytes, prefetch: bool) -> _Read | None:
        """Set up a read of `key`'s SSD block (lock held): the block pinned, a reserved DRAM
        slot (or, for a get when pinned views hold all of DRAM, a buffer of its own), and the
        key marked in flight. None if the SSD does not hold it."""
        ssd, m = self.ssd, self._m
        assert ssd is not None
        block = ssd.find_block(key)
        if block is None:
            return None
        length = block.length
        if length > m.config.dram.effective_max_value_bytes:
            return None  # written under a larger DRAM limit; cannot be staged in DRAM
        ssd.pin(block)
        event = threading.Event()
        self._inflight[key] = event
        try:
            size = slot_bytes(length)
            m.fit_quota(block.tenant, key, size, strict=False)
            try:
                entry = m.claim(key, length, size, block.parent, block.tenant)
                entry.meta = block.meta
                entry.seq = block.snap[3]
                entry.on_ssd = True
                dst = self._dram.pages(entry)
            except CapacityError:
                if prefetch:
                    raise
                # Pinned views hold all of DRAM: serve this get from a buffer of its own.
                entry = DramEntry(key, -1, length, 0, block.parent, 0, block.tenant, pins=1,
                                  meta=block.meta)  # fmt: skip
                entry.staging = AlignedBuffer(size)
                dst = entry.staging.view
        except BaseException:
            ssd.unpin(block)
            del self._inflight[key]
            event.set()
            raise
        return _Read(key, block, entry, dst, event)

    def _end_io(self, read: _Read) -> None:
        """The read's I/O is over (lock held): its block unpinned, its waiters woken."""
        assert self.ssd is not None
        self.ssd.unpin(read.block)
        del self._inflight[read.key]
        read.event.set()

    def _end(self, read: _Read, ok: bool | None, prefetch: bool) -> DramEntry | None:
        """Publish a finished read (lock held): the key's entry now, or None if the block
        was gone or failed verification."""
        ssd, m = self.ssd, self._m
        assert ssd is not None
        key, entry = read.key, read.entry
        current = ssd.finish_read(read.block, ok)
        if current is None:
            m.unpin_locked(entry)
            return None
        if key in m.index or not current:
            m.unpin_locked(entry)  # written or deleted while we read: ours is stale
            return m.index.get(key)
        ssd.touch(read.block)
        if entry.staging is not None:
            return entry
        m.n["promotions"] += 1
        m.n["prefetches"] += prefetch
        m.publish(entry, put=False)
        m.notify("stored", key, "dram")
        return entry

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Queue background promotions of the SSD-only blocks of `keys` not already being
        read (called without the lock); returns how many of `keys` either tier holds."""
        found = 0
        m = self._m
        with self._lock:
            m.check_open()
            todo = []
            for key in keys:
                if key in m.index:
                    found += 1
                elif self.ssd is not None and self.ssd.contains(key):
                    found += 1
                    if key not in self._inflight and key not in self._queued:
                        self._queued.add(key)
                        todo.append(key)
        if self.pool is not None:
            for key in todo:
                self.pool.submit(self._prefetch_one, key)
        return found

    def _prefetch_one(self, key: bytes) -> None:
        try:
            with self._lock:
                if not self._m.closed and key not in self._m.index:
                    self.promote(key, prefetch=True)
        except KVOffloadError as exc:  # a background task: report, the get will retry
            log.warning("prefetch of block %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                self._queued.discard(key)
