"""The SSD index's eviction order: per row its queue, doubly linked lists (one per queue),
an S3-FIFO frequency, and a ghost filter of keys evicted recently.

LRU and prefix keep one list, coldest first; S3-FIFO a small and a main queue. Numpy columns
indexed by row, like the index's own; every call runs under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload.kvstore.ssd.keyhash import hash_key


class Rows(Protocol):
    """What the queues read of the index they order (`kvstore.ssd.index.SsdIndex`)."""

    def key_of(self, row: int) -> bytes: ...

    def __len__(self) -> int: ...


_R = TypeVar("_R", bound=Rows)

EMPTY = -1
# Eviction queues: LRU and prefix use queue 0; S3-FIFO uses 0 (small) and 1 (main).
_SMALL, _MAIN = 0, 1
_LOOKAHEAD = 32  # prefix policy: candidates examined from the cold end


class EvictionQueues:
    """Which SSD row to evict next, under one of the policies "lru", "s3fifo", "prefix"."""

    freq: npt.NDArray[np.uint8]  # S3-FIFO: reads since listed, capped at 3
    queue: npt.NDArray[np.uint8]
    prev: npt.NDArray[np.int32]
    next: npt.NDArray[np.int32]

    def __init__(self, policy: str, capacity: int) -> None:
        self.policy = policy
        self.resize(capacity, 0)
        self._heads = [EMPTY, EMPTY]
        self._tails = [EMPTY, EMPTY]
        self._sizes = [0, 0]
        self._ghost_bits = 1 << 16
        self._ghosts = [np.zeros(self._ghost_bits // 8, np.uint8) for _ in range(2)]
        self._ghost_count = 0

    def resize(self, capacity: int, keep: int) -> None:
        """New columns for `capacity` rows, keeping the first `keep` rows' state."""
        freq = np.zeros(capacity, dtype=np.uint8)
        queue = np.zeros(capacity, dtype=np.uint8)
        prev = np.full(capacity, EMPTY, dtype=np.int32)
        nxt = np.full(capacity, EMPTY, dtype=np.int32)
        if keep:
            freq[:keep], queue[:keep] = self.freq[:keep], self.queue[:keep]
            prev[:keep], nxt[:keep] = self.prev[:keep], self.next[:keep]
        self.freq, self.queue, self.prev, self.next = freq, queue, prev, nxt

    def add(self, row: int, key: bytes) -> None:
        """List a new row (S3-FIFO: in the main queue if its key was evicted recently)."""
        self.freq[row] = 0
        queue = _SMALL
        if self.policy == "s3fifo" and self._ghost_take(key):
            queue = _MAIN  # evicted recently and wanted again
        self._link(row, queue)

    def remove(self, row: int) -> None:
        self._unlink(row)

    def touch(self, row: int) -> None:
        """The row was read: refresh its recency (LRU/prefix) or frequency (S3-FIFO)."""
        if self.policy == "s3fifo":
            self.freq[row] = min(int(self.freq[row]) + 1, 3)
        else:
            self._unlink(row)
            self._link(row, _SMALL)

    def load(self, n: int) -> None:
        """Rows 0..n-1 just loaded (fresh columns): list them in that order, coldest first."""
        self._heads, self._tails, self._sizes = [EMPTY, EMPTY], [EMPTY, EMPTY], [0, 0]
        if n:
            rows = np.arange(n, dtype=np.int32)
            self.prev[1:n] = rows[:-1]
            self.next[: n - 1] = rows[1:]
            self.prev[0] = self.next[n - 1] = EMPTY
            self._heads[_SMALL], self._tails[_SMALL], self._sizes[_SMALL] = 0, n - 1, n
        self.queue[:n] = _SMALL

    def memory_bytes(self) -> int:
        columns = self.freq.nbytes + self.queue.nbytes + self.prev.nbytes + self.next.nbytes
        return columns + sum(g.nbytes for g in self._ghosts)

    def _link(self, row: int, queue: int) -> None:
        tail = self._tails[queue]
        self.prev[row] = tail
        self.next[row] = EMPTY
        self.queue[row] = queue
        if tail == EMPTY:
            self._heads[queue] = row
        else:
            self.next[tail] = row
        self._tails[queue] = row
        self._sizes[queue] += 1

    def _unlink(self, row: int) -> None:
        queue = int(self.queue[row])
        prev, nxt = int(self.prev[row]), int(self.next[row])
        if prev == EMPTY:
            self._heads[queue] = nxt
        else:
            self.next[prev] = nxt
        if nxt == EMPTY:
            self._tails[queue] = prev
        else:
            self.prev[nxt] = prev
        self._sizes[queue] -= 1

    def choose_victim(self, protected: set[int], rank: Callable[[_R, int], int], index: _R) -> int:
        """The row to evict next, skipping `protected` rows, or EMPTY if none is free.

        Does not remove it; S3-FIFO may move rows between its queues while it looks.
        """
        if self.policy == "s3fifo":
            return self._s3fifo_victim(protected, index)
        row = self._heads[_SMALL]
        if self.policy == "lru":
            while row != EMPTY and row in protected:
                row = int(self.next[row])
            return row
        # prefix: among the coldest candidates, an orphan first, then a leaf, then the coldest.
        first, leaf, seen = EMPTY, EMPTY, 0
        while row != EMPTY and seen < _LOOKAHEAD:
            if row not in protected:
                seen += 1
                place = rank(index, row)
                if place == 0:
                    return row
                if place == 1 and leaf == EMPTY:
                    leaf = row
                if first == EMPTY:
                    first = row
            row = int(self.next[row])
        return leaf if leaf != EMPTY else first

    def _s3fifo_victim(self, protected: set[int], index: Rows) -> int:
        sizes = self._sizes
        # Each row moves or decays at most 4 times before it is evicted or found pinned.
        budget = 4 * (sizes[0] + sizes[1]) + 4
        small_skips = 0  # pinned rows rotated in the small queue: stop once all were seen
        while budget > 0:
            budget -= 1
            small_ok = sizes[_SMALL] > small_skips
            if small_ok and (not sizes[_MAIN] or sizes[_SMALL] * 10 >= sum(sizes)):
                queue = _SMALL
            elif sizes[_MAIN]:
                queue = _MAIN
            elif small_ok:
                queue = _SMALL
            else:
                return EMPTY
            row = self._heads[queue]
            self._unlink(row)
            if row in protected:
                self._link(row, queue)
                small_skips += queue == _SMALL
                continue
            freq = int(self.freq[row])
            if queue == _SMALL and freq > 0:
                self.freq[row] = 0
                self._link(row, _MAIN)
            elif queue == _MAIN and freq > 0:
                self.freq[row] = freq - 1
                self._link(row, _MAIN)
            else:
                self._link(row, queue)  # stays listed until the caller removes it
                if queue == _SMALL:
                    self._ghost_add(index.key_of(row), len(index))
                return row
        return EMPTY

    def _ghost_slot(self, key: bytes) -> tuple[int, int]:
        bit = hash_key(key[::-1]) % self._ghost_bits
        return bit >> 3, 1 << (bit & 7)

    def _ghost_add(self, key: bytes, live: int) -> None:
        byte, mask = self._ghost_slot(key)
        self._ghosts[0][byte] |= mask
        self._ghost_count += 1
        # Two generations of bits: the older one is dropped once the newer has seen as many
        # evictions as the main queues hold, which bounds the ghost's memory.
        if self._ghost_count > max(1024, live):
            self._ghosts = [np.zeros_like(self._ghosts[0]), self._ghosts[0]]
            self._ghost_count = 0
            if live * 8 > self._ghost_bits:
                self._ghost_bits = 1 << (live * 8).bit_length()
                self._ghosts = [np.zeros(self._ghost_bits // 8, np.uint8) for _ in range(2)]

    def _ghost_take(self, key: bytes) -> bool:
        byte, mask = self._ghost_slot(key)
        return any(int(g[byte]) & mask for g in self._ghosts)
