"""Claim a hit only where loading it beats recomputing it (issue: loads that never lose).

A hit the scheduler claims is loaded before its request runs, so it pays off only when the store
delivers those tokens faster than the model would compute them. The workers measure both rates
as they run — blocks per second of their batched, verified loads, and tokens per second of the
steps' forward passes — and send them to the scheduler in vLLM's connector stats; either rate
can instead be told in the connector's config (on a GPU the forward pass returns before its
kernels finish, so there the prefill rate must be told to take part).

The rule is per token: claim when `block_tokens x load_blocks_per_s > prefill_tokens_per_s`.
Recomputing a token costs more the deeper it sits in the prompt (attention over its
predecessors), so a rate averaged over steps makes the rule err toward recomputing — the side
on which a store never makes a request slower than no store. Until both rates are known every
hit is claimed (what the connector did before).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.connectors.vllm import _compat

__all__ = ["MIN_PREFILL_TOKENS", "ClaimRule", "KVOffloadStats", "StepRates"]

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

_FIELDS = ("load_blocks", "load_s", "prefill_tokens", "prefill_s")


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

    def take(self) -> KVOffloadStats | None:
        if not (self.load_blocks or self.prefill_tokens):
            return None
        stats = KVOffloadStats(data={name: float(getattr(self, name)) for name in _FIELDS})
        self.load_blocks = self.prefill_tokens = 0
        self.load_s = self.prefill_s = 0.0
        return stats


class ClaimRule:
    """The scheduler's view of both rates and the decision made from them.

    Args:
        block_tokens: tokens per vLLM block.
        claim: "cost" (the rule) or "all" (claim every hit).
        load_blocks_per_s, prefill_tokens_per_s: told rates; 0 means measured.
    """

    def __init__(
        self,
        block_tokens: int,
        claim: str = "cost",
        load_blocks_per_s: float = 0.0,
        prefill_tokens_per_s: float = 0.0,
    ) -> None:
        self._block_tokens = block_tokens
        self._claim = claim
        self._told_load = load_blocks_per_s
        self._told_prefill = prefill_tokens_per_s
        self._load: float | None = None  # measured blocks/s
        self._prefill: float | None = None  # measured tokens/s
        self.skipped_tokens = 0  # hit tokens recomputed because loading them would be slower
        self._refused = 0

    @property
    def load_blocks_per_s(self) -> float | None:
        return self._told_load or self._load

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

    def worth_loading(self, blocks: int) -> bool:
        """Whether loading `blocks` hit blocks beats recomputing them."""
        load, prefill = self.load_blocks_per_s, self.prefill_tokens_per_s
        if self._claim == "all" or blocks <= 0 or not load or not prefill:
            return True
        if load * self._block_tokens > prefill:
            return True
        self._refused += 1
        if not self._told_load and self._refused % PROBE_EVERY == 0:
            return True  # a probe that keeps the measured load rate current
        self.skipped_tokens += blocks * self._block_tokens
        log.debug("kvoffload: recomputing %d hit blocks: loading %.0f tokens/s < computing "
                  "%.0f tokens/s", blocks, load * self._block_tokens, prefill)  # fmt: skip
        return False
