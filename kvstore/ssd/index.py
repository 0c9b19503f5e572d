"""The SSD tier's in-memory index: numpy columns per row, an open-addressing key table, a
by-parent chain table and the eviction lists, in well under 128 bytes per block.

A Python dict of entry objects costs ~250 bytes per block; the SSD tier holds millions of
blocks, so every field lives in a flat numpy column and Python touches single cells. Bookkeeping
only: no I/O here. The SSD tier holds the engine lock around every call.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.extents import slot_bytes, slot_sizes
from kvoffload.kvstore.ssd.keyhash import hash_key, hash_keys
from kvoffload.kvstore.ssd.queues import EvictionQueues

__all__ = ["EMPTY", "ROW_DTYPE", "RankFn", "SsdIndex", "ssd_slot_bytes", "ssd_slot_sizes"]

EMPTY = -1
_TOMB = -2
_NO_PARENT = b""
# Columns persisted in checkpoints (and rebuilt from them); the rest is derived state.
ROW_DTYPE = np.dtype(
    [
        ("key", "S16"),
        ("parent", "S16"),
        ("page", "<u4"),  # slot start in 4 KiB pages (16 TiB of slots)
        ("length", "<u4"),
        ("tenant", "<u2"),
        ("flags", "<u2"),  # bit 0: has a parent
        ("seq", "<u8"),
        ("crc", "<u4"),
    ]
)
_HAS_PARENT = 1
# Ranks a row for the prefix policy: 0 orphan, 1 leaf, 2 interior (the tier knows both tiers).
RankFn = Callable[["SsdIndex", int], int]


def ssd_slot_bytes(length: int) -> int:
    """Bytes of the SSD slot of a `length`-byte value: its header page plus the value's pages."""
    return slot_bytes(PAGE + length)


