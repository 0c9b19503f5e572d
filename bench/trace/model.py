"""`bench trace`'s model: the workload, the sweep's store configurations, the runs and how
many blocks fit in a store."""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.bench.trace.offline import optimum_hits
from kvoffload.bench.trace.workload import (
    ModelProfile,
    Trace,
    chain_keys,
)
from kvoffload.client_sdk import BlockKey, Client, Namespace, TierRun
from kvoffload.errors import ConfigError
from kvoffload.kvstore import PAGE

# Peer name -> (package, environment variable naming the Python that has it).
PEERS: dict[str, tuple[str, str]] = {
    "vllm_lru": ("vllm", "KVOFFLOAD_VLLM_PYTHON"),
    "vllm_arc": ("vllm", "KVOFFLOAD_VLLM_PYTHON"),
    "lmcache": ("lmcache", "KVOFFLOAD_LMCACHE_PYTHON"),
}
SSD_SHARE = 0.75  # of a DRAM+SSD capacity, the SSD's part
# The deployment an SSD tier is for: a small DRAM tier (10% of the working set) in front of an
# SSD that holds all of it (DRAM 10% + SSD 100%, 110% in all).
REALISTIC = ("dram10+ssd100", 10, 100)
BLOCK_IDS_HASH = "trace:block_ids"  # namespace hash algorithm of keys made from block ids
DEFAULT_PAYLOAD = 3968  # + the 96-byte block header = one 4 KiB slot
CDF_POINTS = 101  # quantiles kept per run for latency CDFs


@dataclass
class Workload:
    """A trace made concrete for one model and block size: chains of block keys."""

    trace: Trace
    profile: ModelProfile
    namespace: Namespace
    chains: list[list[BlockKey]]
    prompt_tokens: npt.NDArray[np.int64]

    @classmethod
    def build(
        cls, trace: Trace, profile: ModelProfile, block_tokens: int, salt: str = ""
    ) -> Workload:
        namespace = profile.namespace(block_tokens, salt)
        if trace.block_tokens:  # the trace names its blocks (Mooncake): its own block size
            if block_tokens != trace.block_tokens:
                raise ConfigError(
                    f"{trace.source} has {trace.block_tokens}-token blocks, not {block_tokens}"
                )
            namespace = dataclasses.replace(namespace, hash_algo=BLOCK_IDS_HASH)
        prompts = np.array([r.prompt_tokens for r in trace.requests], dtype=np.int64)
        return cls(trace, profile, namespace, chain_keys(trace.requests, namespace), prompts)

    @property
    def block_tokens(self) -> int:
        return self.namespace.block_tokens

    @property
    def working_set(self) -> int:
        """Distinct blocks in the trace: what an unbounded store ends up holding."""
        return len({key for chain in self.chains for key in chain})

    def belady_hit_tokens(self, capacity: int) -> int:
        """Hit tokens of the offline Belady rule at `capacity` blocks: evict the block whose
        next use is farthest away (deepest first among equals), under the replay's rules (a
        request stores every block after its hit). A clairvoyant reference for the headroom
        an online policy could reach, not a policy."""
        never = len(self.chains)
        next_use: list[list[int]] = [[] for _ in self.chains]
        last: dict[BlockKey, int] = {}
        for i in range(len(self.chains) - 1, -1, -1):
            next_use[i] = [last.get(k, never) for k in self.chains[i]]
            for k in self.chains[i]:
                last[k] = i
        due: dict[BlockKey, int] = {}  # stored block -> index of its next use
        heap: list[tuple[int, int, BlockKey]] = []  # (-next use, -depth, key), lazily valid
        hits = 0
        for i, chain in enumerate(self.chains):
            hit = 0
            for key in chain:
                if key not in due:
                    break
                hit += 1
            hits += hit
            for j, key in enumerate(chain):
                if key not in due:
                    while len(due) >= capacity:
                        when, _, victim = heapq.heappop(heap)
                        if due.get(victim) == -when:
                            del due[victim]
                due[key] = next_use[i][j]
                heapq.heappush(heap, (-next_use[i][j], -j, key))
        return hits * self.block_tokens

    @property
    def block_accesses(self) -> int:
        """Blocks of every request's chain, summed: what the block-access ratios divide by."""
        return sum(len(chain) for chain in self.chains)

    def optimum_hit_tokens(self, capacity: int) -> int:
        """Hit tokens of Belady with bypass at `capacity` blocks (`offline.optimum_hits`):
        the offline optimum of leading-block hits, which `belady_hit_tokens` (every computed
        block stored) is not."""
        return int(optimum_hits(self.chains, capacity).sum()) * self.block_tokens

    def ideal_hit_tokens(self) -> int:
        """Hit tokens with unbounded capacity: every block seen before is a hit."""
        seen: set[BlockKey] = set()
        hits = 0
        for chain in self.chains:
            for key in chain:
                if key not in seen:
                    break
                hits += 1
            seen.update(chain)
        return hits * self.block_tokens


