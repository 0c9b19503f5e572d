"""Eviction policies behind one small interface, and their registry.

A policy only orders keys; it never frees memory. The engine owns the lock and calls these methods
while holding it, so policies are not thread-safe on their own (vLLM's `kv_offload` rule).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection
from typing import ClassVar

from kvoffload.errors import ConfigError, KVOffloadError

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "Rank",
    "S3FIFOPolicy",
    "make_policy",
    "register_policy",
]


class Rank(enum.IntEnum):
    """Where a block stands in its prefix chain, as the engine sees it across all size classes."""

    ORPHAN = 0  # its parent is not stored: no lookup can ever reach it
    LEAF = 1  # no stored successor: the tail of a chain
    INTERIOR = 2  # a stored successor depends on it


class EvictionPolicy(ABC):
    """Orders the keys of one size class for eviction."""

    name: ClassVar[str]

    @abstractmethod
    def insert(self, key: bytes, rank: Rank) -> None:
        """A new key became resident."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A resident key was read."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """A resident key left for another reason (delete, overwrite, slab reclaim)."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        """Choose and forget `n` keys, none of them in `protected`.

        Returns None, with no state changed, when fewer than `n` keys are evictable.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    def set_rank(self, key: bytes, rank: Rank) -> None:  # noqa: B027 - optional hook
        """The key's place in its chain changed; order-only policies ignore this."""

    def _evictable(self, protected: Collection[bytes]) -> int:
        # `protected` spans the whole engine; count only the members that are ours.
        return len(self) - sum(1 for key in protected if key in self)

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: bytes, rank: Rank) -> None:
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        victims: list[bytes] = []
        for key in self._order:
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO with lazy
    promotion and a ghost FIFO of recently evicted keys.

    One-hit wonders leave from the small queue without disturbing the main one; keys read again
    while probationary, or re-inserted soon after eviction (ghost hit), go to the main queue.
    """

    name = "s3fifo"
    SMALL_RATIO = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def insert(self, key: bytes, rank: Rank) -> None:
        if key in self._ghost:
            # Evicted recently and wanted again: it deserves the main queue.
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def touch(self, key: bytes) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if self._evictable(protected) < n:
            return None
        return [self._evict_one(protected) for _ in range(n)]

    def _evict_one(self, protected: Collection[bytes]) -> bytes:
        # Every pass evicts, demotes a frequency, promotes small->main or rotates a pinned key.
        # Each queue has a budget of pinned rotations (its length): a queue that is all pinned
        # hands over to the other one whatever the size ratio says, so the loop ends. Once both
        # budgets are spent the small queue is all pinned and main holds an evictable key, whose
        # frequency falls at each pass: at most (MAX_FREQ + 2) passes a key.
        small_budget, main_budget = len(self._small), len(self._main)
        for _ in range((self.MAX_FREQ + 2) * (len(self._small) + len(self._main)) + 1):
            small, main = self._small, self._main
            use_small = (
                small
                and small_budget > 0
                and (
                    not main
                    or main_budget <= 0
                    or len(small) >= self.SMALL_RATIO * (len(small) + len(main))
                )
            )
            queue = small if use_small else main
            if not queue:
                queue = small
                small_budget = len(small)
            key = next(iter(queue))
            del queue[key]
            if key in protected:
                queue[key] = None
                if queue is small:
                    small_budget -= 1
                else:
                    main_budget -= 1
                continue
            freq = self._freq[key]
            if queue is small:
                if freq > 0:
                    self._freq[key] = 0
                    main[key] = None
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(len(main), 64):
                    self._ghost.popitem(last=False)
            elif freq > 0:
                self._freq[key] = freq - 1
                main[key] = None
                continue
            del self._freq[key]
            return key
        # `evict` counted an evictable key first: reaching this is a bug, not a full cache.
        raise KVOffloadError("s3fifo: no victim within its bound although one was evictable")


class PrefixAwarePolicy(EvictionPolicy):
    """Chain tails before their parents: orphans first, then leaves, then interior blocks, each
    group least recently used first.

    A block whose parent is gone can never be hit by a prefix lookup, and a parent is worth at
    least as much as any of its successors (every hit on a successor is also a hit on it). The
    engine supplies each block's `Rank`; a lazily invalidated heap keeps (rank, last use) order.
    """

    name = "prefix"

    def __init__(self) -> None:
        self._state: dict[bytes, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def _push(self, key: bytes, rank: int, tick: int) -> None:
        self._state[key] = (rank, tick)
        heapq.heappush(self._heap, (rank, tick, key))
        if len(self._heap) > 2 * len(self._state) + 64:
            self._heap = [(r, t, k) for k, (r, t) in self._state.items()]
            heapq.heapify(self._heap)

    def insert(self, key: bytes, rank: Rank) -> None:
        self._push(key, int(rank), next(self._clock))

    def touch(self, key: bytes) -> None:
        self._push(key, self._state[key][0], next(self._clock))

    def set_rank(self, key: bytes, rank: Rank) -> None:
        state = self._state.get(key)
        if state is not None and state[0] != rank:
            self._push(key, int(rank), state[1])

    def remove(self, key: bytes) -> None:
        self._state.pop(key, None)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if self._evictable(protected) < n:
            return None
        victims: list[bytes] = []
        skipped: list[tuple[int, int, bytes]] = []
        while len(victims) < n:
            item = heapq.heappop(self._heap)
            rank, tick, key = item
            if self._state.get(key) != (rank, tick):
                continue  # stale heap entry
            if key in protected:
                skipped.append(item)
                continue
            del self._state[key]
            victims.append(key)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victims


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Add a policy class under its `name`; a second class with the same name is refused."""
    if cls.name in POLICIES:
        raise ConfigError(f"eviction policy {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


for _policy in (LRUPolicy, S3FIFOPolicy, PrefixAwarePolicy):
    register_policy(_policy)


def make_policy(name: str) -> EvictionPolicy:
    """Instantiate a registered policy by name.

    Raises:
        ConfigError: no policy has that name (the message lists the valid ones).
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
