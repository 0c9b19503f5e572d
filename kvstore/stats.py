"""Snapshots of the engine's and its tiers' counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload.kvstore.manager import Manager

__all__ = ["EngineStats", "TierStats", "snapshot"]


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
    recovery: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def snapshot(m: Manager, policy: str) -> EngineStats:
    """The engine's counters and both tiers' (the engine's lock held)."""
    n = m.n
    tiers = [m.dram.stats(n, len(m.index))]
    ssd = m.ssd
    if ssd is not None:
        tiers.append(ssd.stats(n))
    used = m.dram.tenant_used
    return EngineStats(
        policy=policy,
        puts=n["puts"],
        gets=n["gets"],
        hits=n["hits"] + n["ssd_hits"],
        misses=n["misses"],
        deletes=n["deletes"],
        evictions=n["evictions"],
        neighbour_evictions=n["neighbours"],
        tiers=tuple(tiers),
        tenant_bytes={t: used.get(t, 0) for t in used.keys() | m.quotas.keys()},
        ssd_tenant_bytes=ssd.tenant_usage() if ssd is not None else {},
        durable_puts=n["durable"],
        admission_rejected=n["admission_rejected"],
        checkpoints=ssd.counters.checkpoints if ssd is not None else 0,
        staged_gets=m.dram.staged_gets,
        staged_peak=m.dram.staged_peak,
        recovery=asdict(ssd.recovery) if ssd is not None else {},
    )
