"""`reuse`: evict the block least likely to be read again soon, judged by how often its key was
used (a TinyLFU-style sketch that remembers keys after they leave) and how long ago, with a
weight learned online against LRU.

Each access gives a block a deadline: the policy's clock (one tick per access) plus a grace of
`weight × GRACE[uses]` times the number of resident blocks, where `uses` counts the key's puts
and reads so far (evicted keys included, the counts halved as the sketch ages). The block with
the earliest deadline goes first; orphans (parent gone: no prefix lookup can reach them) before
any other. With a weight of 0 this is LRU.

The weight is learned from two miniature caches (SHARDS-style spatial sampling): the keys
whose first byte is divisible by `SAMPLE` are replayed through a miniature LRU and a miniature
`reuse` at full weight, each holding that share of the resident count, and each counts its
hits, decayed over `HORIZON` sampled accesses. The weight is 1 while the miniature `reuse` is
ahead, `LOW` (0: LRU) otherwise, and starts at `LOW`. A learner that compares itself with LRU
instead (a shadow LRU: raise the weight on a hit LRU would have missed, lower it on a miss LRU
would have hit) falls into a trap: the graces cost hits at once and pay back thousands of
accesses later, so the weight sinks to LRU, where nothing can raise it again; the miniature
caches judge both policies as they would run, whatever the weight. Deadlines are computed at
eviction time from each block's last tick and grace class, so a new weight applies to every
resident block at once. Blocks of one grace class are kept in recency order, so the victim is
the earliest of the classes' oldest blocks: O(classes) per eviction.

Why (docs/design/workload-benchmark.md, the Mooncake trace): a block stored once is read again
24% of the time, one used twice 42%, three times 50%, four or more 78%; a grace that grows with
the uses keeps the blocks that prefixes keep coming back to through the flood of one-off
tails, and a block seen before, evicted and stored again gets its grace back at once.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection

from kvoffload.kvstore.eviction import EvictionPolicy, Rank
from kvoffload.kvstore.ssd.admission import FrequencySketch

__all__ = ["ReusePolicy"]


class ReusePolicy(EvictionPolicy):
    """Earliest deadline first, graces scaled by a weight learned against LRU (module doc);
    orphans first of all."""

    name = "reuse"
    # Grace per past use count (index: uses - 1, the last for every count beyond), in resident
    # blocks: tuned on the first half hour of the Mooncake conversation trace.
    GRACE: tuple[float, ...] = (-0.25, 0.5, 1.5, 3.0)
    SAMPLE = 4  # one key in SAMPLE is replayed in the miniature caches
    HORIZON = 20_000  # sampled accesses: the scores' decay time
    LOW = 0.0

    def __init__(self, *, learn: bool = True, counts: bool = True) -> None:
        # key -> (grace class, last tick); each class's keys oldest first.
        self._where: dict[bytes, tuple[int, int]] = {}
        self._classes: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in self.GRACE]
        # Insertion-ordered (oldest orphan first): a set's order would vary with the hash seed.
        self._orphans: dict[bytes, None] = {}
        # A learner's miniature cache is handed the learner's counts (`counts=False`).
        self._uses = FrequencySketch(width_bits=20 if counts else 1)
        self._clock = itertools.count()
        # A learner starts as LRU until its miniature reuse cache has done better.
        self.weight = self.LOW if learn else 1.0
        # Miniature caches of a sample of the keys, one per policy (module doc); the score of
        # each: its sampled hits, decayed so that the recent past counts most.
        self._mini_lru: OrderedDict[bytes, None] = OrderedDict()
        self._mini = type(self)(learn=False, counts=False) if learn else None
        self._score_lru = self._score_mine = 0.0
        self._decay = 1.0 - 1.0 / self.HORIZON

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def _sample(self, key: bytes, uses: int) -> None:
        # Spatial sampling (SHARDS-style): a key's first byte is uniform for hashed keys, and
        # both miniature caches hold that share of the resident count.
        if key[0] % self.SAMPLE:
            return
        room = max(1, len(self._where) // self.SAMPLE)
        self._score_lru *= self._decay
        self._score_mine *= self._decay
        lru = self._mini_lru
        if key in lru:
            self._score_lru += 1.0
            lru.move_to_end(key)
        else:
            lru[key] = None
            while len(lru) > room:
                lru.popitem(last=False)
        mine = self._mini
        assert mine is not None
        if key in mine:
            self._score_mine += 1.0
        else:
            while len(mine) >= room:
                mine.remove(mine._earliest(()))
        mine._place(key, uses)  # the sampled key's uses are the same count: share the sketch
        self.weight = 1.0 if self._score_mine > self._score_lru else self.LOW

    def _place(self, key: bytes, uses: int) -> None:
        grace_class = min(uses, len(self.GRACE)) - 1
        tick = next(self._clock)
        old = self._where.get(key)
        if old is not None:
            del self._classes[old[0]][key]
        self._where[key] = (grace_class, tick)
        self._classes[grace_class][key] = tick

    def _access(self, key: bytes) -> None:
        uses = self._uses
        uses.add(key)
        count = uses.estimate(key)
        if self._mini is not None:
            self._sample(key, count)
        self._place(key, count)

    def insert(self, key: bytes, rank: Rank) -> None:
        self._access(key)
        self.set_rank(key, rank)

    def touch(self, key: bytes) -> None:
        self._access(key)

    def set_rank(self, key: bytes, rank: Rank) -> None:
        if key not in self._where:
            return  # not ours (e.g. taken out while a demotion writes it)
        if rank == Rank.ORPHAN:
            self._orphans.setdefault(key)
        else:
            self._orphans.pop(key, None)

    def remove(self, key: bytes) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            del self._classes[where[0]][key]
            self._orphans.pop(key, None)

    def _earliest(self, protected: Collection[bytes]) -> bytes:
        scale = self.weight * len(self._where)
        best: tuple[float, int, bytes] | None = None
        for grace, keys in zip(self.GRACE, self._classes, strict=True):
            for key, tick in keys.items():  # oldest first; skip the few protected keys
                if key not in protected:
                    candidate = (tick + grace * scale, tick, key)
                    if best is None or candidate < best:
                        best = candidate
                    break
        assert best is not None  # the caller counted evictable keys
        return best[2]

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if self._evictable(protected) < n:
            return None
        victims = list(itertools.islice((k for k in self._orphans if k not in protected), n))
        for key in victims:
            self.remove(key)
        while len(victims) < n:
            key = self._earliest(protected)
            self.remove(key)
            victims.append(key)
        return victims