def ssd_slot_sizes(lengths: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """`ssd_slot_bytes` of each length."""
    return slot_sizes(PAGE + lengths.astype(np.int64))


def _stored(key: bytes) -> bytes:
    # numpy "S16" cells drop trailing NULs when read back; two 16-byte keys are equal exactly
    # when their stripped forms are, so compare in stripped form.
    return key.rstrip(b"\x00")


class SsdIndex:
    """Key -> row for the SSD tier, with the policy state of every row.

    Rows hold the persisted fields of `ROW_DTYPE` plus: last-use tick, whether the row is in
    use, S3-FIFO frequency and queue, doubly linked eviction lists (one per queue) and a chain of
    rows sharing a parent-hash bucket (to answer "does this block have a stored child?").
    """

    def __init__(
        self,
        policy: str,
        capacity: int = 1024,
    ) -> None:
        if policy not in ("lru", "s3fifo", "prefix"):
            raise ValueError(f"unknown SSD eviction policy {policy!r}")
        self.policy = policy
        self.tenant_bytes: dict[int, int] = {}
        self._rows = 0  # rows ever used (high-water mark)
        self._free_rows: list[int] = []
        self._live = 0
        self._queues = EvictionQueues(policy, max(capacity, 16))
        self._alloc_columns(max(capacity, 16))

    # ------------------------------------------------------------------ storage

    def _alloc_columns(self, capacity: int, *, build: bool = True) -> None:
        self.rows = np.zeros(capacity, dtype=ROW_DTYPE)
        self.tick = np.zeros(capacity, dtype=np.uint32)
        self.live = np.zeros(capacity, dtype=bool)
        self.sibling = np.full(capacity, EMPTY, dtype=np.int32)
        if build:
            self._build_tables()

    def _grow(self) -> None:
        old = self._rows
        columns = ("rows", "tick", "live", "sibling")
        saved = {name: getattr(self, name)[:old].copy() for name in columns}
        # Modest growth keeps the slack (and so the bytes per block) low.
        self._alloc_columns(len(self.rows) * 5 // 4 + 16, build=False)
        self._queues.resize(len(self.rows), old)
        for name, values in saved.items():
            getattr(self, name)[:old] = values
        self._build_tables()

    def _build_tables(self) -> None:
        """(Re)build the key and parent tables from the rows; load factor stays under 0.5."""
        size = 1 << max(4, (len(self.rows) * 10 // 7).bit_length())
        self._mask = size - 1
        self._table = np.full(size, EMPTY, dtype=np.int32)
        # Parent chains tolerate collisions, so half as many buckets do.
        self._bmask = size // 2 - 1
        self._buckets = np.full(size // 2, EMPTY, dtype=np.int32)
        self._tombs = 0
        live = np.flatnonzero(self.live[: self._rows]).astype(np.int32)
        if not len(live):
            return
        keys = self.rows["key"][live]
        self._place(hash_keys(keys) & np.uint64(self._mask), live)
        with_parent = live[(self.rows["flags"][live] & _HAS_PARENT) != 0]
        buckets = (hash_keys(self.rows["parent"][with_parent]) & np.uint64(self._bmask)).astype(
            np.int64
        )
        # Chain rows sharing a bucket: each row points at the next one of its bucket.
        order = np.argsort(buckets, kind="stable")
        b, r = buckets[order], with_parent[order]
        self.sibling[r] = EMPTY
        same = b[1:] == b[:-1]
        self.sibling[r[:-1][same]] = r[1:][same]
        starts = np.ones(len(b), dtype=bool)
        starts[1:] = ~same
        self._buckets[b[starts]] = r[starts]

    def _place(self, home: npt.NDArray[np.uint64], rows: npt.NDArray[np.int32]) -> None:
        """Linear-probing insert of rows whose keys are distinct into the empty table.

        Vectorised: taken in order of home slot, each row gets the first free slot at or after
        its home, i.e. slot = max(home, previous slot + 1), a running maximum. Rows pushed
        past the end go on from slot 0, one by one (a handful at this load factor).
        """
        order = np.argsort(home, kind="stable")
        ranks = np.arange(len(order), dtype=np.int64)
        pos = np.maximum.accumulate(home[order].astype(np.int64) - ranks) + ranks
        inside = pos < len(self._table)
        placed = rows[order]
        self._table[pos[inside]] = placed[inside]
        free = 0
        for row in placed[~inside].tolist():
            while int(self._table[free]) != EMPTY:
                free += 1
            self._table[free] = row

    # ------------------------------------------------------------------ lookups

    def __len__(self) -> int:
        return self._live

    def find(self, key: bytes) -> int:
        """Row of `key`, or EMPTY."""
        want = _stored(key)
        pos = hash_key(key) & self._mask
        table, keys = self._table, self.rows["key"]
        while True:
            row = int(table[pos])
            if row == EMPTY:
                return EMPTY
            if row >= 0 and keys[row] == want:
                return row
            pos = (pos + 1) & self._mask

    def key_of(self, row: int) -> bytes:
        return bytes(self.rows["key"][row]).ljust(16, b"\x00")

    def parent_of(self, row: int) -> bytes | None:
        if not self.rows["flags"][row] & _HAS_PARENT:
            return None
        return bytes(self.rows["parent"][row]).ljust(16, b"\x00")

    def has_child(self, key: bytes) -> bool:
        """Whether any stored row names `key` as its parent."""
        want = _stored(key)
        row = int(self._buckets[hash_key(key) & self._bmask])
        parents = self.rows["parent"]
        while row != EMPTY:
            if parents[row] == want:
                return True
            row = int(self.sibling[row])
        return False

    def live_rows(self) -> npt.NDArray[np.int64]:
        return np.flatnonzero(self.live[: self._rows])

    # ------------------------------------------------------------------ updates

    def insert(
        self,
        key: bytes,
        *,
        page: int,
        length: int,
        seq: int,
        crc: int,
        parent: bytes | None,
        tenant: int,
        tick: int,
    ) -> int:
        """Add a row for `key`, which must not be present. Returns the row."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            if self._rows == len(self.rows):
                self._grow()
            row = self._rows
            self._rows += 1
        self.rows[row] = (key, parent or _NO_PARENT, page, length, tenant,
                          _HAS_PARENT if parent is not None else 0, seq, crc)  # fmt: skip
        self.tick[row] = tick
        self.live[row] = True
        self._live += 1
        self._charge(tenant, length, 1)
        if (self._live + self._tombs) * 10 > len(self._table) * 7:
            self._build_tables()  # also places this row
        else:
            self._table_insert(key, row)
            if parent is not None:
                bucket = hash_key(parent) & self._bmask
                self.sibling[row] = self._buckets[bucket]
                self._buckets[bucket] = row
        self._queues.add(row, key)
        return row

    def _table_insert(self, key: bytes, row: int) -> None:
        pos = hash_key(key) & self._mask
        while int(self._table[pos]) >= 0:
            pos = (pos + 1) & self._mask
        if int(self._table[pos]) == _TOMB:
            self._tombs -= 1
        self._table[pos] = row

    def remove(self, row: int) -> None:
        """Forget a row (the caller frees its SSD slot)."""
        key = self.key_of(row)
        pos = hash_key(key) & self._mask
        while int(self._table[pos]) != row:
            pos = (pos + 1) & self._mask
        self._table[pos] = _TOMB
        self._tombs += 1
        parent = self.parent_of(row)
        if parent is not None:
            bucket = hash_key(parent) & self._bmask
            if int(self._buckets[bucket]) == row:
                self._buckets[bucket] = self.sibling[row]
            else:
                prev = int(self._buckets[bucket])
                while int(self.sibling[prev]) != row:
                    prev = int(self.sibling[prev])
                self.sibling[prev] = self.sibling[row]
        self._queues.remove(row)
        self._charge(int(self.rows["tenant"][row]), int(self.rows["length"][row]), -1)
        self.live[row] = False
        self._live -= 1
        self._free_rows.append(row)
        if self._tombs * 4 > len(self._table):
            self._build_tables()

    def _charge(self, tenant: int, length: int, sign: int) -> None:
        """Keep the slot bytes each tenant holds (for its SSD quota)."""
        used = self.tenant_bytes.get(tenant, 0) + sign * ssd_slot_bytes(length)
        if used:
            self.tenant_bytes[tenant] = used
        else:
            self.tenant_bytes.pop(tenant, None)

    def coldest_of_tenant(
        self, tenant: int, now: int, protected: set[int], count: int
    ) -> npt.NDArray[np.int64]:
        """Up to `count` of the tenant's least recently used rows, coldest first, skipping
        `protected` rows (one vectorised pass over the rows, for quota evictions)."""
        used = self._rows
        live = self.live[:used]
        rows = np.flatnonzero(live & (self.rows["tenant"][:used] == tenant))
        if protected:
            rows = rows[~np.isin(rows, np.fromiter(protected, np.int64, len(protected)))]
        # Ticks wrap at 2**32: order by age, which uint32 subtraction gets right.
        age = np.uint32(now & 0xFFFFFFFF) - self.tick[rows]
        if len(rows) > count:
            pick = np.argpartition(-age.astype(np.int64), count - 1)[:count]
            rows, age = rows[pick], age[pick]
        out: npt.NDArray[np.int64] = rows[np.argsort(-age.astype(np.int64), kind="stable")]
        return out

    def touch(self, row: int, tick: int) -> None:
        """The row was read: refresh its recency (LRU/prefix) or frequency (S3-FIFO)."""
        self.tick[row] = tick
        self._queues.touch(row)

    def choose_victim(self, protected: set[int], rank: RankFn) -> int:
        """The row to evict next, skipping `protected` rows, or EMPTY if none is free.

        Does not remove it; S3-FIFO may move rows between its queues while it looks.
        """
        return self._queues.choose_victim(protected, rank, self)

    # ------------------------------------------------------------------ bulk

    def export(self) -> npt.NDArray[np.void]:
        """The persisted fields of every live row (for a checkpoint)."""
        return self.rows[self.live_rows()]

    def load(self, records: npt.NDArray[np.void]) -> None:
        """Replace the contents with `records` (distinct keys), in the given order as recency."""
        n = len(records)
        self._alloc_columns(max(16, n * 9 // 8), build=False)
        self._rows = n
        self._live = n
        self._free_rows = []
        self.rows[:n] = records
        self.live[:n] = True
        self.tick[:n] = 0
        self._queues.resize(len(self.rows), 0)
        self._queues.load(n)
        self.tenant_bytes = {}
        if n:
            sizes = ssd_slot_sizes(self.rows["length"][:n])
            per = np.bincount(self.rows["tenant"][:n], weights=sizes, minlength=1)
            self.tenant_bytes = {int(t): int(b) for t, b in enumerate(per) if b}
        self._build_tables()

    def memory_bytes(self) -> int:
        """Bytes held by the index's arrays (what `bench ssd` reports per entry)."""
        arrays = (self.rows, self.tick, self.live, self.sibling, self._table, self._buckets)
        return (
            sum(a.nbytes for a in arrays) + self._queues.memory_bytes() + 8 * len(self._free_rows)
        )
