"""The engine's read path: a get's hit in DRAM, a block read back up from a tier below, a
batch's reads in flight together, and prefetches on the background pool.

`Reads` drives the manager's read plans (`Manager.prepare_read` .. `complete_read`) through
the mover: one at a time on the caller's thread, or a batch on the read pool cut into parts,
the reads of each part completed together on the pool thread that did it once the part ends.
Reads already in flight are never repeated. The same locking rules as the manager's: the
engine's lock held on entry and on return unless a method says otherwise, released while the
bytes move.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue

from kvoffload.core import dram_index_type
from kvoffload.errors import KVOffloadError
from kvoffload.kvstore.dram import TOUCH_RING, DramEntry
from kvoffload.kvstore.manager import Manager
from kvoffload.kvstore.mover import Fuse, Mover, ReadPlan, check_fused

__all__ = ["HotHandles", "Reads", "side_buffers"]

log = logging.getLogger(__name__)

SIDE_BUFFERS = 16  # a batch's side buffers (`side_buffers`), unless the read depth is larger


def side_buffers(read_depth: int) -> int:
    """Side buffers one batched `get_many_into` holds at most (DRAM pinned full): enough to
    keep `read_depth` reads in flight while earlier blocks are copied out."""
    return max(SIDE_BUFFERS, read_depth)


@dataclass(eq=False, slots=True)
class _Batch:
    """A `fetch_many` in progress: what its reads kept, what each reports on finishing."""

    out: dict[bytes, DramEntry]
    ready: Callable[[bytes, DramEntry], bool] | None
    fuse: Fuse | None
    ended: set[bytes] = field(default_factory=set)  # reads whose I/O is over and accounted
    # (reads completed together, how many side buffers went back, what finishing them raised)
    done_q: SimpleQueue[tuple[Sequence[ReadPlan], int, BaseException | None]] = field(
        default_factory=SimpleQueue
    )


@dataclass(frozen=True)
class HotHandles:
    """What a get served in C (`kvoffload.core._core.HotGets`) touches to do exactly what
    `Reads.acquire` and `Manager.unpin` do for a DRAM-only engine: the lock, the C index, the
    counters, the manager's `closing`/`closed` flags, the tier's touch hand-off and slot
    release, and the arena the answers are sliced from."""

    lock: object
    index: object
    counters: dict[str, int]
    manager: Manager
    apply_touches: Callable[[], None]
    free: Callable[[DramEntry], None]
    arena: memoryview
    touch_ring: int


class Reads:
    """Gets and prefetches over the manager's books and the mover's I/O."""

    def __init__(self, manager: Manager, mover: Mover) -> None:
        self._m = manager
        self._mover = mover
        self._lock = manager.lock
        self._n = manager.n
        self._index = manager.index
        self._dram = manager.dram
        self._queued: set[bytes] = set()  # prefetches submitted, not finished

    def hot_handles(self) -> HotHandles | None:
        """The handles a C get path needs, when it can do what `acquire` does: the C index in
        use, DRAM the only tier (a miss is a miss: nothing to read back), no admission sketch
        to feed. None otherwise (gets stay on this path)."""
        m, index_type = self._m, dram_index_type()
        if index_type is None or not isinstance(self._index, index_type):
            return None
        if m.lower or m.sketch is not None:
            return None
        dram = self._dram
        return HotHandles(self._lock, self._index, self._n, m, dram.apply_touches, dram.free,
                          dram.arena.view, TOUCH_RING)  # fmt: skip

    def acquire(
        self, key: bytes, fetched: DramEntry | None = None, fuse: Fuse | None = None
    ) -> DramEntry | None:
        """Pin and return the DRAM entry of `key`, reading it back up from a tier below if
        need be (its value checked as `fuse` copies it out, if given), or `fetched`, the
        block `fetch_many` read just now (pinned by it), served even if the key was deleted
        or written since (the get began first)."""
        m = self._m
        if m.closing or m.closed:
            raise KVOffloadError("the engine is closed")
        n = self._n
        n["gets"] += 1
        entry = self._index.lookup(key) if fetched is None else fetched
        if fetched is not None:
            n["ssd_hits"] += 1
        elif entry is not None:
            n["hits"] += 1
        else:
            entry = m.promote(key, fuse=fuse)  # from a tier below, if one holds it
            n["ssd_hits"] += entry is not None
        if entry is None:
            n["misses"] += 1
            return None
        n["bytes_out"] += entry.length
        if m.sketch is not None:
            m.sketch.add(key)
        if self._index.pin(entry) >= TOUCH_RING:
            self._dram.apply_touches()
        return entry

    def lookup(self, keys: Sequence[bytes], tiers: list[str] | None = None) -> int:
        """Leading keys any tier holds (called unlocked); `tiers` as in `Engine.lookup`."""
        m = self._m
        with self._lock:
            m.check_open()
            for n, key in enumerate(keys):
                holder = m.holder(key)
                if holder is None:
                    return n
                if tiers is not None:
                    tiers.append(holder.name)
                if m.sketch is not None:
                    m.sketch.add(key)
            return len(keys)

    def acquire_many(
        self,
        keys: Sequence[bytes],
        ready: Callable[[bytes, DramEntry], bool] | None = None,
        fuse: Fuse | None = None,
    ) -> list[DramEntry | None]:
        """`acquire` each key (lock held), the ones only a tier below holds read with their
        reads in flight together (`fetch_many`, which calls `ready` and `fuse`). The batch's
        DRAM hits are pinned first, so the room its other reads take cannot evict them."""
        m = self._m
        m.check_open()
        got: dict[int, DramEntry | None] = {}
        try:
            for i, key in enumerate(keys):
                if key in self._index:
                    got[i] = self.acquire(key)
            rest = [key for i, key in enumerate(keys) if i not in got]
            fetched = self.fetch_many(rest, ready, fuse) if rest else {}
            ours = list(fetched.values())
            try:
                # A repeated key counts as an SSD hit once, as successive gets would.
                for i, key in enumerate(keys):
                    if i not in got:
                        got[i] = self.acquire(key, fetched.pop(key, None))
            finally:
                for entry in ours:
                    m.unpin_locked(entry)  # the batch's own pin; the caller's stay
            return [got[i] for i in range(len(keys))]
        except BaseException:
            for held in got.values():  # a get failing part-way leaves no pin behind
                if held is not None:
                    m.unpin_locked(held)
            raise

    def fetch_many(
        self,
        keys: Sequence[bytes],
        ready: Callable[[bytes, DramEntry], bool] | None = None,
        fuse: Fuse | None = None,
    ) -> dict[bytes, DramEntry]:
        """Read the blocks of `keys` that only a tier below holds into DRAM with up to
        `ssd.read_depth` reads in flight, completed part by part: the reads of one pool thread's
        part are published together once that part has finished (the lock is released while
        they run). Returns the entries read, each pinned once for the caller
        (`acquire(fetched=...)`). Keys another caller is reading already are left to
        `Manager.promote`, which waits for them: no block is read twice. `ready(key, entry)`
        is called without the lock for each read of a part once the part is published (its
        entry pinned), so the caller can copy it out while other parts are still being read;
        True says it did, so a side buffer (DRAM pinned full) can go at once: with `ready`, at most
        `side_buffers` of them are held, a read that needs one more waiting until an earlier
        one is copied out. With `fuse`, each read checks its slot header only, and its value
        is summed as `fuse` copies it out, before it is published (a block that fails is a
        corrupt miss, never published; readers of the key wait until then)."""
        m, mover = self._m, self._mover
        later = deque(k for k in dict.fromkeys(keys)
                      if k not in self._index and k not in m.inflight)  # fmt: skip
        limit = side_buffers(m.config.ssd.read_depth) if ready is not None else 1 << 62
        todo: list[ReadPlan] = []
        fused = fuse is not None
        held = self._prepare_some(later, todo, 0, limit, True, fused)
        out: dict[bytes, DramEntry] = {}
        if len(todo) < 2 and not later:  # nothing to overlap: on this thread, as a get does
            for plan in todo:
                try:
                    ok = m.fused_check(plan, mover.read_or_miss(plan), fuse)
                finally:
                    m.read_done(plan)
                m.check_not_closed(plan)
                m.keep_read(plan, ok, out)
            return out
        batch = _Batch(out, ready, fuse)
        running: set[bytes] = set()  # keys of reads submitted, not reported back yet

        def done(plans: Sequence[ReadPlan], oks: Sequence[bool | None]) -> None:
            self._complete(batch, plans, oks)

        def submit(plans: Sequence[ReadPlan]) -> None:
            started = mover.submit_reads(plans, done)
            running.update(plan.key for plan in plans[:started])
            if started < len(plans):
                raise KVOffloadError("the engine is closed")

        finished = False
        self._lock.release()
        try:
            submit(todo)
            while running:
                plans, spent, error = batch.done_q.get()  # reads, as the pool finished them
                running.difference_update(plan.key for plan in plans)
                if error is not None:
                    raise error
                held -= spent
                if later and (held < limit or not running):
                    with self._lock:
                        m.check_open()  # close() waits for reads begun before it only
                        first = len(todo)
                        held = self._prepare_some(later, todo, held, limit, not running, fused)
                    submit(todo[first:])
            finished = True
        finally:
            # Interrupted (or the pool refused work): every read still set up ends as a miss
            # once its I/O, if started, is over, so that no key stays in flight, and the pins
            # kept for the caller, who will not get `out`, are dropped.
            while running:
                running.difference_update(plan.key for plan in batch.done_q.get()[0])
            self._lock.acquire()
            for plan in todo:
                if plan.key not in batch.ended:
                    m.read_done(plan)
                    if plan.tier in m.lower:
                        m.complete_read(plan, None, False)
                    else:  # closed under a hung read: nothing left to account to
                        m.unpin_locked(plan.entry)
            if not finished:
                for entry in out.values():
                    m.unpin_locked(entry)
        return out

    def _complete(
        self, batch: _Batch, plans: Sequence[ReadPlan], oks: Sequence[bool | None]
    ) -> None:
        """Complete reads of a batch that finished together on the pool thread that did them
        (not the batch's caller, so parts finish, and are copied out, side by side): publish
        them, hand each to `ready`, give back the side buffers copied out, and report to the
        batch. The books of the lot take the lock once (twice with side buffers) and wake
        the caller once: a block's own lock round and hand-off cost more than its books."""
        m = self._m
        spent = 0
        error: BaseException | None = None
        kept: list[tuple[bytes, DramEntry]] = []
        try:
            if batch.fuse is not None:  # before the books: a block is published only once checked
                oks = [check_fused(plan, batch.fuse) if plan.fused and ok else ok
                       for plan, ok in zip(plans, oks, strict=True)]  # fmt: skip
            with self._lock:
                for plan in plans:
                    m.read_done(plan)
                    batch.ended.add(plan.key)
                if m.closed:  # hung past close(): each serves nothing (check_not_closed)
                    for plan in plans:
                        m.unpin_locked(plan.entry)
                    raise KVOffloadError("the engine closed while this SSD read hung")
                for plan, ok in zip(plans, oks, strict=True):
                    try:
                        m.keep_read(plan, ok, batch.out)
                    except Exception as exc:  # one read's books failing leaves the others'
                        error = error or exc
                        continue
                    entry = batch.out.get(plan.key)
                    if entry is not None:
                        kept.append((plan.key, entry))
            ready = batch.ready
            copied = []
            if ready is not None:
                for key, entry in kept:
                    try:
                        if ready(key, entry) and entry.staging is not None:
                            copied.append(entry)
                    except BaseException as exc:  # the others are still copied out
                        error = error or exc
            if copied:
                with self._lock:
                    for entry in copied:
                        self._dram.spend(entry)  # copied out: its side buffer goes
                spent = len(copied)
        except BaseException as exc:  # the batch's caller raises it
            error = exc
        batch.done_q.put((plans, spent, error))

    def _prepare_some(
        self,
        later: deque[bytes],
        todo: list[ReadPlan],
        held: int,
        limit: int,
        idle: bool,
        fused: bool,
    ) -> int:
        """Plan reads of `later`'s keys into `todo` (lock held) while this batch holds fewer
        than `limit` side buffers (one more when nothing else runs: progress); `fused`: their
        values are checked as they are copied out (`Fuse`). Returns how many it holds then."""
        m = self._m
        started = False
        while later and (held < limit or (idle and not started)):
            key = later.popleft()
            if key in self._index or key in m.inflight:
                continue  # read by another caller meanwhile: `acquire` finds or waits for it
            plan = m.prepare_read(key, False)
            if plan is not None:
                plan.fused = fused
                todo.append(plan)
                started = True
                held += plan.entry.staging is not None
        return held

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Queue background reads into DRAM of the blocks of `keys` only a tier below holds
        and not already being read (called without the lock); returns how many of `keys`
        any tier holds."""
        found = 0
        m = self._m
        with self._lock:
            m.check_open()
            todo = []
            for key in keys:
                holder = m.holder(key)
                if holder is None:
                    continue
                found += 1
                if holder is not m.dram and key not in m.inflight and key not in self._queued:
                    self._queued.add(key)
                    todo.append(key)
        for key in todo:
            try:
                self._mover.submit_prefetch(self._prefetch_one, key)
            except RuntimeError:  # the pool shut down: close() began meanwhile
                with self._lock:
                    self._queued.difference_update(todo)
                raise KVOffloadError("the engine is closed") from None
        return found

    def _prefetch_one(self, key: bytes) -> None:
        m = self._m
        try:
            with self._lock:
                if not (m.closed or m.closing) and key not in self._index:
                    m.promote(key, prefetch=True)
        except KVOffloadError as exc:  # a background task: report, the get will retry
            log.warning("prefetch of block %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                self._queued.discard(key)

    def wait(self, deadline: float) -> list[bytes]:
        """Wait until no read back up is in flight (called without the lock), so that a get
        that began before close finishes its reads on tiers and an arena still there; the
        keys of reads still in flight at `deadline` (a hung device)."""
        m = self._m
        while True:
            with self._lock:
                inflight = dict(m.inflight)
            if not inflight:
                return []
            for event in inflight.values():
                if not event.wait(max(0.0, deadline - time.monotonic())):
                    with self._lock:
                        return list(m.inflight)