@dataclass(frozen=True)
class Config:
    """One store configuration of the sweep."""

    system: str  # a kvoffload policy ("lru", "prefix", ...) or a peer ("vllm_arc", ...)
    ssd: bool
    percent: int
    dram_blocks: int
    ssd_blocks: int = 0
    layout: str = ""  # a named split, e.g. "dram10+ssd100"; "" for a same-total split
    admit: int = 0  # the SSD tier's admission_min_uses; 0: the engine's default

    @property
    def tier(self) -> str:
        return self.layout or ("dram+ssd" if self.ssd else "dram")

    @property
    def label(self) -> str:
        if self.layout:
            return f"{self.system}+{self.layout}"
        return f"{self.system}+ssd" if self.ssd else self.system

    @property
    def case(self) -> str:
        return f"hit_tokens/{self.label}/{self.percent}%"


def run_label(run: Mapping[str, Any]) -> str:
    """A run's name in tables, plots and rows, from its details: the system, then "+ssd" for
    a same-total DRAM+SSD split or "+<layout>" for a named one."""
    tier = run["tier"]
    if tier == "dram":
        return str(run["system"])
    return f"{run['system']}+{'ssd' if tier == 'dram+ssd' else tier}"


@dataclass
class Run:
    config: Config
    hit_blocks: npt.NDArray[np.int64] | None = None
    seconds: npt.NDArray[np.float64] | None = None  # per request (load + store)
    load_s: npt.NDArray[np.float64] | None = None
    ssd_hits: npt.NDArray[np.int64] | None = None
    bytes_read: int = 0
    bytes_written: int = 0
    wall_s: float = 0.0
    verified_blocks: int = 0
    error: str = ""
    tier_runs: list[TierRun] | None = None  # per request, its loaded hits by tier

    @property
    def ok(self) -> bool:
        return self.hit_blocks is not None


# ------------------------------------------------------------------------------- planning


@functools.cache
def header_bytes() -> int:
    """What the SDK adds to each stored value (its block header), read from a store's own
    counters so the bench needs no private knowledge of the format."""
    with Client.connect("local://?dram=1MiB&prefault=0") as client:
        client.put(bytes(16), b"x")
        tiers = client.stats().store["tiers"]
        assert isinstance(tiers, (list, tuple))
        return int(tiers[0]["stored_bytes"]) - 1


def block_slot(payload: int) -> int:
    """The DRAM slot of one stored block (payload + SDK header, rounded to pages)."""
    return -(-(payload + header_bytes()) // PAGE) * PAGE


def ssd_bytes(blocks: int, slot: int) -> int:
    """SSD capacity holding `blocks` blocks: the tier adds a header page per slot."""
    return blocks * (slot + PAGE)


def plan(
    working_set: int,
    percents: Sequence[int],
    systems: Sequence[str],
    tiers: Sequence[str],
    ssd_percents: Sequence[int] | None = None,
    realistic: bool = False,
    admissions: Sequence[int] = (0,),
) -> list[Config]:
    """The sweep: each tier x capacity x system (DRAM+SSD runs once per SSD admission setting
    in `admissions`, named +ssd-admit<N> beyond 1); with `realistic` (and the SSD tier asked
    for) also each system in the REALISTIC layout."""
    configs = []
    for tier in tiers:
        for percent in ssd_percents if tier == "ssd" and ssd_percents is not None else percents:
            total = max(2, round(working_set * percent / 100))
            for system in systems:
                if tier == "ssd":
                    dram = max(1, round(total * (1 - SSD_SHARE)))
                    configs += [Config(system, True, percent, dram, total - dram,
                                       f"ssd-admit{a}" if a > 1 else "", a)
                                for a in admissions]  # fmt: skip
                else:
                    configs.append(Config(system, False, percent, total))
    if realistic and "ssd" in tiers:
        layout, dram_pct, ssd_pct = REALISTIC
        dram = max(1, round(working_set * dram_pct / 100))
        ssd = max(1, round(working_set * ssd_pct / 100))
        configs += [Config(s, True, dram_pct + ssd_pct, dram, ssd, layout) for s in systems]
    return configs
