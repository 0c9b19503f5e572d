"""The engine's manager: the books over every tier, and the plans that move blocks between
them.

It keeps the DRAM tier's index and lineage, per-tenant quotas and the engine's counters, and
decides what moves: it *prepares* a plan (which block to write down, read back or wipe, into
which tier and which DRAM slot), hands it to the mover (`kvstore.mover`) to execute, and
*completes* it with the outcome (publish, drop, re-rank, report). The tiers (`kvstore.dram`,
`kvstore.ssd.tier`) keep their own books; the engine holds them fastest first and the
manager walks the list (`tiers`; `lower` for those below DRAM) rather than asking whether an
SSD is there.

Every method expects the engine's lock held unless it says otherwise; those that may evict
can release it while a demotion writes (the entry is pinned meanwhile), as the comments say.

Demotion runs off the request path (`dram.demote_background`, with a tier below): a writer
thread (`kvstore.mover.Demoter`, owned by the mover; this manager is its `WriterHost`) evicts
in the policy's order, writing blocks down, whenever free DRAM falls below `dram.demote_low`
of the arena, until `dram.demote_high` is free. A request finds room without evicting while
the writer keeps up; when the SSD cannot (the puts outrun it), a request that finds no room
writes its own victim, as before the writer: it waits for that one slot write, never for a
queue (docs/design/ssd-tier.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from kvoffload.buffers import Bytes
from kvoffload.errors import CapacityError, InvalidArgumentError, KVOffloadError, StorageIOError
from kvoffload.kvstore.arena import AlignedBuffer
from kvoffload.kvstore.config import EngineConfig
from kvoffload.kvstore.dram import DramEntry, DramTier
from kvoffload.kvstore.eviction import Rank
from kvoffload.kvstore.extents import slot_bytes
from kvoffload.kvstore.mover import (
    Fuse,
    Mover,
    ReadLatch,
    ReadPlan,
    WriteBack,
    WriteThrough,
    check_fused,
)
from kvoffload.kvstore.ssd.admission import FrequencySketch
from kvoffload.kvstore.ssd.index import SsdIndex
from kvoffload.kvstore.ssd.tier import SsdTier
from kvoffload.kvstore.tier import Tier, TierStats

__all__ = ["EngineStats", "Manager", "TierListener"]

log = logging.getLogger(__name__)

# listener(kind, key, tier): kind "stored" or "removed", tier "dram" or "ssd".
TierListener = Callable[[str, bytes, str], None]

# Arenas of engines closed while an SSD read into them hung: kept mapped for good.
_LEAKED: list[object] = []


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine's counters (taken under its lock)."""

    policy: str
    puts: int
    gets: int
    hits: int
    misses: int
    deletes: int
    evictions: int
    # Evictions of blocks next to a victim, to widen its hole until a larger value fits.
    neighbour_evictions: int
    tiers: tuple[TierStats, ...] = field(default_factory=tuple)
    # DRAM slot bytes held per tenant (all tenants that hold anything or have a quota).
    tenant_bytes: dict[str, int] = field(default_factory=dict)
    # SSD slot bytes held per tenant (tenants that hold anything there).
    ssd_tenant_bytes: dict[str, int] = field(default_factory=dict)
    durable_puts: int = 0
    admission_rejected: int = 0  # DRAM evictions the admission filter kept off the SSD
    checkpoints: int = 0
    # Gets of SSD blocks read into a side buffer of their own because pinned views held all of
    # DRAM, and the most such buffers held at once (a batch's are bounded by its caller).
    staged_gets: int = 0
    staged_peak: int = 0
    # Demotions (DRAM -> SSD writes on eviction) by the background writer and on a request's
    # own thread (the writer off, or behind a disk slower than the puts); requests that wrote
    # a victim themselves for room, and the seconds that took them in all.
    demotions_background: int = 0
    demotions_inline: int = 0
    room_waits: int = 0
    room_wait_seconds: float = 0.0
    # Calls of the tier listener that raised (logged the first time only; see `notify`).
    listener_errors: int = 0
    recovery: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Manager:
    """Keys to DRAM entries, chains, per-tenant quotas and counters, over every tier."""

    def __init__(
        self, config: EngineConfig, lock: threading.Lock, dram: DramTier, mover: Mover
    ) -> None:
        self.config = config
        self.lock = lock
        self.dram = dram
        self.mover = mover
        self.index = dram.index
        self.lower: list[SsdTier] = []  # the tiers below DRAM, fastest first
        self.tiers: list[Tier] = [dram]  # every tier, fastest first
        # parent key -> stored children in DRAM; parents need not be stored themselves.
        self._children: dict[bytes, set[bytes]] = {}
        self.closed = False
        self.closing = False  # close() began: new calls fail, in-flight reads finish
        self.closed_event = threading.Event()  # set when close() has finished
        self.quotas: dict[str, int] = {}
        self.n = dict.fromkeys(
            ("puts", "gets", "hits", "misses", "deletes", "evictions", "neighbours", "bytes_in",
             "bytes_out", "stored", "demotions", "promotions", "prefetches", "durable",
             "admission_rejected", "ssd_hits", "ssd_misses", "demotions_background",
             "demotions_inline", "room_waits", "room_wait_ns", "listener_errors"),
            0,
        )  # fmt: skip
        self.inflight: dict[bytes, ReadLatch] = {}  # reads back into DRAM, by key
        self.sketch: FrequencySketch | None = None  # admission to the tiers below DRAM
        self.listener: TierListener | None = None
        self._evict_cb = self._evict_for_room  # bound once: `claim` runs on every put
        # The background demotion writer (`start_writer`).
        self.writer_on = False  # it runs: claims wake it below the low watermark
        self._woken = False  # a wake is pending: the next claims need not send another
        capacity = config.dram.capacity_bytes
        self._low = int(capacity * config.dram.demote_low)
        self._high = int(capacity * config.dram.demote_high)

    def attach(self, tier: SsdTier) -> None:
        """A tier below DRAM (the SSD) joins, slowest last."""
        self.lower.append(tier)
        self.tiers.append(tier)
        if self.sketch is None:
            self.sketch = FrequencySketch()

    def start_writer(self) -> None:
        """Start the background demotion writer (called without the lock, once the arena is
        mapped; only with a tier below and `dram.demote_background`)."""
        self.mover.start_demoter(self, self.lower[0].write_batch)
        with self.lock:
            self.writer_on = True

    def stop_writer(self) -> None:
        """Stop the writer (called without the lock); returns once its thread has ended (after
        the write it has in flight)."""
        with self.lock:
            self.writer_on = False
        self.mover.stop_demoter()

    def detach_lower(self) -> list[SsdTier]:
        """From now on there is no tier below DRAM (a closed engine, or a test's simulated
        crash); the tiers that were."""
        gone, self.lower = self.lower, []
        self.tiers = [self.dram]
        return gone

    def set_quota(self, tenant: str, quota_bytes: int | None, lower_bytes: int | None) -> None:
        """See `Engine.set_quota` (called without the lock)."""
        for what, value in (("quota", quota_bytes), ("SSD quota", lower_bytes)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{what} must not be negative, got {value}")
        with self.lock:
            if lower_bytes is not None and not self.lower:
                raise InvalidArgumentError("an SSD quota needs an SSD tier")
            if quota_bytes is None:
                self.quotas.pop(tenant, None)
            else:
                self.quotas[tenant] = quota_bytes
            for tier in self.lower:
                tier.set_quota(tenant, lower_bytes)

    def notify(self, kind: str, key: bytes, tier: str) -> None:
        """Report a change that has happened to the listener. What the listener raises is
        counted (`listener_errors`), logged the first time only, and never passed on: it is
        called with pins and planned SSD slots held (the demotion writer's batch, a durable
        put's write in flight), and an exception from it would leave those behind or end the
        writer's thread."""
        if self.listener is None:
            return
        try:
            self.listener(kind, key, tier)
        except Exception:
            self.n["listener_errors"] += 1
            if self.n["listener_errors"] == 1:
                log.exception("kvoffload: the tier listener raised; counted in listener_errors "
                              "from now on, not logged again")  # fmt: skip

    def check_open(self) -> None:
        if self.closed or self.closing:
            raise KVOffloadError("the engine is closed")

    def stored(self, key: bytes) -> bool:
        return self.holder(key) is not None

    def holder(self, key: bytes) -> Tier | None:
        """The fastest tier that holds `key`, or None."""
        if key in self.index:
            return self.dram
        for tier in self.lower:
            if tier.contains(key):
                return tier
        return None

    # ------------------------------------------------------------------ tier callbacks

    def stored_below(self, tier: str, key: bytes) -> None:
        """The tier below DRAM named `tier` committed a copy of `key` (its callback, lock
        held). By name, not the tier itself: a tier holding a callback that holds it would
        outlive its close until the cyclic GC ran."""
        self.notify("stored", key, tier)

    def removed_below(self, tier: str, key: bytes) -> None:
        """The tier below DRAM named `tier` dropped its copy of `key` (its callback, lock
        held)."""
        entry = self.index.lookup(key)
        if entry is not None:
            entry.on_ssd = False  # the copy below is gone: evicting the DRAM copy must write it
        self.notify("removed", key, tier)

    # ------------------------------------------------------------------ pins

    def unpin(self, entry: DramEntry) -> None:
        """`unpin_locked`, taking the lock (called without it)."""
        with self.lock:
            self.unpin_locked(entry)

    def unpin_locked(self, entry: DramEntry) -> None:
        if self.index.unpin(entry) and not self.closed:
            self.dram.free(entry)

    # ------------------------------------------------------------------ writes

    def claim(
        self, key: bytes, length: int, size: int, parent: bytes | None, tenant: str
    ) -> DramEntry:
        """A pinned, unpublished entry on a fresh `size`-byte slot (may evict to make room)."""
        offset = self.dram.reserve(size, self._evict_cb)
        entry = DramEntry(key, offset, length, size, parent, self.index.next_tick(), tenant,
                          pins=1)  # fmt: skip
        self.dram.place(entry)
        if self.writer_on and not self._woken and self.dram.free_bytes < self._low:
            self._wake_writer()
        return entry

    def reserve(
        self, key: bytes, length: int, parent: bytes | None, tenant: str, meta: bytes | None
    ) -> tuple[DramEntry, Bytes, memoryview]:
        """`claim` a slot for a put within the tenant's quota (called without the lock): the
        entry and writable views of exactly the value's bytes (the slot may be larger)."""
        with self.lock:
            self.check_open()
            size = slot_bytes(length)
            self.fit_quota(tenant, key, size)
            entry = self.claim(key, length, size, parent, tenant)
            entry.meta = meta
            if self.sketch is not None:
                self.sketch.add(key)
            # Sliced under the lock: a close right after it unmaps the arena (`retire`), and
            # these exports keep the mapping alive until the reservation ends (its commit
            # then raises KVOffloadError).
            arena, end = self.dram.arena, entry.offset + entry.length
            return entry, arena.array[entry.offset : end], arena.view[entry.offset : end]

    def commit(self, entry: DramEntry, durable: bool, if_stored: bool | None = None) -> bool:
        """Publish a filled reservation (called without the lock); durable ones are written
        through to the tier below first (`prepare_write_through` .. `complete_write_through`)."""
        if durable:
            with self.lock:
                plan = self.prepare_write_through(entry)
                try:
                    seq = self.mover.write_through(plan)
                except BaseException:
                    self.unpin_locked(entry)  # never published: frees the slot
                    raise
                self.complete_write_through(plan, seq)
            return True
        with self.lock:
            if self.closed or self.closing:
                # close() began after the reservation: a value published now would be in no
                # tier once it ends (its flush may be over), so the put fails instead.
                self.unpin_locked(entry)
                raise KVOffloadError("the engine is closed")
            if if_stored is not None and self.stored(entry.key) != if_stored:
                self.unpin_locked(entry)  # never published: frees the slot
                return False
            self.publish(entry, put=True)
        return True

    def prepare_write_through(self, entry: DramEntry) -> WriteThrough:
        """Plan a durable put's write to the tier below (a filled reservation, pinned).

        Raises:
            KVOffloadError: the engine closed; the reservation is given back.
        """
        try:
            self.check_open()
        except BaseException:
            self.unpin_locked(entry)  # never published: frees the slot
            raise
        return WriteThrough(entry, self.lower[0], self.dram.pages(entry))

    def complete_write_through(self, plan: WriteThrough, seq: int) -> None:
        """Publish a durable put written as `seq`, then wait for its journal record.

        The tier below decides the order of overlapping durable puts of a key: the highest seq
        wins in both tiers, so what readers see before a crash is what the store holds after.
        """
        tier, entry = plan.tier, plan.entry
        key = entry.key
        tier.write_through_done(key, seq)
        self.n["durable"] += 1
        row_seq = tier.seq_of(key)
        if row_seq > seq:
            # A newer durable put of the key owns the SSD copy: ours comes before it. Until
            # that put publishes, DRAM must not serve anything older than it.
            current = self.index.lookup(key)
            if current is not None and current.seq != row_seq:
                self.drop(current)
                self.notify("removed", key, "dram")
            self.n["puts"] += 1
            self.unpin_locked(entry)
            return
        entry.on_ssd = entry.durable = row_seq == seq
        entry.seq = seq
        self.publish(entry, put=True, lower_seq=seq)

    def publish(self, entry: DramEntry, *, put: bool, lower_seq: int | None = None) -> None:
        """Make a filled entry the key's DRAM value. A copy below of an older value goes: for
        a durable put (`lower_seq`) one older than its own write, for a fast put any copy but
        one that a durable put of the key is still writing (those are newer or overlap it)."""
        key = entry.key
        old = self.index.lookup(key)
        if old is not None:
            self.drop(old)
        if not entry.on_ssd:
            for tier in self.lower:
                tier.drop_older(key, lower_seq)
        entry.pins -= 1
        self.index.insert(entry)
        if put:
            self.n["puts"] += 1
            self.n["bytes_in"] += entry.length
            self.notify("stored", key, "dram")
        self.n["stored"] += entry.length
        self.dram.ranked(entry, self.rank(key, entry.parent))
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(key)
            self._rerank(entry.parent)
        for child in self._children.get(key, ()):
            self._rerank(child)  # orphans found their parent again
        if old is not None and old.pins and entry.tenant in self.quotas:
            # A reader pinned the old value after fit_quota counted it as freed. Last: this
            # may release the lock (demotions), and the index is consistent by now.
            self.fit_quota(entry.tenant, key, 0, strict=False)

    def drop(self, entry: DramEntry) -> None:
        """Take a live entry out of the DRAM index; free its slot unless a view pins it."""
        key = entry.key
        self.dram.unranked(entry)
        self.index.remove(key)
        self.n["stored"] -= entry.length
        if entry.parent is not None:
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.parent]
                self._rerank(entry.parent)
        for child in self._children.get(key, ()):
            self._rerank(child)  # now orphans unless a tier below holds the parent
        if entry.pins == 0:
            self.dram.free(entry)

    def delete(self, key: bytes) -> bool:
        """Remove `key` from every tier (called without the lock); True if it was stored. The
        slots below are wiped with the lock released."""
        with self.lock:
            self.check_open()
            found = False
            entry = self.index.lookup(key)
            if entry is not None:
                self.drop(entry)
                found = True
            wipes = []
            for tier in self.lower:
                wipe = tier.detach(key)
                if wipe is not None:
                    wipes.append((tier, wipe))
            found |= bool(wipes)
            self.n["deletes"] += found
        for tier, wipe in wipes:
            self.mover.wipe(tier, wipe)
        return found

    # ------------------------------------------------------------------ making room

    def _evict_for_room(self, entry: DramEntry, neighbour: bool) -> None:
        self.n["evictions"] += 1
        self.n["neighbours"] += neighbour
        self._evict(entry)

    def _evict(self, entry: DramEntry) -> None:
        """Make a live, unpinned entry leave DRAM on a request's thread: dropped, or first
        written to the tier below if it admits the block (the request waits on the SSD).

        May release the lock while the write runs; the entry is pinned meanwhile.
        """
        tier = self._write_to(entry)
        if tier is None:
            self.drop(entry)
            self.notify("removed", entry.key, "dram")
            return
        started = time.monotonic_ns()
        self.demote(tier, entry, drop=True, where="inline")
        self.n["room_waits"] += 1
        self.n["room_wait_ns"] += time.monotonic_ns() - started

    def _write_to(self, entry: DramEntry) -> SsdTier | None:
        """The tier a victim must be written to before it leaves DRAM; None if it can just
        go (a copy below already, no tier below, or the admission filter keeps it off:
        counted)."""
        if entry.on_ssd or not self.lower:
            return None
        assert self.sketch is not None
        if self.sketch.estimate(entry.key) < self.config.ssd.admission_min_uses:
            self.n["admission_rejected"] += 1
            return None
        return self.lower[0]

    def demote(
        self, tier: SsdTier, entry: DramEntry, *, drop: bool, where: str | None = None
    ) -> None:
        """Write a live DRAM block down to `tier` (`prepare_write_back` .., then
        `complete_write_back`), then with `drop` take it out of DRAM. Releases the lock for
        the write. `where` ("inline") picks the counter of an eviction's write; None for a
        flush."""
        plan = self.prepare_write_back(tier, entry, drop=drop)
        if plan is not None:
            committed = self.mover.write_back(plan)
            if committed and where is not None:
                self.n["demotions_" + where] += 1
            self.complete_write_back(plan, committed, drop=drop)

    # ------------------------------------------------------------------ the demotion writer

    def _wake_writer(self) -> None:
        self._woken = True
        demoter = self.mover.demoter
        assert demoter is not None
        demoter.wake()

    # `WriterHost`: what the writer's loop (`Demoter`) asks, lock held.

    def writer_woken(self) -> None:
        self._woken = False

    def wants_room(self) -> bool:
        if not self.writer_on or self.closing or self.closed or not self.lower:
            return False
        return self.dram.free_bytes < self._high

    def plan_demotions(self, limit: int) -> list[WriteBack] | None:
        # Victims are taken until the slots they hold would bring free DRAM to the high
        # watermark: a batch frees what one-by-one eviction would have, no more.
        plans: list[WriteBack] = []
        pending = 0
        while len(plans) < limit and self.dram.free_bytes + pending < self._high:
            victim = self.dram.take_policy_victim()
            if victim is None:
                return plans or None
            self.n["evictions"] += 1
            plan = self._background_plan(victim)
            if plan is not None:
                plans.append(plan)
                pending += victim.slot
        return plans

    def _background_plan(self, entry: DramEntry) -> WriteBack | None:
        """`_evict` for the writer, up to the write: the victim's write planned (pinned), or
        None once it left DRAM (it needed no write, or the tier had no room)."""
        tier = self._write_to(entry)
        if tier is not None:
            return self.prepare_write_back(tier, entry, drop=True)
        self.drop(entry)
        self.notify("removed", entry.key, "dram")
        return None

    def complete_demotions(self, plans: Sequence[WriteBack], committed: Sequence[bool]) -> None:
        # Every plan is completed even if one's booking raises: one left out stays pinned.
        error: Exception | None = None
        for plan, ok in zip(plans, committed, strict=True):
            self.n["demotions_background"] += ok
            try:
                self.complete_write_back(plan, ok, drop=True)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def prepare_write_back(
        self, tier: SsdTier, entry: DramEntry, *, drop: bool
    ) -> WriteBack | None:
        """Plan a demotion: a slot below, the entry pinned for the write. None if the tier
        has no room or failed (with `drop`, the block leaves DRAM all the same)."""
        try:
            write = tier.plan_write(entry.key, entry.length, entry.parent, entry.tenant,
                                    entry.meta)  # fmt: skip
        except (CapacityError, StorageIOError) as exc:
            log.warning("cannot demote block %s: %s", entry.key.hex(), exc)
            if drop:
                self.drop(entry)
                self.notify("removed", entry.key, "dram")  # routers must not count on it
            return None
        entry.pins += 1
        self.dram.pinned.add(entry.key)
        # Deleted or overwritten while writing: not committed.
        return WriteBack(entry, tier, write, self.dram.pages(entry), lambda: entry.live)

    def complete_write_back(self, plan: WriteBack, committed: bool, *, drop: bool) -> None:
        entry = plan.entry
        if committed:
            entry.on_ssd = True
            self.n["demotions"] += 1
        self.unpin_locked(entry)
        if drop and entry.live:
            if entry.pins:
                # A reader got here first; keep it evictable later (now a clean copy).
                self.dram.requeue(entry.key, self.rank(entry.key, entry.parent))
            else:
                self.drop(entry)
                self.notify("removed", entry.key, "dram")
        plan.tier.checkpoint_if_due()

    def fit_quota(self, tenant: str, key: bytes, size: int, *, strict: bool = True) -> None:
        """Evict the tenant's coldest unpinned blocks until `size` more bytes fit its quota.

        With `strict` False, stop quietly when only pinned blocks are left.
        """
        quota = self.quotas.get(tenant)
        if quota is None:
            return
        if size > quota:
            if not strict:
                return
            raise CapacityError(f"a {size}-byte slot exceeds tenant {tenant!r}'s quota of {quota}")
        old = self.index.lookup(key)
        # The value this put replaces is freed on publish (unless a view pins it); do not evict
        # on its account.
        credit = 0
        if old is not None and old.tenant == tenant and old.pins == 0:
            credit = old.slot
        used = self.dram.tenant_used
        while used.get(tenant, 0) - credit + size > quota:
            victim = self.dram.take_victim(tenant, key)
            if victim is None:
                if not strict:
                    return
                raise CapacityError(
                    f"tenant {tenant!r} is at its quota of {quota} bytes and every block it "
                    "holds is pinned"
                )
            self.n["evictions"] += 1
            self._evict(victim)

    def flush(self) -> None:
        """Write every live DRAM block without a copy below down (clean shutdown; called
        without the lock)."""
        with self.lock:
            for tier in self.lower[:1]:
                for entry in self.index.values():
                    if entry.live and not entry.on_ssd:
                        self.demote(tier, entry, drop=False)

    # ------------------------------------------------------------------ reads back up

    def promote(
        self, key: bytes, *, prefetch: bool = False, fuse: Fuse | None = None
    ) -> DramEntry | None:
        """Read a block only a tier below holds into DRAM; the published entry, or None if it
        is gone or fails verification (with `fuse`, checked as it is copied out, before it is
        published). Releases the lock for the read; a read of the key in flight already is
        waited for, not repeated."""
        while key in self.inflight:
            event = self.inflight[key]
            self.lock.release()
            try:
                event.wait()
            finally:
                self.lock.acquire()
            self.check_open()  # close() may have begun (or ended) meanwhile
            done = self.index.lookup(key)
            if done is not None:
                return done
        plan = self.prepare_read(key, prefetch)
        if plan is None:
            return None
        plan.fused = fuse is not None
        try:
            ok = self.fused_check(plan, self.mover.read(plan), fuse)
        finally:
            self.read_done(plan)
        self.check_not_closed(plan)
        entry = self.complete_read(plan, ok, prefetch)
        if entry is not None and entry.staging is not None:
            entry.pins -= 1  # the caller's `acquire` pins it
        return entry

    def fused_check(self, plan: ReadPlan, ok: bool | None, fuse: Fuse | None) -> bool | None:
        """A read's `ok` once a fused read's value is checked as `fuse` copies it out (lock
        held on entry and return, released for the copy: the key stays in flight, so its
        other readers wait for the checked answer)."""
        if not (plan.fused and ok):
            return ok
        self.lock.release()
        try:
            return check_fused(plan, fuse)
        finally:
            self.lock.acquire()

    def prepare_read(self, key: bytes, prefetch: bool) -> ReadPlan | None:
        """Plan a read of `key` back into DRAM: the block pinned below, a reserved DRAM slot
        (or, for a get when pinned views hold all of DRAM, a buffer of its own), and the key
        marked in flight. None if no tier below holds it."""
        for tier in self.lower:
            block = tier.find_block(key)
            if block is not None:
                break
        else:
            return None
        length = block.length
        if length > self.config.dram.effective_max_value_bytes:
            return None  # written under a larger DRAM limit; cannot be staged in DRAM
        tier.pin(block)
        event = ReadLatch()
        self.inflight[key] = event
        try:
            size = slot_bytes(length)
            self.fit_quota(block.tenant, key, size, strict=False)
            try:
                entry = self.claim(key, length, size, block.parent, block.tenant)
                entry.meta = block.meta
                entry.seq = block.snap[3]
                entry.on_ssd = True
                dst = self.dram.pages(entry)
            except CapacityError:
                if prefetch:
                    raise
                # Pinned views hold all of DRAM: serve this get from a buffer of its own.
                entry = DramEntry(key, -1, length, 0, block.parent, 0, block.tenant, pins=1,
                                  meta=block.meta)  # fmt: skip
                entry.staging = AlignedBuffer(size)
                dst = entry.staging.view
                self.dram.staging_taken()
        except BaseException:
            tier.unpin(block)
            del self.inflight[key]
            event.set()
            raise
        return ReadPlan(key, tier, block, entry, dst, event)

    def read_done(self, plan: ReadPlan) -> None:
        """The read's I/O is over: its block unpinned, its waiters woken."""
        if plan.tier in self.lower:  # else close() gave up waiting for this read (it hung)
            plan.tier.unpin(plan.block)
        del self.inflight[plan.key]
        plan.event.set()

    def check_not_closed(self, plan: ReadPlan) -> None:
        """A read that outlived close() (it hung) serves nothing: its slot is given up with
        the engine's books, and the caller learns the engine is closed."""
        if self.closed:
            self.unpin_locked(plan.entry)
            raise KVOffloadError("the engine closed while this SSD read hung")

    def complete_read(self, plan: ReadPlan, ok: bool | None, prefetch: bool) -> DramEntry | None:
        """Publish a finished read: the key's entry now, or None if the block was gone or
        failed verification."""
        key, entry = plan.key, plan.entry
        current = plan.tier.finish_read(plan.block, ok)
        if current is None:
            self.unpin_locked(entry)
            return None
        if key in self.index or not current:
            self.unpin_locked(entry)  # written or deleted while we read: ours is stale
            return self.index.lookup(key)
        plan.tier.touch(plan.block)
        if entry.staging is not None:
            return entry
        self.n["promotions"] += 1
        self.n["prefetches"] += prefetch
        self.publish(entry, put=False)
        self.notify("stored", key, "dram")
        return entry

    def keep_read(self, plan: ReadPlan, ok: bool | None, out: dict[bytes, DramEntry]) -> None:
        """Complete a batch's read, keeping a pin on its entry for the caller; a block gone,
        damaged or replaced meanwhile is left out."""
        entry = self.complete_read(plan, ok, False)
        if entry is not plan.entry:
            return
        if entry.staging is None:  # published unpinned just now: pinned before anyone evicts
            entry.pins += 1
            self.dram.pinned.add(entry.key)
        out[plan.key] = entry

    # ------------------------------------------------------------------ lineage

    def rank(self, key: bytes, parent: bytes | None) -> Rank:
        if parent is not None and not self.stored(parent):
            return Rank.ORPHAN
        return Rank.INTERIOR if self._children.get(key) else Rank.LEAF

    def lower_rank(self, index: SsdIndex, row: int) -> int:
        """The prefix policy's view of a block below DRAM, across every tier."""
        parent = index.parent_of(row)
        if parent is not None and not self.stored(parent):
            return int(Rank.ORPHAN)
        key = index.key_of(row)
        if index.has_child(key) or self._children.get(key):
            return int(Rank.INTERIOR)
        return int(Rank.LEAF)

    def _rerank(self, key: bytes) -> None:
        entry = self.index.lookup(key)
        if entry is not None:
            self.dram.set_rank(key, self.rank(key, entry.parent))

    # ------------------------------------------------------------------ close

    def begin_close(self) -> bool:
        """close() begins (lock held): calls from now on fail. False if one began before."""
        first = not (self.closed or self.closing)
        self.closing = True
        return first

    def retire(self, hung: bool) -> list[SsdTier]:
        """Close the books (lock held): every DRAM entry retired, the arena unmapped (leaked
        if a hung read may still write into it), the tiers below detached; those are returned
        for the caller to close outside the lock."""
        self.closed = True
        self.index.retire()
        if hung:
            # A hung read may still write into the arena: never unmap it under the read (a
            # backend may hold its raw address); it is leaked instead.
            _LEAKED.append(self.dram.arena)
        else:
            self.dram.arena.close()
        return self.detach_lower()

    # ------------------------------------------------------------------ stats

    def snapshot(self, policy: str) -> EngineStats:
        """The engine's counters and every tier's."""
        n = self.n
        used = self.dram.tenant_used
        lower_tenants: dict[str, int] = {}
        recovery: dict[str, object] = {}
        checkpoints = 0
        for tier in self.lower:
            lower_tenants.update(tier.tenant_usage())
            checkpoints += tier.counters.checkpoints
            recovery = asdict(tier.recovery)
        return EngineStats(
            policy=policy,
            puts=n["puts"],
            gets=n["gets"],
            hits=n["hits"] + n["ssd_hits"],
            misses=n["misses"],
            deletes=n["deletes"],
            evictions=n["evictions"],
            neighbour_evictions=n["neighbours"],
            tiers=tuple(tier.stats(n) for tier in self.tiers),
            tenant_bytes={t: used.get(t, 0) for t in used.keys() | self.quotas.keys()},
            ssd_tenant_bytes=lower_tenants,
            durable_puts=n["durable"],
            admission_rejected=n["admission_rejected"],
            checkpoints=checkpoints,
            staged_gets=self.dram.staged_gets,
            staged_peak=self.dram.staged_peak,
            demotions_background=n["demotions_background"],
            demotions_inline=n["demotions_inline"],
            room_waits=n["room_waits"],
            room_wait_seconds=n["room_wait_ns"] / 1e9,
            listener_errors=n["listener_errors"],
            recovery=recovery,
        )
