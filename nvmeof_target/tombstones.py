"""Keys deleted lately, so that a cluster's read repair never lands after a delete.

A cluster client that reads a block from one replica copies it to an owner that missed it, in
the background (`Repair`). That copy can reach the owner after a delete of the key has (trust
issue 27 (b)): stored then, it brings the deleted block back. So every delete leaves a
tombstone here for `TOMBSTONE_RETENTION_S` seconds of this node's monotonic clock (no clock of
another machine is involved), and a repair is stored only when the key is absent and has no
tombstone, checked under the same lock as the tombstone is laid, atomically with the commit.
Clients send a repair only within `REPAIR_MAX_AGE_S` of its read, well inside the retention.

A cluster node that restarts under an id clients knew, or drops its blocks to rejoin, has no
tombstones of what was deleted before; so it refuses every repair for `REPAIR_HOLD_S` (`hold`),
longer than any repair may be on its way. (A new node needs no hold: no client read from it
before it started.) At most `MAX_KEYS` tombstones are kept (the oldest go first): past that many
deletes within the retention, a late repair may restore a block deleted a while ago.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvoffload.kvstore import PutReservation
from kvoffload.wire.native.connection import REPAIR_HOLD_S, TOMBSTONE_RETENTION_S

__all__ = ["MAX_KEYS", "Tombstones"]

MAX_KEYS = 200_000


class Tombstones:
    """Engine keys deleted within the retention, oldest first."""

    def __init__(
        self,
        retention_s: float = TOMBSTONE_RETENTION_S,
        max_keys: int = MAX_KEYS,
        hold_s: float = REPAIR_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retention_s = retention_s
        self._max_keys = max_keys
        self._hold_s = hold_s
        self._clock = clock
        self._at: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()
        self._held_until = -math.inf

    def hold(self) -> None:
        """Refuse repairs for `hold_s` from now (the node just dropped its blocks)."""
        with self._lock:
            self._held_until = self._clock() + self._hold_s

    def __len__(self) -> int:
        return len(self._at)

    def deleting(self, key: bytes) -> None:
        """`key` is about to be deleted (laid before the engine deletes it)."""
        with self._lock:
            self._at[key] = self._clock()
            self._at.move_to_end(key)
            self._expire()

    def commit_repair(self, key: bytes, reservation: PutReservation) -> bool:
        """Publish a repair's reservation unless `key` is stored or has a tombstone; False
        (the slot given back) when it was not stored."""
        with self._lock:
            self._expire()
            if key in self._at or self._clock() < self._held_until:
                reservation.abort()
                return False
            return reservation.commit(if_stored=False)

    def _expire(self) -> None:
        horizon = self._clock() - self._retention_s
        at = self._at
        while at and (len(at) > self._max_keys or next(iter(at.values())) < horizon):
            at.popitem(last=False)
