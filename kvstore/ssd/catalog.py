"""The SSD tier's books: which block is in which slot (index, allocator), tenants and their
quotas, the sequence numbers, and the journal records that make each change durable.

No slot I/O here (the tier does it, `kvstore.ssd.tier`); every method expects the engine's
lock held. Slots freed by a change are reused only once its journal record is durable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

import kvoffload.kvstore.ssd.journal as jr
from kvoffload.errors import CapacityError, StorageIOError
from kvoffload.kvstore.config import PAGE, EngineConfig
from kvoffload.kvstore.extents import ExtentAllocator
from kvoffload.kvstore.ssd.index import (
    EMPTY,
    ROW_DTYPE,
    RankFn,
    SsdIndex,
    ssd_slot_bytes,
    ssd_slot_sizes,
)
from kvoffload.kvstore.ssd.keyhash import hash_keys
from kvoffload.kvstore.ssd.metabook import MetaBook

__all__ = ["Counters", "SsdCatalog", "WritePlan", "export_records", "restore_slots"]

_QUOTA_BATCH = 64  # rows one pass over the index hands to a tenant over its SSD quota


@dataclass(eq=False, slots=True)
class WritePlan:
    """An SSD slot set aside for one block; not visible until `commit_write`."""

    key: bytes
    parent: bytes | None
    tenant: int
    length: int
    size: int  # slot bytes: header page + value pages
    offset: int
    seq: int
    crc: int = 0
    replaced: _Row | None = None  # the key's SSD copy that `commit_write` took out of the index
    meta: bytes | None = None  # the block's metadata, journaled with its PUT


@dataclass(frozen=True, slots=True)
class _Row:
    """An index row as `SsdIndex.insert` takes it (to put a replaced copy back)."""

    page: int
    length: int
    seq: int
    crc: int
    parent: bytes | None
    tenant: int
    tick: int
    meta: bytes | None = None  # its META records


def restore_slots(
    alloc: ExtentAllocator,
    pages: npt.NDArray[np.integer],
    lengths: npt.NDArray[np.integer],
    max_value_bytes: int,
) -> npt.NDArray[np.bool_]:
    """Mark the slots of stored rows in use in an empty allocator (an open, or fsck's
    rebuild); returns the rows kept. A row longer than the store's largest value, outside the
    file or overlapping another is refused."""
    fits = lengths <= max_value_bytes
    ok = np.zeros(len(pages), dtype=bool)
    ok[fits] = alloc.restore(pages[fits].astype(np.int64) * PAGE, ssd_slot_sizes(lengths[fits]))
    return ok


def _first_of_each(keys: npt.NDArray[np.bytes_]) -> npt.NDArray[np.int64]:
    """Where each distinct key first occurs (as `np.unique(keys, return_index=True)[1]`, in
    another order). Sorts the keys' 64-bit hashes, several times faster than sorting 16-byte
    strings; if two distinct keys share a hash, sorts the strings after all."""
    hashes = hash_keys(keys)
    order = np.argsort(hashes, kind="stable")
    start = np.ones(len(keys), bool)
    start[1:] = hashes[order][1:] != hashes[order][:-1]
    head = order[np.maximum.accumulate(np.where(start, np.arange(len(keys)), 0))]
    if not np.array_equal(keys[order], keys[head]):
        first: npt.NDArray[np.int64] = np.unique(keys, return_index=True)[1]
        return first
    return order[start]


@dataclass
class Counters:
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # blocks that failed their checksum (served as misses)
    io_errors: int = 0  # device or journal failures
    checkpoints: int = 0


class SsdCatalog:
    """Where every SSD block is and how the journal records it."""

    def __init__(
        self,
        config: EngineConfig,
        capacity: int,
        max_value_bytes: int,
        rank: RankFn,
        on_removed: Callable[[bytes], None],
    ) -> None:
        self.alloc = ExtentAllocator(capacity)
        self.index = SsdIndex(config.ssd_policy)
        self.max_value_bytes = max_value_bytes
        self._rank = rank
        self._on_removed = on_removed
        self.quotas: dict[int, int] = {}  # tenant id -> SSD slot bytes it may hold
        self.tenants: list[str] = [""]
        self._tenant_ids = {"": 0}
        self.seq = 0
        self.tick = 0
        self.pinned: dict[int, int] = {}  # row -> readers in flight
        # Slots freed by a record not yet durable: (journal, ticket, offset, bytes). The journal
        # is kept with its ticket: a checkpoint may switch journals before the slot is queued.
        self._pending_free: list[tuple[jr.Journal, int, int, int]] = []
        # Slot bytes per tenant planned and not yet committed or aborted: a quota counts them,
        # else writes in flight at once (a request's and the demotion writer's) each fit it.
        self._planned: dict[int, int] = {}
        self.counters = Counters()
        self.records_since_checkpoint = 0
        self.journal: jr.Journal | None = None  # None until opened, and read-only
        # Durable puts between planning their write and publishing, by key: their seqs. A
        # demotion of an older DRAM value of such a key must not commit over them, and a fast
        # put must not delete their copies.
        self.writing: dict[bytes, set[int]] = {}
        self.meta = MetaBook()  # block metadata of the SSD copies

    def apply(self, records: npt.NDArray[np.void]) -> int:
        """Rebuild index and allocator from replayed records (per key, the highest seq wins);
        returns how many rows did not fit the slot layout and were refused."""
        tenants = records[records["type"] == jr.TENANT]
        for rec in tenants[np.argsort(tenants["tenant"], kind="stable")]:
            tid, name = int(rec["tenant"]), bytes(rec["name"]).decode()
            while len(self.tenants) <= tid:
                self.tenants.append(f"#{len(self.tenants)}")
            self.tenants[tid] = name
            self._tenant_ids[name] = tid
        # Work on row numbers and copy whole 128-byte records only once, at the end.
        kinds = records["type"]
        changes = np.flatnonzero((kinds == jr.PUT) | (kinds == jr.DEL))
        if len(changes):
            self.seq = int(records["seq"][changes].max())
        newest = changes[np.argsort(records["seq"][changes], kind="stable")[::-1]]
        winners = newest[_first_of_each(records["key"][newest])]
        winners = winners[kinds[winners] == jr.PUT]
        winners = winners[np.argsort(records["seq"][winners], kind="stable")]  # oldest first
        # Gathered as opaque 128-byte items: a gather through the record's fields is slower.
        items = np.ascontiguousarray(records).view(f"V{jr.RECORD_BYTES}")
        final = items[winners].view(jr.RECORD)
        kept = self._install(final)
        self.meta.install(records, final[kept])
        return int((~kept).sum())

    def _install(self, final: npt.NDArray[np.void]) -> npt.NDArray[np.bool_]:
        """Load PUT records into an empty index and allocator; returns which were kept."""
        rows = np.zeros(len(final), dtype=ROW_DTYPE)
        for name in ("key", "parent", "page", "length", "tenant", "seq"):
            rows[name] = final[name]
        rows["flags"] = final["flags"]
        rows["crc"] = final["pcrc"]
        ok = restore_slots(self.alloc, rows["page"], rows["length"], self.max_value_bytes)
        self.index.load(rows[ok])
        return ok

    def tenant_id(self, name: str) -> int:
        tid = self._tenant_ids.get(name)
        if tid is None:
            if len(name.encode()) > 60:
                raise StorageIOError(f"tenant name {name!r} is longer than 60 bytes")
            tid = len(self.tenants)
            self.tenants.append(name)
            self._tenant_ids[name] = tid
            assert self.journal is not None
            self.journal.append(jr.pack(jr.record(jr.TENANT, 0, tenant=tid, name=name.encode())))
        return tid

    def find(self, key: bytes) -> int:
        return self.index.find(key)

    def next_tick(self) -> int:
        self.tick = (self.tick + 1) & 0xFFFFFFFF
        return self.tick

    def plan_write(self, key: bytes, length: int, parent: bytes | None, tenant: str) -> WritePlan:
        """Set aside a slot for `key`, evicting SSD blocks if needed.

        Raises:
            CapacityError: no slot can be freed (every candidate is being read).
            StorageIOError: the journal failed.
        """
        if length > self.max_value_bytes:
            raise CapacityError(f"a {length}-byte value does not fit an SSD slot")
        size = ssd_slot_bytes(length)
        tid = self.tenant_id(tenant)
        self._fit_quota(tid, size)
        offset = self._reserve(size)
        self._planned[tid] = self._planned.get(tid, 0) + size
        self.seq += 1
        return WritePlan(key, parent, tid, length, size, offset, self.seq)

    def set_quota(self, tenant: str, quota_bytes: int | None) -> None:
        """Limit the SSD slot bytes `tenant` may hold (None: no limit); enforced on writes."""
        tid = self.tenant_id(tenant)
        if quota_bytes is None:
            self.quotas.pop(tid, None)
        else:
            self.quotas[tid] = quota_bytes

    def _fit_quota(self, tid: int, size: int) -> None:
        """Evict the tenant's least recently used SSD blocks until `size` more bytes fit its
        quota. Finding them is one pass over the index, so once a tenant is at its quota it is
        brought 1/64 of the quota below it: the next writes fit without another pass."""
        quota = self.quotas.get(tid)
        if quota is None:
            return
        name = self.tenants[tid]
        if size > quota:
            raise CapacityError(
                f"a {size}-byte slot exceeds tenant {name!r}'s SSD quota of {quota}"
            )
        planned = self._planned.get(tid, 0)
        if self.index.tenant_bytes.get(tid, 0) + planned + size <= quota:
            return
        target = max(0, quota - size - quota // 64)
        while self.index.tenant_bytes.get(tid, 0) + planned > target:
            victims = self.index.coldest_of_tenant(tid, self.tick, set(self.pinned), _QUOTA_BATCH)
            if not len(victims):
                if self.index.tenant_bytes.get(tid, 0) + planned + size <= quota:
                    return  # the rest is being read, but this write fits
                raise CapacityError(
                    f"tenant {name!r} is at its SSD quota of {quota} bytes and every block it "
                    "holds there is being read or written"
                )
            for row in victims:
                if self.index.tenant_bytes.get(tid, 0) + planned <= target:
                    break
                self.counters.evictions += 1
                self.remove_row(int(row))

    def release_pending(self, *, wait: bool = False) -> None:
        if not self._pending_free:
            return
        if wait:
            last: dict[jr.Journal, int] = {}
            for journal, ticket, _, _ in self._pending_free:
                last[journal] = max(last.get(journal, 0), ticket)
            for journal, ticket in last.items():
                journal.wait(ticket)
        keep = []
        for pending in self._pending_free:
            journal, ticket, offset, size = pending
            if ticket <= journal.durable_ticket:
                self.alloc.free(offset, size)
            else:
                keep.append(pending)
        self._pending_free = keep

    def _reserve(self, size: int) -> int:
        """A free `size`-byte slot: evicts blocks in policy order until one fits.

        Evicted slots are reusable once their DEL records are durable, so victims are taken
        until as many bytes wait for the journal as the slot needs, then one sync frees them.
        """
        self.release_pending()
        while True:
            offset = self.alloc.alloc(size)
            if offset is not None:
                return offset
            waiting = sum(n for _, _, _, n in self._pending_free)
            victim = EMPTY
            if waiting < size:
                victim = self.index.choose_victim(set(self.pinned), self._rank)
            if victim != EMPTY:
                self.counters.evictions += 1
                self.remove_row(victim)
            elif self._pending_free:
                self.release_pending(wait=True)
            else:
                raise CapacityError(
                    f"no room for a {size}-byte SSD slot: every block that could make room "
                    "is being read"
                )

    def remove_row(self, row: int) -> None:
        """Forget a stored block; its slot is reused once the DEL record is durable."""
        self.release_slot(*self.detach_row(row))

    def detach_row(self, row: int, *, notify: bool = True) -> tuple[jr.Journal, int, int, int]:
        """Forget a stored block but keep its slot out of reuse; returns (journal, ticket,
        offset, bytes) for `release_slot`, after the caller has wiped the slot.
        `notify` False skips the removal callback (the caller's own delete)."""
        assert self.journal is not None
        key = self.index.key_of(row)
        offset, size = self._slot_of(row)
        self.seq += 1
        ticket = self.journal.append(jr.pack(jr.record(jr.DEL, self.seq, key)))
        self.index.remove(row)
        self.meta.drop(key)
        if notify:
            self._on_removed(key)
        return self.journal, ticket, offset, size

    def _slot_of(self, row: int) -> tuple[int, int]:
        rows = self.index.rows
        return int(rows["page"][row]) * PAGE, ssd_slot_bytes(int(rows["length"][row]))

    def drop_row(self, row: int) -> None:
        """Forget a block whose record may never become durable (the journal failed), without
        a record of its own: its slot stays out of use until the tier is reopened."""
        key = self.index.key_of(row)
        self.index.remove(row)
        self.meta.drop(key)
        self._on_removed(key)

    def undo_commit(self, plan: WritePlan) -> bool:
        """The journal failed before `plan`'s record was durable: forget the block and give the
        key back the SSD copy it replaced, whose record is durable (a reopen finds it too: the
        journal is cut back to what was synced). True if that copy is back."""
        row = self.index.find(plan.key)
        if row != EMPTY and int(self.index.rows["seq"][row]) == plan.seq:
            self.drop_row(row)
        old = plan.replaced
        if old is None or self.index.find(plan.key) != EMPTY:
            return False  # nothing replaced, or a newer version took the key meanwhile
        offset = old.page * PAGE
        self._pending_free = [p for p in self._pending_free if p[2] != offset]
        self.index.insert(plan.key, page=old.page, length=old.length, seq=old.seq, crc=old.crc,
                          parent=old.parent, tenant=old.tenant,
                          tick=old.tick)  # fmt: skip
        self.meta.set(plan.key, old.meta)
        return True

    def release_slot(self, journal: jr.Journal, ticket: int, offset: int, size: int) -> None:
        self._pending_free.append((journal, ticket, offset, size))

    def commit_write(self, plan: WritePlan) -> int | None:
        """Make a written slot the block's SSD copy. Returns the journal ticket to wait on, or
        None when a newer version of the key was committed meanwhile (the plan is dropped).

        A durable caller waits for the ticket: the journal flushes the slot file before it
        syncs the record."""
        assert self.journal is not None
        old = self.index.find(plan.key)
        if old != EMPTY and int(self.index.rows["seq"][old]) > plan.seq:
            self.abort_write(plan)  # lost a race to a newer version of the key
            return None
        rec = jr.record(jr.PUT, plan.seq, plan.key, parent=plan.parent, page=plan.offset // PAGE,
                        length=plan.length, pcrc=plan.crc, tenant=plan.tenant)  # fmt: skip
        meta = self.meta.records(plan.key, plan.seq, plan.meta)  # same batch, before the PUT
        try:
            ticket = self.journal.append(meta + jr.pack(rec))
        except StorageIOError:
            self.abort_write(plan)  # the journal failed earlier: the index stays as it was
            raise
        if old != EMPTY:
            # No DEL record: this PUT's higher seq supersedes the old one on replay. The old
            # slot is reused only once this PUT is durable, so replay never points at it.
            self._pending_free.append((self.journal, ticket, *self._slot_of(old)))
            rows = self.index.rows
            plan.replaced = _Row(int(rows["page"][old]), int(rows["length"][old]),
                                 int(rows["seq"][old]), int(rows["crc"][old]),
                                 self.index.parent_of(old), int(rows["tenant"][old]),
                                 int(self.index.tick[old]),
                                 self.meta.packed(plan.key))  # fmt: skip
            self.index.remove(old)
        self.index.insert(plan.key, page=plan.offset // PAGE, length=plan.length, seq=plan.seq,
                          crc=plan.crc, parent=plan.parent, tenant=plan.tenant,
                          tick=self.next_tick())  # fmt: skip
        self.meta.set(plan.key, meta)
        self.counters.bytes_written += plan.length
        self.records_since_checkpoint += 1
        self._unplan(plan)
        return ticket

    def abort_write(self, plan: WritePlan) -> None:
        """Give back a slot that was never committed (no journal record names it)."""
        self.alloc.free(plan.offset, plan.size)
        self._unplan(plan)

    def _unplan(self, plan: WritePlan) -> None:
        left = self._planned[plan.tenant] - plan.size
        if left:
            self._planned[plan.tenant] = left
        else:
            del self._planned[plan.tenant]

    def snapshot(self, row: int) -> tuple[bytes, int, int, int, int]:
        rows = self.index.rows
        return (self.index.key_of(row), int(rows["page"][row]), int(rows["length"][row]),
                int(rows["seq"][row]), int(rows["crc"][row]))  # fmt: skip

    # ------------------------------------------------------------------ coarse operations
    # What the engine calls. Each expects the lock held and holds it again on return; the ones
    # that do I/O release it meanwhile, on a slot set aside or a row pinned beforehand.

    def checkpoint_due(self) -> bool:
        return self.records_since_checkpoint > max(100_000, 2 * len(self.index))


def export_records(cat: SsdCatalog) -> npt.NDArray[np.void]:
    """The index as journal records, tenant names first, then the blocks' META records before
    their PUTs (a checkpoint's body)."""
    rows = cat.index.export()
    recs = np.zeros(len(rows), dtype=jr.RECORD)
    recs["type"] = jr.PUT
    for name in ("key", "parent", "page", "length", "tenant", "seq"):
        recs[name] = rows[name]
    recs["flags"] = rows["flags"]
    recs["pcrc"] = rows["crc"]
    tenants = [jr.record(jr.TENANT, 0, tenant=i, name=n.encode())
               for i, n in enumerate(cat.tenants) if i]  # fmt: skip
    return np.concatenate([*tenants, cat.meta.export(), recs])
