"""The engine facade: index, lineage, eviction and the DRAM arena behind one lock."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType

from kvoffload.errors import CapacityError, InvalidArgumentError, KVOffloadError
from kvoffload.kvstore.arena import Arena
from kvoffload.kvstore.buffers import Bytes, as_readable, as_writable
from kvoffload.kvstore.config import EngineConfig
from kvoffload.kvstore.eviction import EvictionPolicy, Rank, make_policy
from kvoffload.kvstore.slabs import SizeClasses, SlabAllocator

__all__ = ["KEY_BYTES", "BlockView", "Engine", "EngineStats", "PutReservation", "TierStats"]

log = logging.getLogger(__name__)

KEY_BYTES = 16
# A class steals a slab from another only when that class's coldest block is this many times
# older than its own coldest block; the margin keeps two active classes from trading slabs back
# and forth on every put.
_STEAL_AGE_RATIO = 2


@dataclass(eq=False, slots=True)
class _Entry:
    key: bytes
    offset: int
    length: int
    cls: int
    parent: bytes | None
    tick: int
    tenant: str = ""
    pins: int = 0
    # False once deleted, replaced or evicted; a pinned dead entry keeps its slot until released.
    live: bool = False


@dataclass(frozen=True)
class TierStats:
    """Counters of one storage tier."""

    name: str
    capacity_bytes: int
    used_bytes: int  # bytes of the slots in use (what counts against capacity)
    stored_bytes: int  # bytes of the values in those slots
    entries: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine's counters (taken under its lock)."""

    policy: str
    puts: int
    gets: int
    hits: int
    misses: int
    deletes: int
    evictions: int
    slab_steals: int
    tiers: tuple[TierStats, ...] = field(default_factory=tuple)
    # Slot bytes held per tenant (all tenants that hold anything or have a quota).
    tenant_bytes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class PutReservation:
    """A claimed, not yet visible slot; see `Engine.reserve`."""

    __slots__ = ("_engine", "_entry", "array", "buffer")

    def __init__(self, engine: Engine, entry: _Entry) -> None:
        self._engine: Engine | None = engine
        self._entry = entry
        end = entry.offset + entry.length
        # Writable views of exactly the value's bytes (the slot may be larger).
        self.array: Bytes = engine._arena.array[entry.offset : end]
        self.buffer: memoryview = engine._arena.view[entry.offset : end]

    def __len__(self) -> int:
        return self._entry.length

    def commit(self) -> None:
        """Publish the value under its key, replacing any older value."""
        engine = self._finish()
        with engine._lock:
            engine._publish(self._entry)

    def abort(self) -> None:
        """Give the slot back; the key keeps its old value. Idempotent."""
        if self._engine is not None:
            engine = self._finish()
            engine._unpin(self._entry)  # never published: this frees the slot

    def _finish(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise KVOffloadError("this reservation was already committed or aborted")
        self._engine = None
        self.buffer.release()
        return engine

    def __enter__(self) -> PutReservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class BlockView:
    """A read-only view of a stored value that stays valid until released.

    While the view is held the block is pinned: eviction skips it, and a delete or overwrite
    leaves its bytes in place until `release()`. Use it as a context manager.
    """

    __slots__ = ("_engine", "_entry", "data")

    def __init__(self, engine: Engine, entry: _Entry, data: memoryview) -> None:
        self._engine: Engine | None = engine
        self._entry = entry
        self.data = data

    def __len__(self) -> int:
        return self._entry.length

    def release(self) -> None:
        """Unpin the block; `data` must not be used afterwards. Idempotent."""
        if self._engine is not None:
            self.data.release()
            self._engine._unpin(self._entry)
            self._engine = None

    def __enter__(self) -> BlockView:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _check_key(key: object, what: str = "key") -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise InvalidArgumentError(f"{what} must be {KEY_BYTES} bytes, got {got}")
    return key


class Engine:
    """A KV block store: opaque values under 16-byte keys, in a preallocated DRAM arena.

    Thread-safe: one lock guards the index and the policies; value bytes are copied outside it,
    with the slot pinned, so copies on several threads overlap. A miss is None/False, never an
    exception.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        dram = self.config.dram
        slab = dram.effective_slab_bytes
        n_slabs = dram.capacity_bytes // slab
        self._classes = SizeClasses(dram.effective_max_value_bytes, dram.class_growth)
        self._alloc = SlabAllocator(n_slabs, slab, self._classes)
        self._arena = Arena(n_slabs * slab, prefault=dram.prefault)
        self._lock = threading.Lock()
        self._index: dict[bytes, _Entry] = {}
        # parent key -> stored children; parents need not be stored themselves.
        self._children: dict[bytes, set[bytes]] = {}
        self._pinned: set[bytes] = set()
        self._policies: list[EvictionPolicy] = [
            make_policy(dram.policy) for _ in self._classes.sizes
        ]
        # Per-class recency, used only to decide which class gives up a slab.
        self._recency: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self._classes.sizes]
        self._slab_members: list[set[_Entry]] = [set() for _ in range(n_slabs)]
        self._tick = 0
        self._closed = False
        self._quotas: dict[str, int] = {}
        self._tenant_used: dict[str, int] = {}
        # Per-tenant recency, to evict a tenant's own coldest blocks when it hits its quota.
        self._tenant_recency: dict[str, OrderedDict[bytes, None]] = {}
        self._puts = self._gets = self._hits = self._misses = self._deletes = 0
        self._on_evict: Callable[[bytes, str], None] | None = None
        self._evictions = self._steals = self._bytes_in = self._bytes_out = self._stored = 0

    # ------------------------------------------------------------------ public API

    @property
    def max_value_bytes(self) -> int:
        """The largest value `put` accepts."""
        return self.config.dram.effective_max_value_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._arena.size

    def put(
        self,
        key: bytes,
        value: object,
        *,
        parent: bytes | None = None,
        durable: bool = False,
        tenant: str = "",
    ) -> None:
        """Store `value` (any contiguous buffer) under `key`, replacing an older value.

        Args:
            key: 16 bytes.
            value: bytes-like, numpy array or CPU tensor; copied into the arena.
            parent: the key of the previous block in the same chain, if any; lets the
                prefix-aware policy evict chain tails before their parents.
            durable: return only once the block is on stable storage (needs the SSD tier).
            tenant: whose block this is; a tenant with a quota evicts its own coldest blocks
                to stay within it. Keys are not separated by tenant here: callers that share
                an engine between tenants mix the tenant into the key.

        Raises:
            InvalidArgumentError: bad key or parent, value larger than `max_value_bytes`, a
                durable put without an SSD tier.
            CapacityError: no slot can be freed because every candidate is pinned, or the
                value alone exceeds the tenant's quota.
        """
        self.put_parts(key, (value,), parent=parent, durable=durable, tenant=tenant)

    def put_parts(
        self,
        key: bytes,
        parts: Sequence[object],
        *,
        parent: bytes | None = None,
        durable: bool = False,
        tenant: str = "",
    ) -> None:
        """Store the concatenation of `parts` under `key` without joining them first.

        Raises:
            InvalidArgumentError, CapacityError: as for `put`.
        """
        arrays = [as_readable(p) for p in parts]
        reservation = self.reserve(
            key, sum(a.size for a in arrays), parent=parent, durable=durable, tenant=tenant
        )
        with reservation:
            pos = 0
            for array in arrays:
                reservation.array[pos : pos + array.size] = array
                pos += array.size
            reservation.commit()

    def reserve(
        self,
        key: bytes,
        length: int,
        *,
        parent: bytes | None = None,
        durable: bool = False,
        tenant: str = "",
    ) -> PutReservation:
        """Claim a slot for a `length`-byte value and hand out its memory to fill in place.

        The value becomes visible only at `commit()`; until then readers see the old value
        (or a miss). A reservation that is neither committed nor aborted holds its slot, so use
        it as a context manager: leaving the block without a commit aborts. This lets a
        network front receive payload bytes straight into the arena.

        Raises:
            InvalidArgumentError, CapacityError: as for `put`.
        """
        _check_key(key)
        if parent is not None:
            _check_key(parent, "parent")
        if durable:
            raise InvalidArgumentError(
                "a durable put needs the SSD tier; open the store with an SSD capacity"
            )
        if length < 0:
            raise InvalidArgumentError(f"value length must not be negative, got {length}")
        if length > self.max_value_bytes:
            raise InvalidArgumentError(
                f"value of {length} bytes exceeds the largest slot ({self.max_value_bytes} bytes);"
                " raise dram.max_value_bytes or store smaller blocks"
            )
        with self._lock:
            self._check_open()
            cls = self._classes.class_of(length)
            self._fit_quota(tenant, key, self._classes.sizes[cls])
            offset = self._reserve(cls)
            entry = _Entry(key, offset, length, cls, parent, self._next_tick(), tenant, pins=1)
            self._slab_members[self._alloc.slab_of(offset)].add(entry)
            self._charge(entry, +1)
        return PutReservation(self, entry)

    def put_many(
        self,
        items: Iterable[tuple[bytes, object]],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        """Store several (key, value) pairs, in order; see `put`."""
        for i, (key, value) in enumerate(items):
            self.put(key, value, parent=parents[i] if parents is not None else None)

    def get(self, key: bytes) -> BlockView | None:
        """A pinned read-only view of the value, or None on a miss. Release it when done."""
        _check_key(key)
        with self._lock:
            entry = self._acquire(key)
            if entry is None:
                return None
            data = self._arena.view[entry.offset : entry.offset + entry.length].toreadonly()
        return BlockView(self, entry, data)

    def get_many(self, keys: Sequence[bytes]) -> list[BlockView | None]:
        """`get` for each key."""
        return [self.get(key) for key in keys]

    def get_into(self, key: bytes, buffer: object) -> int | None:
        """Copy the value into `buffer` (bytearray, numpy array, CPU tensor, writable view).

        Returns:
            The number of bytes written, or None on a miss (the buffer is then untouched).

        Raises:
            InvalidArgumentError: the buffer is read-only, not contiguous or too small.
        """
        _check_key(key)
        dst = as_writable(buffer)
        with self._lock:
            entry = self._acquire(key)
            if entry is None:
                return None
            if entry.length > dst.size:
                self._unpin_locked(entry)
                raise InvalidArgumentError(
                    f"buffer of {dst.size} bytes is too small for a {entry.length}-byte value"
                )
        try:
            dst[: entry.length] = self._arena.array[entry.offset : entry.offset + entry.length]
        finally:
            self._unpin(entry)
        return entry.length

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
        """`get_into` for each (key, buffer) pair."""
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        return [self.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]

    def contains(self, key: bytes) -> bool:
        _check_key(key)
        with self._lock:
            self._check_open()
            return key in self._index

    def size_of(self, key: bytes) -> int | None:
        """Length of the stored value, or None on a miss."""
        _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            return None if entry is None else entry.length

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain are stored (the usable prefix length in blocks)."""
        for key in keys:
            _check_key(key)
        with self._lock:
            self._check_open()
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring keys into DRAM ahead of use. With only the DRAM tier every stored key already
        is; returns how many of `keys` are resident."""
        for key in keys:
            _check_key(key)
        with self._lock:
            self._check_open()
            return sum(1 for key in keys if key in self._index)

    def delete(self, key: bytes) -> bool:
        """Remove `key`; True if it was stored. A pinned view of it stays valid."""
        _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None:
                return False
            self._drop(entry)
            self._deletes += 1
            return True

    def set_quota(self, tenant: str, quota_bytes: int | None) -> None:
        """Limit the slot bytes `tenant` may hold (None removes the limit).

        A put over the quota first evicts the tenant's own least recently used blocks. Lowering
        a quota does not evict at once; the tenant's next puts bring it back under.

        Raises:
            InvalidArgumentError: a negative quota.
        """
        if quota_bytes is not None and quota_bytes < 0:
            raise InvalidArgumentError(f"quota must not be negative, got {quota_bytes}")
        with self._lock:
            if quota_bytes is None:
                self._quotas.pop(tenant, None)
            else:
                self._quotas[tenant] = quota_bytes

    def set_evict_listener(self, listener: Callable[[bytes, str], None] | None) -> None:
        """Call `listener(key, tier)` whenever eviction takes a block out of a tier.

        It runs on the thread that made room, with the engine's lock held: it must be quick and
        must not call the engine (the daemon's KV events only append to a queue).
        """
        self._on_evict = listener

    def stats(self) -> EngineStats:
        with self._lock:
            dram = TierStats(
                name="dram",
                capacity_bytes=self._arena.size,
                used_bytes=self._alloc.used_bytes,
                stored_bytes=self._stored,
                entries=len(self._index),
                pinned=len(self._pinned),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                bytes_written=self._bytes_in,
                bytes_read=self._bytes_out,
            )
            return EngineStats(
                policy=self.config.dram.policy,
                puts=self._puts,
                gets=self._gets,
                hits=self._hits,
                misses=self._misses,
                deletes=self._deletes,
                evictions=self._evictions,
                slab_steals=self._steals,
                tiers=(dram,),
                tenant_bytes={
                    t: self._tenant_used.get(t, 0)
                    for t in self._tenant_used.keys() | self._quotas.keys()
                },
            )

    def close(self) -> None:
        """Drop everything and unmap the arena. Later calls raise KVOffloadError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._arena.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _check_open(self) -> None:
        if self._closed:
            raise KVOffloadError("the engine is closed")

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _acquire(self, key: bytes) -> _Entry | None:
        self._check_open()
        self._gets += 1
        entry = self._index.get(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._bytes_out += entry.length
        entry.tick = self._next_tick()
        self._policies[entry.cls].touch(key)
        self._recency[entry.cls].move_to_end(key)
        self._tenant_recency[entry.tenant].move_to_end(key)
        entry.pins += 1
        self._pinned.add(key)
        return entry

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            self._unpin_locked(entry)

    def _unpin_locked(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins:
            return
        if entry.live:
            self._pinned.discard(entry.key)
        elif not self._closed:
            self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self._slab_members[self._alloc.slab_of(entry.offset)].discard(entry)
        self._alloc.free(entry.offset)
        self._charge(entry, -1)

    def _charge(self, entry: _Entry, sign: int) -> None:
        used = self._tenant_used.get(entry.tenant, 0) + sign * self._classes.sizes[entry.cls]
        if used:
            self._tenant_used[entry.tenant] = used
        else:
            self._tenant_used.pop(entry.tenant, None)

    def _fit_quota(self, tenant: str, key: bytes, size: int, *, strict: bool = True) -> None:
        """Evict the tenant's coldest unpinned blocks until `size` more bytes fit its quota.

        With `strict` False, stop quietly when only pinned blocks are left.
        """
        quota = self._quotas.get(tenant)
        if quota is None:
            return
        if size > quota:
            raise CapacityError(f"a {size}-byte slot exceeds tenant {tenant!r}'s quota of {quota}")
        old = self._index.get(key)
        # The value this put replaces is freed on publish (unless a view pins it); do not evict
        # on its account.
        credit = 0
        if old is not None and old.tenant == tenant and old.pins == 0:
            credit = self._classes.sizes[old.cls]
        order = self._tenant_recency.get(tenant, OrderedDict())
        while self._tenant_used.get(tenant, 0) - credit + size > quota:
            victim = next((k for k in order if k not in self._pinned and k != key), None)
            if victim is None:
                if not strict:
                    return
                raise CapacityError(
                    f"tenant {tenant!r} is at its quota of {quota} bytes and every block it "
                    "holds is pinned"
                )
            self._evict(self._index[victim])

    def _rank(self, key: bytes, parent: bytes | None) -> Rank:
        if parent is not None and parent not in self._index:
            return Rank.ORPHAN
        return Rank.INTERIOR if self._children.get(key) else Rank.LEAF

    def _rerank(self, key: bytes) -> None:
        entry = self._index.get(key)
        if entry is not None:
            self._policies[entry.cls].set_rank(key, self._rank(key, entry.parent))

    def _publish(self, entry: _Entry) -> None:
        key = entry.key
        old = self._index.get(key)
        if old is not None:
            self._drop(old)
            if old.pins and entry.tenant in self._quotas:
                # A reader pinned the old value after _fit_quota counted it as freed.
                self._fit_quota(entry.tenant, key, 0, strict=False)
        entry.live = True
        entry.pins -= 1
        self._index[key] = entry
        self._puts += 1
        self._bytes_in += entry.length
        self._stored += entry.length
        self._policies[entry.cls].insert(key, self._rank(key, entry.parent))
        self._recency[entry.cls][key] = None
        self._tenant_recency.setdefault(entry.tenant, OrderedDict())[key] = None
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(key)
            self._rerank(entry.parent)
        for child in self._children.get(key, ()):
            self._rerank(child)  # orphans found their parent again

    def _evict(self, entry: _Entry) -> None:
        self._evictions += 1
        self._drop(entry)
        if self._on_evict is not None:
            self._on_evict(entry.key, "dram")

    def _drop(self, entry: _Entry) -> None:
        """Take a live entry out of the index; free its slot unless a view pins it."""
        key = entry.key
        del self._index[key]
        entry.live = False
        self._stored -= entry.length
        self._policies[entry.cls].remove(key)
        del self._recency[entry.cls][key]
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
            self._rerank(child)  # now orphans
        if entry.pins == 0:
            self._free(entry)

    def _reserve(self, cls: int) -> int:
        """Find a free slot of class `cls`, evicting or reclaiming a slab when needed."""
        while True:
            offset = self._alloc.alloc(cls)
            if offset is not None:
                return offset
            donor = self._donor_slab(cls)
            if donor is not None:
                self._steal(donor)
                continue
            victims = self._policies[cls].evict(1, self._pinned)
            if victims is None:
                donor = self._donor_slab(cls, force=True)
                if donor is None:
                    raise CapacityError(
                        f"no room for a {self._classes.sizes[cls]}-byte slot: every block that "
                        "could make room is pinned by an unreleased view"
                    )
                self._steal(donor)
                continue
            self._evict(self._index[victims[0]])

    def _donor_slab(self, cls: int, *, force: bool = False) -> int | None:
        """A slab of another class worth reclaiming for `cls`, or None to evict within `cls`.

        Another class gives up a slab when its coldest block is much colder than ours (or, with
        `force`, whenever it has a slab with nothing pinned). Which of its slabs: the one holding
        its coldest block, else the least occupied slab without pinned blocks.
        """
        own = self._recency[cls]
        own_age = self._tick - self._index[next(iter(own))].tick if own else None
        best: tuple[int, int] | None = None  # (age, class)
        for other, order in enumerate(self._recency):
            if other == cls or not order:
                continue
            age = self._tick - self._index[next(iter(order))].tick
            if best is None or age > best[0]:
                best = (age, other)
        if best is None:
            return None
        age, other = best
        if not force and own_age is not None and age <= _STEAL_AGE_RATIO * own_age:
            return None
        coldest = self._index[next(iter(self._recency[other]))]
        candidates = sorted(self._alloc.slabs_of(other), key=lambda s: len(self._slab_members[s]))
        candidates.insert(0, self._alloc.slab_of(coldest.offset))
        for slab in candidates:
            if all(member.pins == 0 for member in self._slab_members[slab]):
                return slab
        return None

    def _steal(self, slab: int) -> None:
        members = list(self._slab_members[slab])
        log.debug("reclaiming slab %d: evicting %d blocks", slab, len(members))
        self._steals += 1
        for entry in members:
            self._evict(entry)
