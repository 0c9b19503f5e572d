"""The keys of one NVMe KV namespace, for the KV List command.

The engine has no way to enumerate its keys, and a tenant's engine keys are hashes that cannot
be turned back into the host's keys, so the NVMe front remembers the keys stored through it:
namespace key -> engine key. An entry may outlive its block (eviction does not tell the front),
so readers confirm each key with the engine, and the directory is swept — every entry checked
against the engine, off the event loop — whenever it has doubled since the last sweep; it stays
within a small multiple of what the store actually holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

__all__ = ["KeyDirectory"]

# Below this many entries a sweep is not worth a thread hop.
_SWEEP_FLOOR = 4096


class KeyDirectory:
    """Namespace keys stored through the NVMe front (not thread-safe: the event loop owns it)."""

    def __init__(self) -> None:
        self._keys: dict[bytes, bytes] = {}
        self._sorted: list[bytes] | None = []
        self._limit = _SWEEP_FLOOR
        self._touched: set[bytes] | None = None  # keys stored while a sweep runs

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes, engine_key: bytes) -> None:
        if key not in self._keys:
            self._sorted = None
        self._keys[key] = engine_key
        if self._touched is not None:
            self._touched.add(key)

    def remove(self, key: bytes) -> None:
        if self._keys.pop(key, None) is not None:
            self._sorted = None

    def from_key(self, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        """(key, engine key) for keys >= `start` in ascending byte order (stable while the
        caller does not add or remove keys)."""
        if self._sorted is None:
            self._sorted = sorted(self._keys)
        ordered = self._sorted
        for i in range(bisect.bisect_left(ordered, start), len(ordered)):
            key = ordered[i]
            engine_key = self._keys.get(key)
            if engine_key is not None:
                yield key, engine_key

    @property
    def needs_sweep(self) -> bool:
        return self._touched is None and len(self._keys) > self._limit

    def begin_sweep(self) -> Callable[[Callable[[bytes], bool]], list[bytes]]:
        """Start a sweep: returns the check to run off the loop with the engine's `contains`;
        hand its result to `end_sweep` on the loop."""
        snapshot = list(self._keys.items())
        self._touched = set()

        def check(contains: Callable[[bytes], bool]) -> list[bytes]:
            return [key for key, engine_key in snapshot if not contains(engine_key)]

        return check

    def end_sweep(self, gone: list[bytes] | None) -> None:
        """Drop the keys the sweep found gone, except those stored again meanwhile."""
        touched, self._touched = self._touched or set(), None
        for key in gone or ():
            if key not in touched:
                self.remove(key)
        self._limit = max(_SWEEP_FLOOR, 2 * len(self._keys))
