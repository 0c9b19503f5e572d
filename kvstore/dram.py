"""The DRAM tier: one arena carved into page-aligned extents, the eviction policy and the pins.

Bookkeeping only, under the engine's lock: which extent holds which entry, which holes are
free, which keys readers pin, and which blocks to evict to make room. Where an evicted block
goes is decided by the engine's manager (`kvstore.manager`); the bytes move outside the lock,
on pinned slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.errors import CapacityError, ConfigError, KVOffloadError
from kvoffload.kvstore.arena import Arena
from kvoffload.kvstore.config import PAGE, DramConfig
from kvoffload.kvstore.eviction import make_policy
from kvoffload.kvstore.extents import ExtentAllocator
from kvoffload.kvstore.ssd.slotio import AlignedBuffer
from kvoffload.kvstore.stats import TierStats

__all__ = ["DramEntry", "DramTier"]


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


class DramTier:
    """The arena, its extent allocator, the DRAM eviction policy and the pinned keys.

    Every method expects the engine's lock to be held.
    """

    def __init__(self, config: DramConfig) -> None:
        self.alloc = ExtentAllocator(config.capacity_bytes)
        self.policy = make_policy(config.policy)
        self.pinned: set[bytes] = set()
        # Every entry that holds an arena slot (live, or dead and still pinned), by its slot's
        # start and end: the neighbours of a hole are found here.
        self.slots: dict[int, DramEntry] = {}
        self.slot_ends: dict[int, DramEntry] = {}
        self.last_hole = (0, 0)  # the free extent the last freed slot became part of
        self.tenant_used: dict[str, int] = {}  # slot bytes held per tenant
        # Side buffers of gets that found DRAM all pinned: taken in all, held now, most held.
        self.staged_gets = self.staged = self.staged_peak = 0
        self._prefault = config.prefault

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

    def reserve(
        self,
        size: int,
        index: dict[bytes, DramEntry],
        evict: Callable[[DramEntry, bool], None],
    ) -> int:
        """Find a free `size`-byte slot, evicting blocks when needed.

        Evicts the policy's victim, then widens the hole it left with the blocks on either side
        (colder first) until the value fits; pinned blocks are never moved or evicted, so this
        fails only when they leave no room. `evict(entry, neighbour)` makes a live, unpinned
        entry of `index` leave DRAM; it may release the lock while it writes to the SSD.

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
            if evicted > 2 * size and not self._room_possible(size):
                victims = None
            else:
                victims = self.policy.evict(1, self.pinned)
            if victims is None:
                raise CapacityError(
                    f"no room for a {size}-byte slot: every block that could make room is "
                    "pinned by an unreleased view"
                )
            victim = index[victims[0]]
            evicted += victim.slot
            evict(victim, False)
            while (entry := self._next_to_hole(victim.offset, size)) is not None:
                self.policy.remove(entry.key)
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

    def stats(self, n: dict[str, int], entries: int) -> TierStats:
        return TierStats(
            name="dram",
            capacity_bytes=self.arena.size,
            used_bytes=self.alloc.used_bytes,
            stored_bytes=n["stored"],
            entries=entries,
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
