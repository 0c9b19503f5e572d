"""Page-aligned host memory: the DRAM tier's one preallocated arena, and the small aligned
buffers that O_DIRECT slot I/O and a get's side buffer need."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
import numpy.typing as npt

from kvoffload.kvstore.config import PAGE

__all__ = ["AlignedBuffer", "Arena"]

# Not exported by the mmap module on every Python; the Linux value is stable.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


class Arena:
    """An anonymous mapping that never moves and is never resized.

    Fresh anonymous memory here costs a page fault per 4 KiB on first touch (~0.5 GB/s), so
    `prefault` asks the kernel to populate the whole mapping up front (MAP_POPULATE), which is
    several times faster than faulting page by page and keeps that cost out of the first puts.
    """

    def __init__(self, size: int, *, prefault: bool = True) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault:
            flags |= _MAP_POPULATE
        self.size = size
        self._map = mmap.mmap(-1, size, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer TLB misses for large copies; harmless where THP is off.
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)
        self.view = memoryview(self._map)

    def close(self) -> None:
        """Unmap, unless a caller still holds a buffer exported from it (then `unmap` or, at
        the latest, GC unmaps later)."""
        self.view.release()
        self.__dict__.pop("array", None)
        self.unmap()

    def unmap(self) -> bool:
        """Unmap now if nothing holds a buffer exported from the mapping any more (after
        `close`); whether it is unmapped."""
        # A numpy array or memoryview made from a released BlockView may still point here;
        # unmapping now would leave it dangling, so then the GC unmaps later.
        with contextlib.suppress(BufferError):
            self._map.close()
        return bool(self._map.closed)


class AlignedBuffer:
    """Page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        self._map.close()
