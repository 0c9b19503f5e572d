"""The engine's manager: the key index, lineage and quotas, and what moves between tiers.

It decides; the DRAM tier (`kvstore.dram`) and the SSD tier (`kvstore.ssd`) keep their own
books, and the mover (`kvstore.mover`) carries blocks between them. Every method expects the
engine's lock held; those that may evict can release it while a demotion writes (the entry is
pinned meanwhile), as the comments say.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.errors import CapacityError, InvalidArgumentError, KVOffloadError
from kvoffload.kvstore.admission import FrequencySketch
from kvoffload.kvstore.config import EngineConfig
from kvoffload.kvstore.dram import DramEntry, DramTier
from kvoffload.kvstore.eviction import Rank
from kvoffload.kvstore.extents import slot_bytes
from kvoffload.kvstore.mover import Mover
from kvoffload.kvstore.ssd import SsdIndex, SsdTier

__all__ = ["Manager", "TierListener", "acquire_many", "lookup"]

# listener(kind, key, tier): kind "stored" or "removed", tier "dram" or "ssd".
TierListener = Callable[[str, bytes, str], None]


class Manager:
    """Keys to DRAM entries, chains, per-tenant quotas and counters, over both tiers."""

    def __init__(self, config: EngineConfig, lock: threading.Lock, dram: DramTier) -> None:
        self.config = config
        self.lock = lock
        self.dram = dram
        # The DRAM tier's books, used on every put and get.
        self._alloc, self._policy, self._pinned = dram.alloc, dram.policy, dram.pinned
        self.index: dict[bytes, DramEntry] = {}
        # parent key -> stored children in DRAM; parents need not be stored themselves.
        self._children: dict[bytes, set[bytes]] = {}
        self._tick = 0
        self.closed = False
        self.closing = False  # close() began: new calls fail, in-flight reads finish
        self.closed_event = threading.Event()  # set when close() has finished
        self.quotas: dict[str, int] = {}
        # Per-tenant recency, to evict a tenant's own coldest blocks when it hits its quota.
        self._tenant_recency: dict[str, OrderedDict[bytes, None]] = {}
        self.n = dict.fromkeys(
            ("puts", "gets", "hits", "misses", "deletes", "evictions", "neighbours", "bytes_in",
             "bytes_out", "stored", "demotions", "promotions", "prefetches", "durable",
             "admission_rejected", "ssd_hits", "ssd_misses"),
            0,
        )  # fmt: skip
        self.ssd: SsdTier | None = None
        self.sketch: FrequencySketch | None = None
        self.listener: TierListener | None = None
        self.mover = Mover(self)
        self._evict_cb = self._evict_for_room  # bound once: `claim` runs on every put

    def attach_ssd(self, ssd: SsdTier) -> None:
        self.ssd = self.mover.ssd = ssd
        self.sketch = FrequencySketch()

    def detach_ssd(self) -> None:
        """From now on there is no SSD tier (a closed engine, or a test's simulated crash)."""
        self.ssd = self.mover.ssd = None

    def set_quota(self, tenant: str, quota_bytes: int | None, ssd_bytes: int | None) -> None:
        """See `Engine.set_quota` (called without the lock)."""
        for what, value in (("quota", quota_bytes), ("SSD quota", ssd_bytes)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{what} must not be negative, got {value}")
        with self.lock:
            if ssd_bytes is not None and self.ssd is None:
                raise InvalidArgumentError("an SSD quota needs an SSD tier")
            if quota_bytes is None:
                self.quotas.pop(tenant, None)
            else:
                self.quotas[tenant] = quota_bytes
            if self.ssd is not None:
                self.ssd.set_quota(tenant, ssd_bytes)

    def notify(self, kind: str, key: bytes, tier: str) -> None:
        if self.listener is not None:
            self.listener(kind, key, tier)

    def check_open(self) -> None:
        if self.closed or self.closing:
            raise KVOffloadError("the engine is closed")

    def next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def stored(self, key: bytes) -> bool:
        return key in self.index or (self.ssd is not None and self.ssd.contains(key))

    # ------------------------------------------------------------------ reads

    def acquire(self, key: bytes, fetched: DramEntry | None = None) -> DramEntry | None:
        """Pin and return the DRAM entry of `key`, promoting it from the SSD if need be, or
        `fetched`, the block `Mover.promote_many` read just now (pinned by it), served even if
        the key was deleted or written since (the get began first)."""
        self.check_open()
        self.n["gets"] += 1
        entry = self.index.get(key) if fetched is None else fetched
        if fetched is not None:
            self.n["ssd_hits"] += 1
        elif entry is not None:
            self.n["hits"] += 1
        elif self.ssd is not None:
            entry = self.mover.promote(key)
            self.n["ssd_hits"] += entry is not None
        if entry is None:
            self.n["misses"] += 1
            return None
        self.n["bytes_out"] += entry.length
        if self.sketch is not None:
            self.sketch.add(key)
        entry.pins += 1
        if entry.staging is not None or not entry.live:
            return entry  # not (or no longer) in DRAM's books: nothing to touch
        entry.tick = self.next_tick()
        if entry.key in self._policy:  # not while a demotion writes it out
            self._policy.touch(entry.key)
        self._tenant_recency[entry.tenant].move_to_end(entry.key)
        self._pinned.add(entry.key)
        return entry

    def unpin(self, entry: DramEntry) -> None:
        """`unpin_locked`, taking the lock (called without it)."""
        with self.lock:
            self.unpin_locked(entry)

    def unpin_locked(self, entry: DramEntry) -> None:
        entry.pins -= 1
        if entry.pins:
            return
        if entry.live:
            self._pinned.discard(entry.key)
        elif not self.closed:
            self.dram.free(entry)

    # ------------------------------------------------------------------ writes

    def claim(
        self, key: bytes, length: int, size: int, parent: bytes | None, tenant: str
    ) -> DramEntry:
        """A pinned, unpublished entry on a fresh `size`-byte slot (may evict to make room)."""
        offset = self.dram.reserve(size, self.index, self._evict_cb)
        entry = DramEntry(key, offset, length, size, parent, self.next_tick(), tenant, pins=1)
        self.dram.place(entry)
        return entry

    def reserve(
        self, key: bytes, length: int, parent: bytes | None, tenant: str, meta: bytes | None
    ) -> DramEntry:
        """`claim` a slot for a put within the tenant's quota (called without the lock)."""
        with self.lock:
            self.check_open()
            size = slot_bytes(length)
            self.fit_quota(tenant, key, size)
            entry = self.claim(key, length, size, parent, tenant)
            entry.meta = meta
            if self.sketch is not None:
                self.sketch.add(key)
        return entry

    def commit(self, entry: DramEntry, durable: bool, if_stored: bool | None = None) -> bool:
        """Publish a filled reservation (called without the lock); durable ones go through
        the SSD first."""
        if durable:
            return self.mover.commit_durable(entry)
        with self.lock:
            if self.closed or self.closing:
                # close() began after the reservation: a value published now would be in no
                # tier once it ends (its flush may be over), so the put fails instead.
                self.unpin_locked(entry)
                raise KVOffloadError("the engine is closed")
            if if_stored is not None and self.stored(entry.key) != if_stored:
                self.unpin_locked(entry)  # never published: frees the slot
                return False
            self.publish(entry, put=True)
        return True

    def publish(self, entry: DramEntry, *, put: bool, ssd_seq: int | None = None) -> None:
        """Make a filled entry the key's DRAM value. An SSD copy of an older value goes: for a
        durable put (`ssd_seq`) one older than its own write, for a fast put any copy but one
        that a durable put of the key is still writing (those are newer or overlap it)."""
        key = entry.key
        old = self.index.get(key)
        if old is not None:
            self.drop(old)
        if self.ssd is not None and not entry.on_ssd:
            self.ssd.drop_older(key, ssd_seq)
        entry.live = True
        entry.pins -= 1
        self.index[key] = entry
        if put:
            self.n["puts"] += 1
            self.n["bytes_in"] += entry.length
            self.notify("stored", key, "dram")
        self.n["stored"] += entry.length
        self._policy.insert(key, self.rank(key, entry.parent))
        self._tenant_recency.setdefault(entry.tenant, OrderedDict())[key] = None
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(key)
            self._rerank(entry.parent)
        for child in self._children.get(key, ()):
            self._rerank(child)  # orphans found their parent again
        if entry.pins == 0:
            self._pinned.discard(key)
        else:
            self._pinned.add(key)
        if old is not None and old.pins and entry.tenant in self.quotas:
            # A reader pinned the old value after fit_quota counted it as freed. Last: this
            # may release the lock (demotions), and the index is consistent by now.
            self.fit_quota(entry.tenant, key, 0, strict=False)

    def drop(self, entry: DramEntry) -> None:
        """Take a live entry out of the DRAM index; free its slot unless a view pins it."""
        key = entry.key
        del self.index[key]
        entry.live = False
        self.n["stored"] -= entry.length
        self._policy.remove(key)
        tenant_order = self._tenant_recency[entry.tenant]
        del tenant_order[key]
        if not tenant_order:
            del self._tenant_recency[entry.tenant]
        self._pinned.discard(key)
        if entry.parent is not None:
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.parent]
                self._rerank(entry.parent)
        for child in self._children.get(key, ()):
            self._rerank(child)  # now orphans unless the SSD holds the parent
        if entry.pins == 0:
            self.dram.free(entry)

    # ------------------------------------------------------------------ making room

    def _evict_for_room(self, entry: DramEntry, neighbour: bool) -> None:
        self.n["evictions"] += 1
        self.n["neighbours"] += neighbour
        self._evict(entry)

    def _evict(self, entry: DramEntry) -> None:
        """Make a live, unpinned entry leave DRAM: dropped, or first written to the SSD.

        May release the lock while the SSD write runs; the entry is pinned meanwhile.
        """
        ssd = self.ssd
        if ssd is None or entry.on_ssd:
            self.drop(entry)
            self.notify("removed", entry.key, "dram")
            return
        assert self.sketch is not None
        if self.sketch.estimate(entry.key) < self.config.ssd.admission_min_uses:
            self.n["admission_rejected"] += 1
            self.drop(entry)
            self.notify("removed", entry.key, "dram")
            return
        self.mover.demote(entry, drop=True)

    def fit_quota(self, tenant: str, key: bytes, size: int, *, strict: bool = True) -> None:
        """Evict the tenant's coldest unpinned blocks until `size` more bytes fit its quota.

        With `strict` False, stop quietly when only pinned blocks are left.
        """
        quota = self.quotas.get(tenant)
        if quota is None:
            return
        if size > quota:
            if not strict:
                return
            raise CapacityError(f"a {size}-byte slot exceeds tenant {tenant!r}'s quota of {quota}")
        old = self.index.get(key)
        # The value this put replaces is freed on publish (unless a view pins it); do not evict
        # on its account.
        credit = 0
        if old is not None and old.tenant == tenant and old.pins == 0:
            credit = old.slot
        order = self._tenant_recency.get(tenant, OrderedDict())
        used = self.dram.tenant_used
        while used.get(tenant, 0) - credit + size > quota:
            victim = next((k for k in order if k not in self._pinned and k != key), None)
            if victim is None:
                if not strict:
                    return
                raise CapacityError(
                    f"tenant {tenant!r} is at its quota of {quota} bytes and every block it "
                    "holds is pinned"
                )
            self.n["evictions"] += 1
            self._policy.remove(victim)  # as a policy victim: a demotion may put it back
            self._evict(self.index[victim])

    # ------------------------------------------------------------------ lineage

    def rank(self, key: bytes, parent: bytes | None) -> Rank:
        if parent is not None and not self.stored(parent):
            return Rank.ORPHAN
        return Rank.INTERIOR if self._children.get(key) else Rank.LEAF

    def ssd_rank(self, index: SsdIndex, row: int) -> int:
        """The prefix policy's view of an SSD block, across both tiers."""
        parent = index.parent_of(row)
        if parent is not None and not self.stored(parent):
            return int(Rank.ORPHAN)
        key = index.key_of(row)
        if index.has_child(key) or self._children.get(key):
            return int(Rank.INTERIOR)
        return int(Rank.LEAF)

    def _rerank(self, key: bytes) -> None:
        entry = self.index.get(key)
        if entry is not None:
            self._policy.set_rank(key, self.rank(key, entry.parent))


def lookup(m: Manager, keys: Sequence[bytes], tiers: list[str] | None = None) -> int:
    """Leading keys either tier holds (called unlocked); `tiers` as in `Engine.lookup`."""
    with m.lock:
        m.check_open()
        for n, key in enumerate(keys):
            if not m.stored(key):
                return n
            if tiers is not None:
                tiers.append("dram" if key in m.index else "ssd")
            if m.sketch is not None:
                m.sketch.add(key)
        return len(keys)


def acquire_many(
    m: Manager, keys: Sequence[bytes], ready: Callable[[bytes, DramEntry], bool] | None = None
) -> list[DramEntry | None]:
    """`Manager.acquire` each key (lock held), the SSD-only ones read with their reads in
    flight together (`Mover.promote_many`, which calls `ready`). The batch's DRAM hits are
    pinned first, so the room its SSD reads take cannot evict them."""
    m.check_open()
    got: dict[int, DramEntry | None] = {}
    try:
        for i, key in enumerate(keys):
            if key in m.index:
                got[i] = m.acquire(key)
        rest = [key for i, key in enumerate(keys) if i not in got]
        fetched = m.mover.promote_many(rest, ready) if m.ssd is not None and rest else {}
        ours = list(fetched.values())
        try:
            # A repeated key counts as an SSD hit once, as successive gets would.
            for i, key in enumerate(keys):
                if i not in got:
                    got[i] = m.acquire(key, fetched.pop(key, None))
        finally:
            for entry in ours:
                m.unpin_locked(entry)  # the batch's own pin; the caller's stay
        return [got[i] for i in range(len(keys))]
    except BaseException:
        for held in got.values():  # a get failing part-way leaves no pin behind
            if held is not None:
                m.unpin_locked(held)
        raise
