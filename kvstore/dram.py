"""The DRAM tier: one arena carved into page-aligned extents, its index, the eviction policy
and the pins.

Bookkeeping only, under the engine's lock: which key holds which entry (`DramIndex`), which
extent holds which entry, which holes are free, which keys readers pin, and which blocks to
evict to make room. Where an evicted block goes is decided by the engine's manager
(`kvstore.manager`); the bytes move outside the lock, on pinned slots.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from kvoffload.core import dram_index_type
from kvoffload.errors import CapacityError, ConfigError, KVOffloadError
from kvoffload.kvstore.arena import AlignedBuffer, Arena
from kvoffload.kvstore.config import PAGE, DramConfig
from kvoffload.kvstore.eviction import Rank, make_policy
from kvoffload.kvstore.extents import ExtentAllocator
from kvoffload.kvstore.tier import TierStats

__all__ = ["TOUCH_RING", "DramEntry", "DramIndex", "DramTier", "new_index"]

# Hits queued in the index's touch ring before the tier hands them to the eviction policy
# (it does so sooner whenever the policy is asked anything).
TOUCH_RING = 256


@dataclass(eq=False, slots=True)
class DramEntry:
    key: bytes
    offset: int
    length: int
    slot: int  # bytes of its arena slot (whole pages)
    parent: bytes | None
    tick: int
    tenant: str = ""
    pins: int = 0
    # False once deleted, replaced or evicted; a pinned dead entry keeps its slot until released.
    live: bool = False
    # The SSD holds the same value, so evicting this block from DRAM needs no write.
    on_ssd: bool = False
    durable: bool = False
    # SSD sequence number of a durable put's own write (0 for any other entry).
    seq: int = 0
    # A block read from the SSD while DRAM had no room for it: served from a buffer of its own
    # (offset -1), never published.
    staging: AlignedBuffer | None = None
    spent: bool = False  # the staging buffer went back early (`DramTier.spend`)
    # The client's block metadata (opaque bytes, bounded by the front that took the put);
    # it travels with the block to the SSD and back.
    meta: bytes | None = None
    # CRC32C of the whole value, as its SSD slot recorded it and the engine checked it when it
    # read the block back into this memory (None: never read back). A live entry's bytes are
    # never rewritten, so a local reader may use it instead of summing them again.
    crc: int | None = None


class DramIndex:
    """Key -> live DRAM entry, with the pins readers hold and the hits not yet told to the
    eviction policy.

    The hot path of a get needs only this narrow interface: `lookup`, `pin`, `unpin`, and on
    the write side `insert` and `remove`; the eviction policy learns of hits from the ordered
    ring of touched entries (`drain_touches`), not on the get's own path. That is the seam the
    C index (`kvoffload.core._core.DramIndex`, `new_index`) takes over; this is the Python
    reference, which defines what is right.

    Concurrency: every method expects the engine's lock held, both forms, and runs under the
    GIL from start to end (the C one never releases it), so the lock alone orders the changes.
    """

    __slots__ = ("_entries", "_touched", "lookup", "pinned", "tick")

    def __init__(self) -> None:
        self._entries: dict[bytes, DramEntry] = {}
        # The live entry of a key, or None (the dict's own lookup: as fast as the dict).
        self.lookup: Callable[[bytes], DramEntry | None] = self._entries.get
        # Keys of live entries that views pin: eviction skips them.
        self.pinned: set[bytes] = set()
        self._touched: list[DramEntry] = []  # hits, in order, since the last drain
        self.tick = 0  # the recency clock: bumped by each hit and each new entry

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def values(self) -> Iterator[DramEntry]:
        """The live entries (a copy: callers may drop entries while they walk)."""
        return iter(list(self._entries.values()))

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def pin(self, entry: DramEntry) -> int:
        """Pin an entry for a reader; a live, published one counts as a hit (queued for the
        policy). Returns how many hits are queued."""
        entry.pins += 1
        if entry.staging is not None or not entry.live:
            return 0  # not (or no longer) in the index's books: nothing to touch
        self.tick += 1
        entry.tick = self.tick
        self._touched.append(entry)
        self.pinned.add(entry.key)
        return len(self._touched)

    def unpin(self, entry: DramEntry) -> bool:
        """Drop a reader's pin; True when that was the last pin of an entry no longer live
        (its slot may go now)."""
        entry.pins -= 1
        if entry.pins:
            return False
        if entry.live:
            self.pinned.discard(entry.key)
            return False
        return True

    def insert(self, entry: DramEntry) -> None:
        """Make a filled entry the key's live value (the caller removed an older one)."""
        entry.live = True
        self._entries[entry.key] = entry
        if entry.pins:
            self.pinned.add(entry.key)
        else:
            self.pinned.discard(entry.key)

    def remove(self, key: bytes) -> DramEntry:
        """Take the key's live entry out of the index."""
        entry = self._entries.pop(key)
        entry.live = False
        self.pinned.discard(key)
        return entry

    def drain_touches(self) -> list[DramEntry]:
        """The entries hit since the last drain, oldest first (the ring is emptied)."""
        touched, self._touched = self._touched, []
        return touched

    def retire(self) -> None:
        """Close: every entry stops being live (no longer a neighbour a reserve may evict)."""
        for entry in self._entries.values():
            entry.live = False
        self._entries.clear()
        self._touched = []


