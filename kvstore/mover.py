"""The mover: carries blocks between the tiers once the manager has decided.

Demotions (DRAM -> SSD, on eviction and at a clean close), promotions (SSD -> DRAM, for a get
or a prefetch on the background pool, in-flight reads de-duplicated) and durable puts' writes
through to the SSD. Methods expect the engine's lock held on entry and hold it on return unless
they say otherwise; the bytes move with the lock released, on a DRAM entry and an SSD slot or
row pinned meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvoffload.errors import CapacityError, StorageIOError
from kvoffload.kvstore.dram import DramEntry
from kvoffload.kvstore.promote import Promotions
from kvoffload.kvstore.readpool import ReadPool
from kvoffload.kvstore.ssd import SsdTier
from kvoffload.kvstore.ssd.tier import SsdWipe

if TYPE_CHECKING:
    from kvoffload.kvstore.manager import Manager

__all__ = ["Mover"]

log = logging.getLogger(__name__)

# Arenas of engines closed while an SSD read into them hung: kept mapped for good.
_LEAKED: list[object] = []


class Mover(Promotions):
    """Moves blocks between the manager's DRAM tier and its SSD tier (reads back from the SSD:
    `Promotions`)."""

    def __init__(self, manager: Manager) -> None:
        self._m = manager
        self._lock = manager.lock
        self._dram = manager.dram
        self.ssd: SsdTier | None = None
        self._inflight: dict[bytes, threading.Event] = {}  # promotions reading, by key
        self._queued: set[bytes] = set()  # prefetches submitted, not finished
        self.pool: ThreadPoolExecutor | None = None
        self.reads: ReadPool | None = None  # the slot reads of batched gets

    def start(self, io_threads: int, read_depth: int) -> None:
        """Start the prefetch pool and the batch read pool (with an SSD tier)."""
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-prefetch")
        self.reads = ReadPool(read_depth, "kvoffload-read")

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
        with self._lock:
            first = not (self._m.closed or self._m.closing)
            self._m.closing = True  # calls from now on fail with KVOffloadError
        if not first:  # another close() runs: return once it has flushed and unmapped
            self._m.closed_event.wait()
            return
        try:
            self._close(flush)
        finally:
            self._m.closed_event.set()

    def _close(self, flush: bool) -> None:
        # `closing` is set: no read begins from now on, so those in flight are all to wait for.
        hung = self._wait_reads(time.monotonic() + self._m.config.ssd.close_wait_s)
        # Without a hung read every task ends at once. Queued prefetches are dropped; a
        # batch's queued reads are not (each must report to its batch, else that get waits).
        if self.pool is not None:
            self.pool.shutdown(wait=not hung, cancel_futures=True)
        if self.reads is not None:
            self.reads.shutdown(wait=not hung)
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
                if hung:
                    # A hung read may still write into the arena: never unmap it under the
                    # read (a backend may hold its raw address); it is leaked instead.
                    _LEAKED.append(self._dram.arena)
                else:
                    self._dram.arena.close()
                ssd = self.ssd
                m.detach_ssd()
            if ssd is not None:
                ssd.close()
        if hung:
            names = ", ".join(key.hex() for key in hung)
            log.error("close: SSD reads of blocks %s still hung after %.1f s; their memory stays "
                      "mapped (leaked)", names, m.config.ssd.close_wait_s)  # fmt: skip
            raise StorageIOError(
                f"the SSD did not finish reading blocks {names} within ssd.close_wait_s "
                f"({m.config.ssd.close_wait_s} s): the engine is closed, the memory those reads "
                "write into is leaked"
            )

    def _wait_reads(self, deadline: float) -> list[bytes]:
        """Wait until no promotion is in flight (called without the lock), so that a get that
        began before close finishes its reads on an SSD tier and an arena still there; the keys
        of reads still in flight at `deadline` (a hung device)."""
        while True:
            with self._lock:
                inflight = dict(self._inflight)
            if not inflight:
                return []
            for event in inflight.values():
                if not event.wait(max(0.0, deadline - time.monotonic())):
                    with self._lock:
                        return list(self._inflight)

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
