"""`reuse`: evict the block least likely to be read again soon, judged by how often its key was
used (a TinyLFU-style sketch that remembers keys after they leave) and how long ago.

Each access gives a block a deadline: the policy's clock (one tick per access) plus a grace of
`GRACE[uses]` times the number of resident blocks, where `uses` counts the key's puts and reads
so far (evicted keys included, the counts halved as the sketch ages). The block with the
earliest deadline goes first; orphans (parent gone: no prefix lookup can reach them) before
any other. With no grace at all this is LRU.

Why (docs/design/workload-benchmark.md, the Mooncake trace): a block stored once is read again
24% of the time, one used twice 42%, three times 50%, four or more 78%; a grace that grows with
the uses keeps the blocks that prefixes keep coming back to through the flood of one-off
tails, and a block seen before, evicted and stored again gets its grace back at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection

from kvoffload.kvstore.eviction import EvictionPolicy, Rank
from kvoffload.kvstore.ssd.admission import FrequencySketch

__all__ = ["ReusePolicy"]


class ReusePolicy(EvictionPolicy):
    """Earliest deadline first (module doc); orphans first of all."""

    name = "reuse"
    # Grace per past use count (index: uses - 1, the last for every count beyond), in resident
    # blocks: tuned on the first half hour of the Mooncake conversation trace.
    GRACE: tuple[float, ...] = (0.0, 0.5, 1.5, 3.0)

    def __init__(self) -> None:
        self._deadline: dict[bytes, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        # Insertion-ordered (oldest orphan first): a set's order would vary with the hash seed.
        self._orphans: dict[bytes, None] = {}
        self._uses = FrequencySketch()
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline

    def _access(self, key: bytes) -> None:
        self._uses.add(key)
        grace = self.GRACE[min(self._uses.estimate(key), len(self.GRACE)) - 1]
        tick = next(self._clock)
        deadline = tick + grace * len(self._deadline)
        self._deadline[key] = (deadline, tick)
        heapq.heappush(self._heap, (deadline, tick, key))
        if len(self._heap) > 2 * len(self._deadline) + 64:  # drop stale entries
            self._heap = [(d, t, k) for k, (d, t) in self._deadline.items()]
            heapq.heapify(self._heap)

    def insert(self, key: bytes, rank: Rank) -> None:
        self._access(key)
        self.set_rank(key, rank)

    def touch(self, key: bytes) -> None:
        self._access(key)

    def set_rank(self, key: bytes, rank: Rank) -> None:
        if key not in self._deadline:
            return  # not ours (e.g. taken out while a demotion writes it)
        if rank == Rank.ORPHAN:
            self._orphans.setdefault(key)
        else:
            self._orphans.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self._deadline.pop(key, None) is not None:
            self._orphans.pop(key, None)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if self._evictable(protected) < n:
            return None
        victims = list(itertools.islice((k for k in self._orphans if k not in protected), n))
        for key in victims:
            self.remove(key)
        skipped: list[tuple[float, int, bytes]] = []
        while len(victims) < n:
            item = heapq.heappop(self._heap)
            deadline, tick, key = item
            if self._deadline.get(key) != (deadline, tick):
                continue  # stale entry
            if key in protected:
                skipped.append(item)
                continue
            self.remove(key)
            victims.append(key)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victims