def new_index() -> DramIndex:
    """The C index when the C core is in use (`kvoffload.core`), else the Python reference."""
    index_type = dram_index_type()
    # The C twin has DramIndex's interface exactly (tests/unit/kvstore/test_dram_index.py).
    return DramIndex() if index_type is None else cast(DramIndex, index_type())


class DramTier:
    """The arena, its extent allocator, the index, the DRAM eviction policy and per-tenant
    recency (a `kvstore.tier.Tier`).

    Every method expects the engine's lock to be held. The policy and the recency lists are
    told of the index's queued hits before they are asked or changed, so they see every
    event in the order it happened.
    """

    name = "dram"

    def __init__(self, config: DramConfig) -> None:
        self.alloc = ExtentAllocator(config.capacity_bytes)
        self.index = new_index()
        self._policy = make_policy(config.policy)
        self.pinned = self.index.pinned
        # Per-tenant recency, to evict a tenant's own coldest blocks when it hits its quota.
        self._recency: dict[str, OrderedDict[bytes, None]] = {}
        # Every entry that holds an arena slot (live, or dead and still pinned), by its slot's
        # start and end: the neighbours of a hole are found here.
        self.slots: dict[int, DramEntry] = {}
        self.slot_ends: dict[int, DramEntry] = {}
        self.last_hole = (0, 0)  # the free extent the last freed slot became part of
        self.tenant_used: dict[str, int] = {}  # slot bytes held per tenant
        # Side buffers of gets that found DRAM all pinned: taken in all, held now, most held.
        self.staged_gets = self.staged = self.staged_peak = 0
        self._prefault = config.prefault

    # ------------------------------------------------------------------ Tier

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def length_of(self, key: bytes) -> int | None:
        entry = self.index.lookup(key)
        return None if entry is None else entry.length

    def meta_of(self, key: bytes) -> bytes | None:
        entry = self.index.lookup(key)
        return None if entry is None else entry.meta

    # ------------------------------------------------------------------ eviction order

    def apply_touches(self) -> None:
        """Tell the policy and the recency lists of the hits the index queued, in order."""
        policy, recency = self._policy, self._recency
        for entry in self.index.drain_touches():
            if entry.key in policy:  # not while a demotion writes it out
                policy.touch(entry.key)
            recency[entry.tenant].move_to_end(entry.key)

    def ranked(self, entry: DramEntry, rank: Rank) -> None:
        """A newly published entry joins the eviction order."""
        self.apply_touches()
        self._policy.insert(entry.key, rank)
        self._recency.setdefault(entry.tenant, OrderedDict())[entry.key] = None

    def unranked(self, entry: DramEntry) -> None:
        """A dropped entry leaves the eviction order."""
        self.apply_touches()
        self._policy.remove(entry.key)
        order = self._recency[entry.tenant]
        del order[entry.key]
        if not order:
            del self._recency[entry.tenant]

    def set_rank(self, key: bytes, rank: Rank) -> None:
        self.apply_touches()
        self._policy.set_rank(key, rank)

    def requeue(self, key: bytes, rank: Rank) -> None:
        """A block taken out of the policy's order (a victim being written out) is evictable
        again."""
        self.apply_touches()
        self._policy.insert(key, rank)

    def take_victim(self, tenant: str, keep: bytes) -> DramEntry | None:
        """The tenant's least recently used unpinned entry other than `keep`, taken out of the
        policy's order (a victim: a demotion may put it back); None if every one is pinned."""
        self.apply_touches()
        pinned = self.pinned
        order = self._recency.get(tenant, ())
        victim = next((k for k in order if k not in pinned and k != keep), None)
        if victim is None:
            return None
        self._policy.remove(victim)
        entry = self.index.lookup(victim)
        assert entry is not None
        return entry

    def take_policy_victim(self) -> DramEntry | None:
        """The policy's next unpinned victim, taken out of its order (a demotion may put it
        back); None if every entry is pinned (the background writer asks this)."""
        self.apply_touches()
        victims = self._policy.evict(1, self.pinned)
        if victims is None:
            return None
        entry = self.index.lookup(victims[0])
        assert entry is not None
        return entry

    @property
    def free_bytes(self) -> int:
        """Arena bytes no slot holds (possibly in several holes)."""
        return self.alloc.size - self.alloc.used_bytes

    def map_arena(self) -> None:
        """Map the arena (after the SSD tier opened: a failure here abandons that).

        Raises:
            ConfigError: the arena cannot be mapped.
        """
        try:
            self.arena = Arena(self.alloc.size, prefault=self._prefault)
        except OSError as exc:
            raise ConfigError(
                f"cannot map a DRAM arena of {self.alloc.size} bytes: {exc}; "
                "lower dram.capacity_bytes"
            ) from exc

    def staging_taken(self) -> None:
        """A get's block goes to a side buffer of its own (freed in `free`)."""
        self.staged_gets += 1
        self.staged += 1
        self.staged_peak = max(self.staged_peak, self.staged)

    def spend(self, entry: DramEntry) -> None:
        """Give back a staged entry's side buffer now that its bytes were copied out (it may
        stay pinned a while; nothing reads it again). Idempotent."""
        assert entry.staging is not None
        if not entry.spent:
            entry.spent = True
            self.staged -= 1
            with contextlib.suppress(BufferError):  # a caller's view may outlive the release
                entry.staging.close()

    def place(self, entry: DramEntry) -> None:
        """Record an entry on the slot just allocated for it."""
        self.slots[entry.offset] = self.slot_ends[entry.offset + entry.slot] = entry
        self._charge(entry, +1)

    def free(self, entry: DramEntry) -> None:
        """Give back an unpinned entry's slot (or staging buffer)."""
        if entry.staging is not None:
            self.spend(entry)
            return
        del self.slots[entry.offset]
        del self.slot_ends[entry.offset + entry.slot]
        self.last_hole = self.alloc.free(entry.offset, entry.slot)
        self._charge(entry, -1)

    def _charge(self, entry: DramEntry, sign: int) -> None:
        used = self.tenant_used.get(entry.tenant, 0) + sign * entry.slot
        if used:
            self.tenant_used[entry.tenant] = used
        else:
            self.tenant_used.pop(entry.tenant, None)

    def pages(self, entry: DramEntry) -> memoryview:
        """The entry's value rounded up to whole pages (its slot is at least that large)."""
        end = entry.offset + -(-entry.length // PAGE) * PAGE
        return self.arena.view[entry.offset : end]

    def value(self, entry: DramEntry) -> memoryview:
        """The entry's value bytes.

        Raises:
            KVOffloadError: the engine closed (its arena is unmapped) under a copy-out that
                runs without the lock.
        """
        if entry.staging is not None:
            return entry.staging.view[: entry.length]
        try:
            return self.arena.view[entry.offset : entry.offset + entry.length]
        except ValueError:  # the released view of a closed arena
            raise KVOffloadError("the engine is closed") from None

    def reserve(self, size: int, evict: Callable[[DramEntry, bool], None]) -> int:
        """Find a free `size`-byte slot, evicting blocks when needed.

        Evicts the policy's victim, then widens the hole it left with the blocks on either side
        (colder first) until the value fits; pinned blocks are never moved or evicted, so this
        fails only when they leave no room. `evict(entry, neighbour)` makes a live, unpinned
        entry leave DRAM; it may release the lock while it writes to the SSD.

        Raises:
            CapacityError: pinned blocks leave no hole of `size` bytes.
        """
        evicted = 0
        while True:
            offset = self.alloc.alloc(size)
            if offset is not None:
                return offset
            # Pinned blocks may leave no hole large enough at all: find out before evicting
            # everything else for nothing (checked only once evictions did not suffice).
            self.apply_touches()  # the policy may be asked: after a released lock too
            if evicted > 2 * size and not self._room_possible(size):
                victims = None
            else:
                victims = self._policy.evict(1, self.pinned)
            if victims is None:
                raise CapacityError(
                    f"no room for a {size}-byte slot: every block that could make room is "
                    "pinned by an unreleased view"
                )
            victim = self.index.lookup(victims[0])
            assert victim is not None
            evicted += victim.slot
            evict(victim, False)
            while (entry := self._next_to_hole(victim.offset, size)) is not None:
                self.apply_touches()
                self._policy.remove(entry.key)
                evict(entry, True)

    def _room_possible(self, size: int) -> bool:
        """Whether evicting every unpinned block would leave a hole of `size` bytes."""
        at = 0
        for start in sorted(o for o, e in self.slots.items() if e.pins):
            if start - at >= size:
                return True
            at = start + self.slots[start].slot
        return self.alloc.size - at >= size

    def _next_to_hole(self, offset: int, size: int) -> DramEntry | None:
        """The colder unpinned live block beside the hole at `offset` (just freed), while that
        hole is still free and smaller than `size` bytes; None when there is nothing to widen."""
        hole = self.last_hole
        if not (hole[0] <= offset < hole[1] and self.alloc.is_free(*hole)):
            return None  # not freed (a reader pinned it), or taken while the lock was released
        if hole[1] - hole[0] >= size:
            return None
        sides = (self.slot_ends.get(hole[0]), self.slots.get(hole[1]))
        movable = [e for e in sides if e is not None and e.pins == 0 and e.live]
        return min(movable, key=lambda e: e.tick) if movable else None

    def stats(self, n: Mapping[str, int]) -> TierStats:
        return TierStats(
            name="dram",
            capacity_bytes=self.arena.size,
            used_bytes=self.alloc.used_bytes,
            stored_bytes=n["stored"],
            entries=len(self.index),
            pinned=len(self.pinned),
            hits=n["hits"],
            misses=n["misses"] + n["ssd_hits"],
            evictions=n["evictions"],
            bytes_written=n["bytes_in"],
            bytes_read=n["bytes_out"],
            demotions=n["demotions"],
            promotions=n["promotions"],
            prefetches=n["prefetches"],
        )
