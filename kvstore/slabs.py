"""Size classes and the slab allocator of the DRAM tier (bookkeeping only, no bytes)."""

from __future__ import annotations

import bisect
from array import array

import numpy as np
import numpy.typing as npt

from kvoffload.kvstore.config import PAGE

__all__ = ["SizeClasses", "SlabAllocator"]


class SizeClasses:
    """Slot sizes: multiples of 4 KiB growing by a fixed ratio up to the largest value.

    Page-multiple slots keep every slot 4 KiB-aligned (so it can feed O_DIRECT as is); the ratio
    bounds the space a value wastes in its slot.
    """

    def __init__(self, max_value_bytes: int, growth: float) -> None:
        top = -(-max_value_bytes // PAGE) * PAGE
        sizes = [PAGE]
        while sizes[-1] < top:
            grown = -(-int(sizes[-1] * growth) // PAGE) * PAGE
            sizes.append(min(top, max(sizes[-1] + PAGE, grown)))
        self.sizes: list[int] = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def class_of(self, length: int) -> int:
        """Index of the smallest class holding `length` bytes (the caller checked the maximum)."""
        return bisect.bisect_left(self.sizes, max(length, 1))


class SlabAllocator:
    """Hands out fixed-size slots; every slab serves one size class until it is empty again.

    A slab whose last slot is freed returns to the shared pool at once, so a class that stops
    being used gives its memory back without any rebalancing pass.
    """

    def __init__(self, n_slabs: int, slab_bytes: int, classes: SizeClasses) -> None:
        self.slab_bytes = slab_bytes
        self.classes = classes
        self.n_slabs = n_slabs
        self.slab_class = [-1] * n_slabs
        self._free_slabs = list(range(n_slabs - 1, -1, -1))
        # Free slot indices per slab as C arrays: 4 bytes a slot, no int objects.
        self._free_slots: list[array[int]] = [array("I") for _ in range(n_slabs)]
        self._partial: list[dict[int, None]] = [{} for _ in classes.sizes]
        self._slabs_of: list[set[int]] = [set() for _ in classes.sizes]
        self.used_bytes = 0

    def slots_per_slab(self, cls: int) -> int:
        return self.slab_bytes // self.classes.sizes[cls]

    def slabs_of(self, cls: int) -> set[int]:
        return self._slabs_of[cls]

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def alloc(self, cls: int) -> int | None:
        """Return the offset of a free slot of class `cls`, or None when the class is full and
        no slab is free."""
        partial = self._partial[cls]
        if partial:
            slab = next(iter(partial))
        elif self._free_slabs:
            slab = self._free_slabs.pop()
            self.slab_class[slab] = cls
            self._slabs_of[cls].add(slab)
            # Hand out low slots first: a short-lived class touches as little memory as it can.
            self._free_slots[slab] = array("I", range(self.slots_per_slab(cls) - 1, -1, -1))
            partial[slab] = None
        else:
            return None
        slots = self._free_slots[slab]
        index = slots.pop()
        if not slots:
            del partial[slab]
        size = self.classes.sizes[cls]
        self.used_bytes += size
        return slab * self.slab_bytes + index * size

    def free(self, offset: int) -> None:
        slab = offset // self.slab_bytes
        cls = self.slab_class[slab]
        size = self.classes.sizes[cls]
        slots = self._free_slots[slab]
        slots.append((offset - slab * self.slab_bytes) // size)
        self.used_bytes -= size
        if len(slots) == self.slots_per_slab(cls):
            self._partial[cls].pop(slab, None)
            self._slabs_of[cls].discard(slab)
            self.slab_class[slab] = -1
            self._free_slots[slab] = array("I")
            self._free_slabs.append(slab)
        else:
            self._partial[cls][slab] = None

    def restore(
        self, offsets: npt.NDArray[np.int64], classes: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.bool_]:
        """Rebuild the free lists of an empty allocator from the slots in use (after a restart).

        Vectorised: a million slots take a fraction of a second. Returns a mask of the rows
        accepted; a row is refused when its slab already serves another class (the first row
        of a slab decides), its offset is not a slot boundary of its class, it lies outside the
        slabs, or an earlier row claimed the same slot.
        """
        sizes_of = np.asarray(self.classes.sizes, dtype=np.int64)
        per_slab = self.slab_bytes // sizes_of
        slabs = offsets // self.slab_bytes
        within = offsets - slabs * self.slab_bytes
        ok = (offsets >= 0) & (slabs < self.n_slabs)
        ok &= within % sizes_of[classes] == 0
        rows = np.flatnonzero(ok)
        # The first row of each slab decides the slab's class.
        used, first = np.unique(slabs[rows], return_index=True)
        slab_cls = np.full(self.n_slabs, -1, dtype=np.int64)
        slab_cls[used] = classes[rows[first]]
        ok[rows] &= classes[rows] == slab_cls[slabs[rows]]
        index = within // sizes_of[classes]
        ok &= index < per_slab[classes]
        rows = np.flatnonzero(ok)
        # One owner per slot: the earliest row wins.
        _, first = np.unique(slabs[rows] * (1 << 32) + index[rows], return_index=True)
        keep = np.zeros(len(rows), dtype=bool)
        keep[first] = True
        ok[rows[~keep]] = False
        rows = rows[keep]
        # Occupancy of every slot of every used slab, laid end to end.
        used = np.unique(slabs[rows])
        counts = per_slab[slab_cls[used]]
        base = np.zeros(self.n_slabs, dtype=np.int64)
        base[used] = np.cumsum(counts) - counts
        occupied = np.zeros(int(counts.sum()), dtype=bool)
        occupied[base[slabs[rows]] + index[rows]] = True
        layout = zip(
            used.tolist(),
            slab_cls[used].tolist(),
            base[used].tolist(),
            counts.tolist(),
            strict=True,
        )
        for slab, cls, start, n in layout:
            free = np.flatnonzero(~occupied[start : start + n])[::-1]
            self.slab_class[slab] = cls
            self._slabs_of[cls].add(slab)
            self._free_slots[slab] = array("I", free.astype(np.uint32).tobytes())
            if len(free):
                self._partial[cls][slab] = None
            self.used_bytes += (n - len(free)) * self.classes.sizes[cls]
        in_use = set(used.tolist())
        self._free_slabs = [s for s in range(self.n_slabs - 1, -1, -1) if s not in in_use]
        return ok
