"""Where the blocks of a lookup's leading run live (`Client.lookup(keys, tiers=True)`).

A `TierRun` is the leading run of a chain — the keys before the first one the store lacks —
split into segments of consecutive keys held in the same tier, in key order. Segments, not
bare counts: a caller that loads only part of the run (the vLLM connector's claim rule) needs
to know which tier each part of it is in, and a sharded store's answers can only be merged
key by key. The wire form (`LookupResult.tiers`, protocol 4) is the flat list of
(tier code, length) pairs; daemons report only `DRAM` and `SSD`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.errors import LocalProtocolError

__all__ = ["WIRE_TIERS", "Tier", "TierRun", "check_pairs", "wire_pairs"]


class Tier(enum.IntEnum):
    """Where one block of a leading run is; the codes are the wire's."""

    UNKNOWN = 0  # stored, tier not reported (a protocol 3 daemon, nvme+tcp://)
    DRAM = 1  # in the store's DRAM tier (perhaps also on its SSD)
    SSD = 2  # only on the store's SSD tier: a load reads the SSD
    REMOTE = 3  # on a storage node across the network (every hit of cluster://)


# The codes a daemon may send; the others are the client's own labels.
WIRE_TIERS = frozenset((Tier.DRAM, Tier.SSD))
_BY_NAME = {"dram": Tier.DRAM, "ssd": Tier.SSD}


@dataclass(frozen=True, slots=True)
class TierRun:
    """A lookup's leading run, as (tier, blocks) segments in key order (adjacent segments
    differ in tier, none is empty). `total` is what `lookup(keys)` returns."""

    segments: tuple[tuple[Tier, int], ...] = ()

    @classmethod
    def of(cls, tier: Tier, blocks: int) -> TierRun:
        """A run of `blocks` blocks all in `tier` (empty for 0)."""
        return cls(((tier, blocks),) if blocks > 0 else ())

    @classmethod
    def from_tiers(cls, tiers: Iterable[Tier]) -> TierRun:
        """The run whose i-th block is in `tiers[i]`."""
        segments: list[tuple[Tier, int]] = []
        for tier in tiers:
            if segments and segments[-1][0] == tier:
                segments[-1] = (tier, segments[-1][1] + 1)
            else:
                segments.append((tier, 1))
        return cls(tuple(segments))

    @classmethod
    def from_names(cls, names: Iterable[str]) -> TierRun:
        """From the engine's tier names ("dram", "ssd"; `Engine.lookup`'s `tiers` list)."""
        return cls.from_tiers(_BY_NAME[name] for name in names)

    @classmethod
    def from_wire(cls, pairs: Sequence[int]) -> TierRun:
        """From `LookupResult.tiers` (already checked by its validator)."""
        return cls(tuple((Tier(pairs[i]), pairs[i + 1]) for i in range(0, len(pairs), 2)))

    @property
    def total(self) -> int:
        return sum(n for _, n in self.segments)

    def count(self, tier: Tier) -> int:
        """Blocks of the run in `tier`."""
        return sum(n for t, n in self.segments if t == tier)

    @property
    def dram(self) -> int:
        return self.count(Tier.DRAM)

    @property
    def ssd(self) -> int:
        return self.count(Tier.SSD)

    @property
    def remote(self) -> int:
        return self.count(Tier.REMOTE)

    @property
    def unknown(self) -> int:
        return self.count(Tier.UNKNOWN)

    def tiers(self) -> list[Tier]:
        """The tier of each block, in key order."""
        return [tier for tier, n in self.segments for _ in range(n)]

    def slice(self, start: int, stop: int | None = None) -> TierRun:
        """Blocks `start:stop` of the run (positions as in the keys looked up)."""
        stop = self.total if stop is None else stop
        out: list[tuple[Tier, int]] = []
        at = 0
        for tier, n in self.segments:
            lo, hi = max(at, start), min(at + n, stop)
            if lo < hi:
                out.append((tier, hi - lo))
            at += n
        return TierRun(tuple(out))

    def then(self, other: TierRun) -> TierRun:
        """This run followed by `other` (one lookup answered in several frames)."""
        if not self.segments:
            return other
        if not other.segments:
            return self
        if self.segments[-1][0] == other.segments[0][0]:
            tier, n = self.segments[-1]
            joined = (tier, n + other.segments[0][1])
            return TierRun((*self.segments[:-1], joined, *other.segments[1:]))
        return TierRun(self.segments + other.segments)

    def to_wire(self) -> tuple[int, ...]:
        return tuple(v for tier, n in self.segments for v in (int(tier), n))


def wire_pairs(names: Sequence[str]) -> tuple[int, ...]:
    """The engine's tier names of a run as `LookupResult.tiers` (the daemon's side)."""
    return TierRun.from_names(names).to_wire()


def check_pairs(value: object) -> tuple[int, ...] | None:
    """`LookupResult.tiers`: None, or (tier code, length) pairs with daemon tier codes and
    lengths of at least 1."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) % 2:
        raise LocalProtocolError(f"bad tier runs: {repr(value)[:80]}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise LocalProtocolError(f"bad tier runs: {repr(value)[:80]}")
        if (i % 2 == 0 and v not in WIRE_TIERS) or (i % 2 == 1 and not 0 < v < 1 << 63):
            raise LocalProtocolError(f"bad tier runs: {repr(value)[:80]}")
    return tuple(value)
