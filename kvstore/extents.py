"""Extent allocator of both tiers: variable-size, page-aligned slots in one address range.

Bookkeeping only, no bytes. Every slot is a whole number of pages (so it can feed O_DIRECT as
is) and exactly as large as its value needs: there are no size classes, so values of mixed
sizes share the whole range. Free space is kept as coalesced extents, found best-fit; slots in
use are the caller's to track (it knows each slot's size). When no extent fits, a tier evicts
blocks until one does, so a full tier keeps nearly all of its bytes live under mixed sizes
without moving any block (docs/design/architecture.md).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from kvoffload.kvstore.config import PAGE

__all__ = ["ExtentAllocator", "slot_bytes", "slot_sizes"]


def slot_bytes(length: int) -> int:
    """Bytes of the slot that holds a `length`-byte value: whole pages, at least one."""
    return max(PAGE, -(-length // PAGE) * PAGE)


def slot_sizes(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """`slot_bytes` of each length."""
    out: npt.NDArray[np.int64] = np.maximum(PAGE, -(-lengths // PAGE) * PAGE)
    return out


# Free extents by size are kept as single ints, (pages << _SHIFT) | start page, so that best
# fit is one bisect over ints (tuples compare several times slower).
_SHIFT = 40


class ExtentAllocator:
    """Best-fit allocation of page-multiple slots in `[0, size)`, with coalescing frees."""

    def __init__(self, size: int) -> None:
        self.size = size // PAGE * PAGE
        self._starts: dict[int, int] = {}  # free extents: start -> end ...
        self._ends: dict[int, int] = {}  # ... and end -> start, to merge neighbours in O(1)
        self._by_size = SortedList()
        self.used_bytes = 0
        if self.size:
            self._add_free(0, self.size)

    # ------------------------------------------------------------------ free extents

    def _add_free(self, start: int, end: int) -> None:
        self._starts[start] = end
        self._ends[end] = start
        self._by_size.add(((end - start) // PAGE) << _SHIFT | start // PAGE)

    def _take_free(self, start: int) -> int:
        end = self._starts.pop(start)
        del self._ends[end]
        self._by_size.remove(((end - start) // PAGE) << _SHIFT | start // PAGE)
        return end

    # ------------------------------------------------------------------ public

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of `nbytes` (a page multiple), or None if no extent fits."""
        i = self._by_size.bisect_left((nbytes // PAGE) << _SHIFT)
        if i == len(self._by_size):
            return None
        start: int = (self._by_size[i] & ((1 << _SHIFT) - 1)) * PAGE
        end = self._take_free(start)
        if end - start > nbytes:
            self._add_free(start + nbytes, end)
        self.used_bytes += nbytes
        return start

    def free(self, offset: int, nbytes: int) -> tuple[int, int]:
        """Give the `nbytes` slot at `offset` back, merging it with free neighbours; returns
        the free extent it became part of."""
        self.used_bytes -= nbytes
        start, end = offset, offset + nbytes
        left = self._ends.get(start)
        if left is not None:
            self._take_free(left)
            start = left
        if end in self._starts:
            end = self._take_free(end)
        self._add_free(start, end)
        return start, end

    def is_free(self, start: int, end: int) -> bool:
        """Whether `[start, end)` is exactly one free extent."""
        return self._starts.get(start) == end

    @property
    def largest_free(self) -> int:
        return (self._by_size[-1] >> _SHIFT) * PAGE if self._by_size else 0

    @property
    def free_extents(self) -> int:
        return len(self._starts)

    def restore(
        self, offsets: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.bool_]:
        """Mark the slots in use after a restart (an empty allocator); returns the mask of rows
        accepted. A row is refused when it is not page-aligned, lies outside the range, or
        overlaps a row at a lower address (or earlier in the input at the same address)."""
        ok: npt.NDArray[np.bool_] = (
            (offsets >= 0) & (offsets % PAGE == 0) & (sizes > 0) & (offsets + sizes <= self.size)
        )
        rows = np.flatnonzero(ok)
        rows = rows[np.argsort(offsets[rows], kind="stable")]  # address order, ties by input
        ends = offsets[rows] + sizes[rows]
        # A row must start at or after the end of every row before it in address order.
        reach = np.concatenate(([0], np.maximum.accumulate(ends)[:-1])) if len(rows) else ends
        keep = offsets[rows] >= reach
        ok[rows[~keep]] = False
        kept = rows[keep]
        self._starts.clear()
        self._ends.clear()
        self._by_size.clear()
        self.used_bytes = int(sizes[kept].sum())
        # The gaps between kept rows (in address order) are the free extents.
        starts, ends = offsets[kept], offsets[kept] + sizes[kept]
        gap_starts = np.concatenate(([0], ends))
        gap_ends = np.concatenate((starts, [self.size]))
        gaps = np.flatnonzero(gap_ends > gap_starts)
        for start, end in zip(gap_starts[gaps].tolist(), gap_ends[gaps].tolist(), strict=True):
            self._add_free(start, end)
        return ok
