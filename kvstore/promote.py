"""Reading SSD blocks back into DRAM: a get's promotion, a batch's reads in flight together,
and prefetches on the background pool, with reads already in flight never repeated. A base of
`kvstore.mover.Mover`; the same locking rules (the engine's lock held on entry and on return,
released while the bytes move, on a pinned SSD row and a reserved DRAM slot).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import TYPE_CHECKING

from kvoffload.errors import CapacityError, KVOffloadError
from kvoffload.kvstore.dram import DramEntry, DramTier
from kvoffload.kvstore.extents import slot_bytes
from kvoffload.kvstore.readpool import ReadPool
from kvoffload.kvstore.ssd import SsdTier
from kvoffload.kvstore.ssd.slotio import AlignedBuffer
from kvoffload.kvstore.ssd.tier import SsdRead

if TYPE_CHECKING:
    from kvoffload.kvstore.manager import Manager

__all__ = ["Promotions", "side_buffers"]

SIDE_BUFFERS = 16  # a batch's side buffers (`side_buffers`), unless the read depth is larger


def side_buffers(read_depth: int) -> int:
    """Side buffers one batched `get_many_into` holds at most (DRAM pinned full): enough to
    keep `read_depth` reads in flight while earlier blocks are copied out."""
    return max(SIDE_BUFFERS, read_depth)


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


@dataclass(eq=False, slots=True)
class _Batch:
    """A `promote_many` in progress: what its reads kept, what each reports on finishing."""

    out: dict[bytes, DramEntry]
    ready: Callable[[bytes, DramEntry], bool] | None
    ended: set[bytes] = field(default_factory=set)  # reads whose I/O is over and accounted
    # (read, whether its side buffer went back, what finishing it raised)
    done_q: SimpleQueue[tuple[_Read, bool, BaseException | None]] = field(
        default_factory=SimpleQueue
    )


class Promotions:
    """SSD -> DRAM: `promote` (a get), `promote_many` (a batched get), `prefetch`."""

    _m: Manager
    _lock: threading.Lock
    _dram: DramTier
    ssd: SsdTier | None
    _inflight: dict[bytes, threading.Event]  # promotions reading, by key
    _queued: set[bytes]  # prefetches submitted, not finished
    pool: ThreadPoolExecutor | None
    reads: ReadPool | None  # the slot reads of batched gets

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
            self._m.check_open()  # close() may have begun (or ended) meanwhile
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
        self._check_not_closed(read)
        entry = self._end(read, ok, prefetch)
        if entry is not None and entry.staging is not None:
            entry.pins -= 1  # the caller's `acquire` pins it
        return entry

    def promote_many(
        self, keys: Sequence[bytes], ready: Callable[[bytes, DramEntry], bool] | None = None
    ) -> dict[bytes, DramEntry]:
        """Read the SSD-only blocks of `keys` into DRAM with up to `ssd.read_depth` reads in
        flight, each finished as it completes (the lock is released while they run). Returns
        the entries read, each pinned once for the caller (`Manager.acquire(fetched=...)`).
        Keys another caller is reading already are left to `promote`, which waits for them:
        no block is read twice. `ready(key, entry)` is called without the lock as each
        overlapped read is published (its entry pinned), so the caller can copy it out while
        the others are still being read; True says it did, so a side buffer (DRAM pinned
        full) can go at once: with `ready`, at most `side_buffers` of them are held, a read
        that needs one more waiting until an earlier one is copied out."""
        ssd, reads = self.ssd, self.reads
        assert ssd is not None and reads is not None
        later = deque(k for k in dict.fromkeys(keys)
                      if k not in self._m.index and k not in self._inflight)  # fmt: skip
        limit = side_buffers(self._m.config.ssd.read_depth) if ready is not None else 1 << 62
        todo: list[_Read] = []
        held = self._begin_some(later, todo, 0, limit, idle=True)
        out: dict[bytes, DramEntry] = {}
        if len(todo) < 2 and not later:  # nothing to overlap: on this thread, as a get does
            for read in todo:
                try:
                    ok = _read_or_miss(ssd.read_into, read)
                finally:
                    self._end_io(read)
                self._check_not_closed(read)
                self._keep(read, ok, out)
            return out
        batch = _Batch(out, ready)
        running: set[bytes] = set()  # keys of reads submitted, not reported back yet
        done = False
        self._lock.release()
        try:
            _submit(reads, ssd, todo, batch, self._finish, running)
            while running:
                read, spent, error = batch.done_q.get()  # each read, as the pool finished it
                running.discard(read.key)
                if error is not None:
                    raise error
                held -= spent
                if later and (held < limit or not running):
                    with self._lock:
                        self._m.check_open()  # close() waits for reads begun before it only
                        n = len(todo)
                        held = self._begin_some(later, todo, held, limit, idle=not running)
                    _submit(reads, ssd, todo[n:], batch, self._finish, running)
            done = True
        finally:
            # Interrupted (or the pool refused work): every read still set up ends as a miss
            # once its I/O, if started, is over, so that no key stays in flight, and the pins
            # kept for the caller, who will not get `out`, are dropped.
            while running:
                running.discard(batch.done_q.get()[0].key)
            self._lock.acquire()
            for read in todo:
                if read.key not in batch.ended:
                    self._end_io(read)
                    if self.ssd is not None:
                        self._end(read, None, False)
                    else:  # closed under a hung read: nothing left to account to
                        self._m.unpin_locked(read.entry)
            if not done:
                for entry in out.values():
                    self._m.unpin_locked(entry)
        return out

    def _finish(self, batch: _Batch, read: _Read, ok: bool | None) -> None:
        """Finish a batch's read on the pool thread that did it (not the batch's caller, so
        reads finish, and are copied out, side by side): publish it, hand it to `ready`, give
        back its side buffer once copied, and report to the batch."""
        spent, error = False, None
        try:
            with self._lock:
                self._end_io(read)
                batch.ended.add(read.key)
                self._check_not_closed(read)
                self._keep(read, ok, batch.out)
                kept = batch.out.get(read.key)
            ready = batch.ready
            copied = ready is not None and kept is not None and ready(read.key, kept)
            if copied and kept is not None and kept.staging is not None:
                with self._lock:
                    self._dram.spend(kept)  # copied out: its side buffer goes
                spent = True
        except BaseException as exc:  # the batch's caller raises it
            error = exc
        batch.done_q.put((read, spent, error))

    def _begin_some(
        self, later: deque[bytes], todo: list[_Read], held: int, limit: int, idle: bool
    ) -> int:
        """Set up reads of `later`'s keys into `todo` (lock held) while this batch holds fewer
        than `limit` side buffers (one more when nothing else runs: progress). Returns how many
        it holds then."""
        started = False
        while later and (held < limit or (idle and not started)):
            key = later.popleft()
            if key in self._m.index or key in self._inflight:
                continue  # read by another caller meanwhile: `acquire` finds or waits for it
            read = self._begin(key, False)
            if read is not None:
                todo.append(read)
                started = True
                held += read.entry.staging is not None
        return held

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
                self._dram.staging_taken()
        except BaseException:
            ssd.unpin(block)
            del self._inflight[key]
            event.set()
            raise
        return _Read(key, block, entry, dst, event)

    def _end_io(self, read: _Read) -> None:
        """The read's I/O is over (lock held): its block unpinned, its waiters woken."""
        if self.ssd is not None:  # None: close() gave up waiting for this read (it hung)
            self.ssd.unpin(read.block)
        del self._inflight[read.key]
        read.event.set()

    def _check_not_closed(self, read: _Read) -> None:
        """A read that outlived close() (it hung; lock held) serves nothing: its slot is given
        up with the engine's books, and the caller learns the engine is closed."""
        if self._m.closed:
            self._m.unpin_locked(read.entry)
            raise KVOffloadError("the engine closed while this SSD read hung")

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
                try:
                    self.pool.submit(self._prefetch_one, key)
                except RuntimeError:  # the pool shut down: close() began meanwhile
                    with self._lock:
                        self._queued.difference_update(todo)
                    raise KVOffloadError("the engine is closed") from None
        return found

    def _prefetch_one(self, key: bytes) -> None:
        try:
            with self._lock:
                if not (self._m.closed or self._m.closing) and key not in self._m.index:
                    self.promote(key, prefetch=True)
        except KVOffloadError as exc:  # a background task: report, the get will retry
            log.warning("prefetch of block %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                self._queued.discard(key)


def _read_or_miss(
    read_into: Callable[[SsdRead, memoryview], bool | None], read: _Read
) -> bool | None:
    """One slot read; an I/O path failing in a way of its own (not a `StorageIOError`, which
    `read_into` turns into None itself) makes that block a miss, not a lost DRAM slot."""
    try:
        return read_into(read.block, read.dst)
    except Exception:
        log.exception("kvoffload: reading block %s from the SSD failed", read.key.hex())
        return None


def _submit(
    reads: ReadPool,
    ssd: SsdTier,
    todo: Sequence[_Read],
    batch: _Batch,
    finish: Callable[[_Batch, _Read, bool | None], None],
    running: set[bytes],
) -> None:
    """Start the slot reads of `todo` on the batch read pool (called without the lock); each
    is finished there (`finish`), which reports to the batch."""
    for read in todo:
        try:
            reads.submit(_read_and_finish, ssd.read_unlocked, read, batch, finish)
        except RuntimeError:  # the pool shut down: close() began meanwhile
            raise KVOffloadError("the engine is closed") from None
        running.add(read.key)


def _read_and_finish(
    read_unlocked: Callable[[SsdRead, memoryview], bool | None],
    read: _Read,
    batch: _Batch,
    finish: Callable[[_Batch, _Read, bool | None], None],
) -> None:
    """A batch's slot read on a pool thread, then its finish there (a Future per read and a
    hand-off of each to the caller cost more than the read's own Python)."""
    ok = None
    try:
        ok = _read_or_miss(read_unlocked, read)
    finally:
        finish(batch, read, ok)
