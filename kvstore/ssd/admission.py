"""SSD admission: a count-min sketch of how often each key was put or read.

A block evicted from DRAM is written to the SSD only if it was used at least `min_uses` times
(puts, lookups and reads all count), so that with `ssd.admission_min_uses = 2` blocks stored
once and never wanted again need not wear the SSD (the TinyLFU idea; Dynamo's KVBM admits to
disk at frequency 2 as well). The default is 1, every block: see `SsdConfig`.
"""

from __future__ import annotations

import numpy as np

from kvoffload.kvstore.ssd.keyhash import hash_key

__all__ = ["FrequencySketch"]

_ROWS = 4
_MAX = 15


class FrequencySketch:
    """Four rows of saturating 8-bit counters; halved periodically so old history fades."""

    def __init__(self, width_bits: int = 20) -> None:
        self._bits = width_bits
        self._mask = (1 << width_bits) - 1
        # One bytearray per row: a counter is read and bumped as a Python int (numpy scalar
        # indexing cost ~1 us a cell, on every get); `_halve` shifts the rows as arrays.
        self._rows = [bytearray(1 << width_bits) for _ in range(_ROWS)]
        self._adds = 0
        self._reset_at = 10 << width_bits

    def _cells(self, key: bytes) -> tuple[int, int, int, int]:
        # Two independent 64-bit hashes give four 20-bit row indices.
        h = hash_key(key) | (hash_key(key[::-1] + b"\x01") << 64)
        bits, mask = self._bits, self._mask
        return h & mask, (h >> bits) & mask, (h >> 2 * bits) & mask, (h >> 3 * bits) & mask

    def add(self, key: bytes) -> None:
        for row, cell in zip(self._rows, self._cells(key), strict=True):
            if row[cell] < _MAX:
                row[cell] += 1
        self._adds += 1
        if self._adds >= self._reset_at:
            self._halve()

    def _halve(self) -> None:
        for row in self._rows:
            counts = np.frombuffer(row, dtype=np.uint8)
            counts >>= 1
        self._adds //= 2

    def estimate(self, key: bytes) -> int:
        return min(row[cell] for row, cell in zip(self._rows, self._cells(key), strict=True))
