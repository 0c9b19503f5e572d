"""What a storage tier is to the engine: the `Tier` protocol that the DRAM tier
(`kvstore.dram.DramTier`) and the SSD tier (`kvstore.ssd.tier.SsdTier`) implement, and the
counters each reports.

The engine holds its tiers in order, fastest first (DRAM, then the SSD when it has one), and
asks them in turn; nothing above the tiers branches on which of them exist. Every method
expects the engine's lock held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Tier", "TierStats"]


@dataclass(frozen=True)
class TierStats:
    """Counters of one storage tier."""

    name: str
    capacity_bytes: int
    used_bytes: int  # bytes of the slots in use (what counts against capacity)
    stored_bytes: int  # bytes of the values in those slots
    entries: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int
    demotions: int = 0  # blocks written to the next tier down when evicted (DRAM -> SSD)
    promotions: int = 0  # blocks read back up into DRAM (SSD -> DRAM), prefetches included
    prefetches: int = 0  # promotions started by prefetch
    corrupt_blocks: int = 0  # blocks that failed their checksum here (served as misses)
    io_errors: int = 0  # device or journal failures
    io_engine: str = ""  # what moves the tier's blocks ("io_uring", "threads", ..; DRAM: "")
    # The io_uring ring pool's (`kvstore.ssd.ringpages`; 0 on every other engine): rings made,
    # those with the slot file and with the DRAM arena registered, registrations the kernel
    # refused, 1 if this kernel cannot share the arena's table between rings (before 6.12),
    # entries sent on the registered file and as fixed buffers, submissions and entries.
    io_rings: int = 0
    io_rings_with_file: int = 0
    io_rings_with_memory: int = 0
    io_files_refused: int = 0
    io_memory_refused: int = 0
    io_clone_unsupported: int = 0
    io_fixed_file_entries: int = 0
    io_fixed_memory_entries: int = 0
    io_submissions: int = 0
    io_entries: int = 0


class Tier(Protocol):
    """One storage tier, as the engine asks it (under the engine's lock)."""

    @property
    def name(self) -> str:
        """The tier's name ("dram", "ssd"), as stats, lookups and tier listeners give it."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds a value of `key` (a read may still find it gone)."""
        ...

    def length_of(self, key: bytes) -> int | None:
        """The length of the tier's value of `key`, or None if it holds none."""
        ...

    def meta_of(self, key: bytes) -> bytes | None:
        """The metadata stored with the tier's value of `key` (None: none, or no value)."""
        ...

    def stats(self, n: Mapping[str, int]) -> TierStats:
        """The tier's counters; `n` holds the engine's (hits, misses, moves between tiers)."""
        ...
