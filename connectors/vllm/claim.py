"""Claim a hit only where loading it beats recomputing it (issue: loads that never lose).

A hit the scheduler claims is loaded before its request runs, so it pays off only when the store
delivers those tokens faster than the model would compute them. The workers measure both rates
as they run — blocks per second of their batched, verified loads, per tier the blocks came from
(each staging batch holds blocks of one tier: the scheduler hands the workers the tiers its
`lookup(keys, tiers=True)` reported), and tokens per second of the steps' forward passes — and
send them to the scheduler in vLLM's connector stats; either rate can instead be told in the
connector's config (on a GPU the forward pass returns before its kernels finish, so there the
prefill rate must be told to take part; a told load rate stands for every tier).

The rule: the hit is the lookup's run in key order, tier segment by tier segment (the DRAM
lead, then an SSD part, ...). Each block saves `block_tokens / prefill_tokens_per_s` of compute
and costs `1 / load_blocks_per_s` of its tier; the scheduler claims the leading blocks up to the
segment end where the saving summed so far is largest (none when no prefix saves anything).
Recomputing a token costs more the deeper it sits in the prompt (attention over its
predecessors), so a rate averaged over steps makes the rule err toward recomputing — the side
on which a store never makes a request slower than no store. Until the prefill rate is known
every hit is claimed (what the connector did before), and a tier whose load rate is not known
yet counts as free, so that its first loads measure it.

With the KV stored in P layer parts (`Settings.layer_parts`), attention layer l waits only for
part l's load, so loading overlaps the compute of the request's other tokens. Then claiming k
blocks costs `max(load + compute / P, load / P + compute)` (the first part's load cannot
overlap anything, nor the last part's compute), where `compute` covers the unclaimed hit
blocks and the tokens after the hit; the rule claims the k with the least cost, at any block,
since the best split is where loading and computing take about as long.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.client_sdk import Tier, TierRun
from kvoffload.connectors.vllm import _compat

__all__ = ["MIN_PREFILL_TOKENS", "ClaimRule", "KVOffloadStats", "StepRates", "load_batches"]

log = logging.getLogger(__name__)

# Forward passes with fewer tokens than this are decode-bound: their tokens/s says nothing
# about prefill, so they are not counted.
MIN_PREFILL_TOKENS = 64
# While loading measures slower than computing, every this many refused hits one is loaded
# anyway: without loads the measured load rate would never change, and a store that became
# faster (a cold SSD warmed up, a busy network calmed) would never be claimed again.
PROBE_EVERY = 32
# Weight of the history when a new measurement arrives (an exponential moving average over
# stats messages, so the rule follows a store that gets slower or faster).
DECAY = 0.8

# Per tier: load_blocks_<tier>, load_s_<tier> (the totals above count every tier).
_TIER_FIELDS = tuple(f"load_{what}_{t.name.lower()}" for t in Tier for what in ("blocks", "s"))
_FIELDS = ("load_blocks", "load_s", "prefill_tokens", "prefill_s", *_TIER_FIELDS)


class KVOffloadStats(_compat.KVConnectorStats):
    """What the workers measured since their last report: sums of `_FIELDS`."""

    def reset(self) -> None:
        self.data = dict.fromkeys(_FIELDS, 0.0)

    def aggregate(self, other: Any) -> KVOffloadStats:
        for name in _FIELDS:
            self.data[name] = float(self.data.get(name, 0.0)) + float(other.data.get(name, 0.0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {"loaded_blocks": int(d.get("load_blocks", 0))}
        if d.get("load_s"):
            out["load_blocks_per_s"] = round(d["load_blocks"] / d["load_s"], 1)
        if d.get("prefill_s"):
            out["prefill_tokens_per_s"] = round(d["prefill_tokens"] / d["prefill_s"], 1)
        for tier in Tier:
            name = tier.name.lower()
            if d.get(f"load_s_{name}"):
                rate = d[f"load_blocks_{name}"] / d[f"load_s_{name}"]
                out[f"load_blocks_per_s_{name}"] = round(rate, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in _FIELDS)


@dataclass
class StepRates:
    """A worker's running sums, taken (and cleared) with every step's connector stats."""

    load_blocks: int = 0
    load_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    tiers: dict[str, float] = field(default_factory=dict)  # load_blocks_<tier>, load_s_<tier>

    def loaded(self, tier: Tier, blocks: int, seconds: float) -> None:
        """A staging batch of `blocks` blocks of `tier` loaded in `seconds`."""
        name = tier.name.lower()
        self.load_blocks += blocks
        self.load_s += seconds
        self.tiers[f"load_blocks_{name}"] = self.tiers.get(f"load_blocks_{name}", 0.0) + blocks
        self.tiers[f"load_s_{name}"] = self.tiers.get(f"load_s_{name}", 0.0) + seconds

    def take(self) -> KVOffloadStats | None:
        if not (self.load_blocks or self.prefill_tokens):
            return None
        data = {name: float(getattr(self, name)) for name in _FIELDS[:4]}
        stats = KVOffloadStats(data={**data, **self.tiers})
        self.load_blocks = self.prefill_tokens = 0
        self.load_s = self.prefill_s = 0.0
        self.tiers = {}
        return stats


def load_batches(blocks: int, batch: int, run: TierRun) -> list[tuple[int, int, Tier]]:
    """(start, stop, tier) of each staging batch of a load of `blocks` blocks whose tiers are
    `run`: at most `batch` blocks, never two tiers in one (so each batch's time measures its
    tier). Blocks `run` does not cover are `Tier.UNKNOWN`."""
    segments = list(run.slice(0, blocks).segments)
    if run.total < blocks:
        segments.append((Tier.UNKNOWN, blocks - run.total))
    out: list[tuple[int, int, Tier]] = []
    at = 0
    for tier, count in segments:
        out += [(s, min(s + batch, at + count), tier) for s in range(at, at + count, batch)]
        at += count
    return out


class ClaimRule:
    """The scheduler's view of the rates and the decision made from them.

    Args:
        block_tokens: tokens per vLLM block.
        claim: "cost" (the rule) or "all" (claim every hit).
        load_blocks_per_s, prefill_tokens_per_s: told rates (the load rate for every tier);
            0 means measured.
        parts: layer parts a block is stored in (1: a load precedes the forward).
    """

    def __init__(
        self,
        block_tokens: int,
        claim: str = "cost",
        load_blocks_per_s: float = 0.0,
        prefill_tokens_per_s: float = 0.0,
        parts: int = 1,
    ) -> None:
        if parts < 1:
            raise ValueError(f"parts must be at least 1, got {parts}")
        self._parts = parts
        self._block_tokens = block_tokens
        self._claim = claim
        self._told_load = load_blocks_per_s
        self._told_prefill = prefill_tokens_per_s
        self._load: float | None = None  # measured blocks/s, every tier together
        self._tiers: dict[Tier, float] = {}  # measured blocks/s per tier
        self._prefill: float | None = None  # measured tokens/s
        self.skipped_tokens = 0  # hit tokens recomputed because loading them would be slower
        self._refused = 0

    @property
    def load_blocks_per_s(self) -> float | None:
        """The told load rate, or the one measured over every tier."""
        return self._told_load or self._load

    def tier_blocks_per_s(self, tier: Tier) -> float | None:
        """The told load rate, or the one measured for `tier` (None: not known yet)."""
        return self._told_load or self._tiers.get(tier)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._told_prefill or self._prefill

    def observe(self, data: Mapping[str, Any]) -> None:
        """Fold one stats message from the workers into the measured rates."""

        def rate(count: str, seconds: str, old: float | None) -> float | None:
            n, s = float(data.get(count, 0.0)), float(data.get(seconds, 0.0))
            if n <= 0 or s <= 0:
                return old
            new = n / s
            return new if old is None else DECAY * old + (1 - DECAY) * new

        self._load = rate("load_blocks", "load_s", self._load)
        self._prefill = rate("prefill_tokens", "prefill_s", self._prefill)
        for tier in Tier:
            name = tier.name.lower()
            measured = rate(f"load_blocks_{name}", f"load_s_{name}", self._tiers.get(tier))
            if measured is not None:
                self._tiers[tier] = measured

    def claim_blocks(self, run: TierRun, after_tokens: int = 0) -> int:
        """How many leading blocks of `run` (the hit past what vLLM already has, by tier in
        key order) to load: the segment end where loading saves the most time, or 0. With
        layer parts, the block count with the least overlapped cost; `after_tokens` are the
        tokens the step computes after the hit, under which loads can hide."""
        total = run.total
        prefill = self.prefill_tokens_per_s
        if self._claim == "all" or total <= 0 or not prefill:
            return total
        recompute_s = self._block_tokens / prefill  # per block
        if self._parts > 1:
            costs = [self._load_s(tier) for tier, count in run.segments for _ in range(count)]
            best = _overlapped_best(costs, recompute_s, after_tokens / prefill, self._parts)
        else:
            best, best_saved, at, saved = 0, 0.0, 0, 0.0
            for tier, count in run.segments:
                saved += count * (recompute_s - self._load_s(tier))
                at += count
                if saved > best_saved:
                    best, best_saved = at, saved
        if best == total:
            return total
        self._refused += 1
        if not self._told_load and self._refused % PROBE_EVERY == 0:
            return total  # a probe that keeps the measured load rates current
        self.skipped_tokens += (total - best) * self._block_tokens
        log.debug("kvoffload: loading %d of %d hit blocks (%s); the rest is cheaper to "
                  "recompute at %.0f tokens/s", best, total, run.segments, prefill)  # fmt: skip
        return best

    def _load_s(self, tier: Tier) -> float:
        rate = self.tier_blocks_per_s(tier)
        return 1.0 / rate if rate else 0.0  # not measured yet: load it to measure it


def _overlapped_best(costs: list[float], recompute_s: float, after_s: float, parts: int) -> int:
    """The block count k whose overlapped cost is least (ties: fewer blocks), where loading
    the first k blocks costs sum(costs[:k]) and the rest of the step computes
    (len(costs) - k) x recompute_s + after_s."""
    best, best_s, load = 0, float("inf"), 0.0
    for k in range(len(costs) + 1):
        if k:
            load += costs[k - 1]
        compute = (len(costs) - k) * recompute_s + after_s
        spent = max(load + compute / parts, load / parts + compute)
        if spent < best_s:
            best, best_s = k, spent
    return best
