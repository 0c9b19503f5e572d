"""The engine facade: index, lineage, eviction, the DRAM arena and the SSD tier behind one lock.

Tiering: new blocks land in DRAM. A block evicted from DRAM is written to the SSD (write-back)
if the admission filter lets it; a block found only on the SSD is read back into DRAM (promoted)
and served from there; `prefetch` does the same ahead of time on background threads. A durable
put writes through to the SSD and waits for its journal record before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType

import numpy as np

from kvoffload.buffers import Bytes, as_readable, as_writable
from kvoffload.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    StorageIOError,
)
from kvoffload.kvstore.admission import FrequencySketch
from kvoffload.kvstore.arena import Arena
from kvoffload.kvstore.config import PAGE, DramConfig, EngineConfig
from kvoffload.kvstore.eviction import Rank, make_policy
from kvoffload.kvstore.extents import ExtentAllocator, slot_bytes
from kvoffload.kvstore.ssd.index import EMPTY, SsdIndex
from kvoffload.kvstore.ssd.journal import Journal
from kvoffload.kvstore.ssd.slotio import AlignedBuffer
from kvoffload.kvstore.ssd.tier import META_NAME, Recovery, SsdTier

__all__ = [
    "KEY_BYTES",
    "TierListener",
    "BlockView",
    "Engine",
    "EngineStats",
    "PutReservation",
    "Recovery",
    "TierStats",
]

log = logging.getLogger(__name__)

KEY_BYTES = 16
# listener(kind, key, tier): kind "stored" or "removed", tier "dram" or "ssd".
TierListener = Callable[[str, bytes, str], None]


@dataclass(eq=False, slots=True)
class _Entry:
    key: bytes
    offset: int
    length: int
    slot: int  # bytes of its arena slot (whole pages)
    parent: bytes | None
    tick: int
    tenant: str = ""
    pins: int = 0
    # False once deleted, replaced or evicted; a pinned dead entry keeps its slot until released.
    live: bool = False
    # The SSD holds the same value, so evicting this block from DRAM needs no write.
    on_ssd: bool = False
    durable: bool = False
    # SSD sequence number of a durable put's own write (0 for any other entry).
    seq: int = 0
    # A block read from the SSD while DRAM had no room for it: served from a buffer of its own
    # (offset -1), never published.
    staging: AlignedBuffer | None = None


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
    demotions: int = 0  # blocks written to the next tier down when evicted (DRAM -> SSD)
    promotions: int = 0  # blocks read back up into DRAM (SSD -> DRAM), prefetches included
    prefetches: int = 0  # promotions started by prefetch
    corrupt_blocks: int = 0  # blocks that failed their checksum here (served as misses)
    io_errors: int = 0  # device or journal failures


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
    # Evictions of blocks next to a victim, to widen its hole until a larger value fits.
    neighbour_evictions: int
    tiers: tuple[TierStats, ...] = field(default_factory=tuple)
    # DRAM slot bytes held per tenant (all tenants that hold anything or have a quota).
    tenant_bytes: dict[str, int] = field(default_factory=dict)
    # SSD slot bytes held per tenant (tenants that hold anything there).
    ssd_tenant_bytes: dict[str, int] = field(default_factory=dict)
    durable_puts: int = 0
    admission_rejected: int = 0  # DRAM evictions the admission filter kept off the SSD
    checkpoints: int = 0
    recovery: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class PutReservation:
    """A claimed, not yet visible slot; see `Engine.reserve`."""

    __slots__ = ("_durable", "_engine", "_entry", "array", "buffer")

    def __init__(self, engine: Engine, entry: _Entry, durable: bool) -> None:
        self._engine: Engine | None = engine
        self._entry = entry
        self._durable = durable
        end = entry.offset + entry.length
        # Writable views of exactly the value's bytes (the slot may be larger).
        self.array: Bytes = engine._arena.array[entry.offset : end]
        self.buffer: memoryview = engine._arena.view[entry.offset : end]

    def __len__(self) -> int:
        return self._entry.length

    def commit(self, *, if_stored: bool | None = None) -> bool:
        """Publish the value under its key, replacing any older value.

        A durable reservation first writes the value to the SSD and waits for its journal
        record; if that fails the put fails and the key keeps its old value.

        `if_stored` (not for durable reservations): publish only if some tier holds the key
        (True) or none does (False), checked atomically with the publish, so that no other
        commit or delete of the key lands in between. Returns False, with the slot given back,
        when that does not hold; True when the value was published.

        Raises:
            StorageIOError: a durable write failed (EIO, ENOSPC, journal failure).
            CapacityError: no SSD slot could be freed for a durable write.
            InvalidArgumentError: `if_stored` with a durable reservation.
        """
        if if_stored is not None and self._durable:
            raise InvalidArgumentError("a durable put cannot be conditional")
        engine = self._finish()
        return engine._commit(self._entry, self._durable, if_stored)

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
    """A KV block store: opaque values under 16-byte keys, in a DRAM arena and (optionally) an
    SSD tier that survives restarts and crashes.

    Thread-safe: one lock guards indexes, policies and allocators. Value bytes move outside it
    (copies, SSD reads and writes) on slots that are pinned meanwhile, so work on several
    threads overlaps. A miss is None/False, never an exception.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        dram = self.config.dram
        if dram.slab_bytes or dram.class_growth != DramConfig.class_growth:
            log.warning("dram.slab_bytes and dram.class_growth are no longer used: ignored")
        self._alloc = ExtentAllocator(dram.capacity_bytes)
        self._lock = threading.Lock()
        self._index: dict[bytes, _Entry] = {}
        # parent key -> stored children in DRAM; parents need not be stored themselves.
        self._children: dict[bytes, set[bytes]] = {}
        self._pinned: set[bytes] = set()
        self._policy = make_policy(dram.policy)
        # Every entry that holds an arena slot (live, or dead and still pinned), by its slot's
        # start and end: the neighbours of a hole are found here.
        self._slots: dict[int, _Entry] = {}
        self._slot_ends: dict[int, _Entry] = {}
        self._last_hole = (0, 0)  # the free extent the last freed slot became part of
        # Durable puts between planning their SSD write and publishing, by key: their SSD seqs.
        # A demotion of an older DRAM value of such a key must not commit over them, and a fast
        # put must not delete their SSD copies.
        self._writing_through: dict[bytes, set[int]] = {}
        self._tick = 0
        self._closed = False
        self._quotas: dict[str, int] = {}
        self._tenant_used: dict[str, int] = {}
        # Per-tenant recency, to evict a tenant's own coldest blocks when it hits its quota.
        self._tenant_recency: dict[str, OrderedDict[bytes, None]] = {}
        self._n = dict.fromkeys(
            ("puts", "gets", "hits", "misses", "deletes", "evictions", "neighbours", "bytes_in",
             "bytes_out", "stored", "demotions", "promotions", "prefetches", "durable",
             "admission_rejected", "ssd_hits", "ssd_misses", "corrupt", "io_errors"),
            0,
        )  # fmt: skip
        self._ssd: SsdTier | None = None
        self._sketch: FrequencySketch | None = None
        self._inflight: dict[bytes, threading.Event] = {}
        self._queued: set[bytes] = set()  # prefetches submitted, not finished
        self._listener: TierListener | None = None
        self._pool: ThreadPoolExecutor | None = None
        data_dir = self.config.data_dir
        # A data directory that already holds a store is opened with its own geometry.
        if self.config.ssd.capacity_bytes or (data_dir and (Path(data_dir) / META_NAME).exists()):
            self._ssd = SsdTier(self.config, rank=self._ssd_rank, on_removed=self._ssd_removed)
            if self._ssd.max_value_bytes < self.max_value_bytes:
                self._ssd.abandon()  # a store created just now is removed again
                raise ConfigError(
                    f"dram.max_value_bytes ({self.max_value_bytes}) exceeds the store's SSD slot "
                    f"limit ({self._ssd.max_value_bytes}); lower it"
                )
            self._sketch = FrequencySketch()
            self._pool = ThreadPoolExecutor(
                self.config.ssd.io_threads, thread_name_prefix="kvoffload-prefetch"
            )
        try:
            try:
                self._arena = Arena(self._alloc.size, prefault=dram.prefault)
            except OSError as exc:
                raise ConfigError(
                    f"cannot map a DRAM arena of {self._alloc.size} bytes: {exc}; "
                    "lower dram.capacity_bytes"
                ) from exc
        except BaseException:
            if self._ssd is not None:
                self._ssd.abandon()
            raise

    # ------------------------------------------------------------------ public API

    @property
    def max_value_bytes(self) -> int:
        """The largest value `put` accepts."""
        return self.config.dram.effective_max_value_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._arena.size

    @property
    def recovery(self) -> Recovery | None:
        """What opening the SSD tier found (None without an SSD tier)."""
        return self._ssd.recovery if self._ssd is not None else None

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
            durable: return only once the block and its journal record are on stable storage
                (needs the SSD tier). Without it a put returns once the block is in DRAM.
            tenant: whose block this is; a tenant with a quota evicts its own coldest blocks
                to stay within it. Keys are not separated by tenant here: callers that share
                an engine between tenants mix the tenant into the key.

        Raises:
            InvalidArgumentError: bad key or parent, value larger than `max_value_bytes`, a
                durable put without an SSD tier.
            CapacityError: no slot can be freed because every candidate is pinned, or the
                value alone exceeds the tenant's quota.
            StorageIOError: a durable put could not reach stable storage; the key keeps its
                old value.
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
            InvalidArgumentError, CapacityError, StorageIOError: as for `put`.
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
        if durable and self._ssd is None:
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
            size = slot_bytes(length)
            self._fit_quota(tenant, key, size)
            entry = self._claim(key, length, size, parent, tenant)
            if self._sketch is not None:
                self._sketch.add(key)
        return PutReservation(self, entry, durable)

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
        """A pinned read-only view of the value, or None on a miss. Release it when done.

        A block found only on the SSD is first read back into DRAM (and verified).
        """
        _check_key(key)
        with self._lock:
            entry = self._acquire(key)
            if entry is None:
                return None
            data = self._value(entry).toreadonly()
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
            if entry.staging is None:
                dst[: entry.length] = self._arena.array[entry.offset : entry.offset + entry.length]
            else:
                dst[: entry.length] = np.frombuffer(self._value(entry), dtype=np.uint8)
        finally:
            self._unpin(entry)
        return entry.length

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
        """`get_into` for each (key, buffer) pair."""
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        return [self.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]

    def contains(self, key: bytes) -> bool:
        """Whether any tier holds `key`."""
        _check_key(key)
        with self._lock:
            self._check_open()
            return self._stored(key)

    def size_of(self, key: bytes) -> int | None:
        """Length of the stored value, or None on a miss."""
        _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is not None:
                return entry.length
            row = self._ssd.find(key) if self._ssd is not None else EMPTY
            return None if row == EMPTY else int(self._ssd.index.rows["length"][row])  # type: ignore[union-attr]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain are stored in any tier (the usable prefix)."""
        for key in keys:
            _check_key(key)
        with self._lock:
            self._check_open()
            for n, key in enumerate(keys):
                if not self._stored(key):
                    return n
                if self._sketch is not None:
                    self._sketch.add(key)
            return len(keys)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Start reading SSD-only blocks of `keys` into DRAM in the background.

        Reads already in flight (from another prefetch or a get) are not repeated. Returns how
        many of `keys` are stored in either tier.
        """
        for key in keys:
            _check_key(key)
        found = 0
        with self._lock:
            self._check_open()
            todo = []
            for key in keys:
                if key in self._index:
                    found += 1
                elif self._ssd is not None and self._ssd.find(key) != EMPTY:
                    found += 1
                    if key not in self._inflight and key not in self._queued:
                        self._queued.add(key)
                        todo.append(key)
        if self._pool is not None:
            for key in todo:
                self._pool.submit(self._prefetch_one, key)
        return found

    def delete(self, key: bytes) -> bool:
        """Remove `key` from every tier; True if it was stored. A pinned view stays valid."""
        _check_key(key)
        wipe: tuple[Journal, int, int, int] | None = None
        with self._lock:
            self._check_open()
            found = False
            entry = self._index.get(key)
            if entry is not None:
                self._drop(entry)
                found = True
            ssd = self._ssd
            if ssd is not None:
                row = ssd.find(key)
                if row != EMPTY:
                    wipe = ssd.detach_row(row, notify=False)
                    found = True
            self._n["deletes"] += found
        if ssd is not None and wipe is not None:
            try:
                ssd.wipe_slot(wipe[2])
            except StorageIOError as exc:
                # Still deleted from the index; only a rebuild from slot headers could revive it.
                log.error("could not wipe the slot of deleted block %s: %s", key.hex(), exc)
            with self._lock:
                ssd.release_slot(*wipe)
        return found

    def set_quota(
        self, tenant: str, quota_bytes: int | None, *, ssd_bytes: int | None = None
    ) -> None:
        """Limit the DRAM slot bytes `tenant` may hold, and with `ssd_bytes` its SSD slot bytes
        (None removes a limit; each call sets both).

        A put over the DRAM quota first evicts the tenant's own least recently used blocks
        (which may demote them to the SSD); a write to the SSD over the SSD quota evicts the
        tenant's least recently used SSD blocks, bringing it 1/64 of the quota below it. Lowering
        a quota does not evict at once; the tenant's next writes bring it back under.

        Raises:
            InvalidArgumentError: a negative quota, or an SSD quota without an SSD tier.
        """
        for what, value in (("quota", quota_bytes), ("SSD quota", ssd_bytes)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{what} must not be negative, got {value}")
        with self._lock:
            if ssd_bytes is not None and self._ssd is None:
                raise InvalidArgumentError("an SSD quota needs an SSD tier")
            if quota_bytes is None:
                self._quotas.pop(tenant, None)
            else:
                self._quotas[tenant] = quota_bytes
            if self._ssd is not None:
                self._ssd.set_quota(tenant, ssd_bytes)

    def set_tier_listener(self, listener: TierListener | None) -> None:
        """Call `listener(kind, key, tier)` whenever a block enters or leaves a tier.

        Reported: puts and promotions landing in DRAM ("stored", "dram"), DRAM evictions
        ("removed", "dram"), blocks written to the SSD by demotion or a durable put ("stored",
        "ssd"), and blocks leaving the SSD other than by `delete` ("removed", "ssd"). Not
        reported: the caller's deletes. The listener runs on the thread that made the change
        with the engine lock held, so reports come in the order of the changes: it must be
        quick and must not call the engine.
        """
        with self._lock:
            self._listener = listener

    def _notify(self, kind: str, key: bytes, tier: str) -> None:
        if self._listener is not None:
            self._listener(kind, key, tier)

    def checkpoint(self) -> None:
        """Snapshot the SSD index now (it also happens on its own as the journal grows)."""
        if self._ssd is None:
            return
        with self._lock:
            self._check_open()
            finish = self._ssd.begin_checkpoint()
        finish()

    def stats(self) -> EngineStats:
        n = self._n
        with self._lock:
            tiers = [
                TierStats(
                    name="dram",
                    capacity_bytes=self._arena.size,
                    used_bytes=self._alloc.used_bytes,
                    stored_bytes=n["stored"],
                    entries=len(self._index),
                    pinned=len(self._pinned),
                    hits=n["hits"],
                    misses=n["misses"] + n["ssd_hits"],
                    evictions=n["evictions"],
                    bytes_written=n["bytes_in"],
                    bytes_read=n["bytes_out"],
                    demotions=n["demotions"],
                    promotions=n["promotions"],
                    prefetches=n["prefetches"],
                )
            ]
            ssd = self._ssd
            if ssd is not None:
                c = ssd.counters
                tiers.append(
                    TierStats(
                        name="ssd",
                        capacity_bytes=ssd.capacity,
                        used_bytes=ssd.used_bytes,
                        stored_bytes=ssd.stored_bytes(),
                        entries=len(ssd.index),
                        pinned=len(ssd.pinned),
                        hits=n["ssd_hits"],
                        misses=n["misses"],
                        evictions=c.evictions,
                        bytes_written=c.bytes_written,
                        bytes_read=c.bytes_read,
                        demotions=n["demotions"],
                        promotions=n["promotions"],
                        prefetches=n["prefetches"],
                        corrupt_blocks=n["corrupt"],
                        io_errors=n["io_errors"],
                    )
                )
            return EngineStats(
                policy=self.config.dram.policy,
                puts=n["puts"],
                gets=n["gets"],
                hits=n["hits"] + n["ssd_hits"],
                misses=n["misses"],
                deletes=n["deletes"],
                evictions=n["evictions"],
                neighbour_evictions=n["neighbours"],
                tiers=tuple(tiers),
                tenant_bytes={
                    t: self._tenant_used.get(t, 0)
                    for t in self._tenant_used.keys() | self._quotas.keys()
                },
                ssd_tenant_bytes=(
                    {ssd.tenants[t]: b for t, b in ssd.index.tenant_bytes.items()}
                    if ssd is not None
                    else {}
                ),
                durable_puts=n["durable"],
                admission_rejected=n["admission_rejected"],
                checkpoints=ssd.counters.checkpoints if ssd is not None else 0,
                recovery=asdict(ssd.recovery) if ssd is not None else {},
            )

    def close(self) -> None:
        """Stop background work, write DRAM-only blocks to the SSD (`ssd.flush_on_close`),
        checkpoint the SSD index and unmap the arena. Later calls raise KVOffloadError.

        Raises:
            StorageIOError: the final flush or checkpoint failed (what was acknowledged as
                durable stays durable; the next open replays the journal).
        """
        with self._lock:
            if self._closed:
                return
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            if self._ssd is not None and self.config.ssd.flush_on_close:
                self._flush_to_ssd()
        finally:
            with self._lock:
                self._closed = True
                self._index.clear()
                self._arena.close()
                ssd, self._ssd = self._ssd, None
            if ssd is not None:
                ssd.close()

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

    def _stored(self, key: bytes) -> bool:
        if key in self._index:
            return True
        return self._ssd is not None and self._ssd.find(key) != EMPTY

    def _acquire(self, key: bytes) -> _Entry | None:
        """Pin and return the DRAM entry of `key`, promoting it from the SSD if need be."""
        self._check_open()
        self._n["gets"] += 1
        entry = self._index.get(key)
        if entry is not None:
            self._n["hits"] += 1
        elif self._ssd is not None:
            entry = self._promote(key)
            self._n["ssd_hits"] += entry is not None
        if entry is None:
            self._n["misses"] += 1
            return None
        self._n["bytes_out"] += entry.length
        if self._sketch is not None:
            self._sketch.add(key)
        entry.pins += 1
        if entry.staging is not None:
            return entry  # not in DRAM: nothing to touch
        entry.tick = self._next_tick()
        if entry.key in self._policy:  # not while a demotion writes it out
            self._policy.touch(entry.key)
        self._tenant_recency[entry.tenant].move_to_end(entry.key)
        self._pinned.add(entry.key)
        return entry

    def _value(self, entry: _Entry) -> memoryview:
        if entry.staging is not None:
            return entry.staging.view[: entry.length]
        return self._arena.view[entry.offset : entry.offset + entry.length]

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
        if entry.staging is not None:
            with contextlib.suppress(BufferError):  # a caller's view may outlive the release
                entry.staging.close()
            return
        del self._slots[entry.offset]
        del self._slot_ends[entry.offset + entry.slot]
        self._last_hole = self._alloc.free(entry.offset, entry.slot)
        self._charge(entry, -1)

    def _charge(self, entry: _Entry, sign: int) -> None:
        used = self._tenant_used.get(entry.tenant, 0) + sign * entry.slot
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
            if not strict:
                return
            raise CapacityError(f"a {size}-byte slot exceeds tenant {tenant!r}'s quota of {quota}")
        old = self._index.get(key)
        # The value this put replaces is freed on publish (unless a view pins it); do not evict
        # on its account.
        credit = 0
        if old is not None and old.tenant == tenant and old.pins == 0:
            credit = old.slot
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
            self._n["evictions"] += 1
            self._policy.remove(victim)  # as a policy victim: a demotion may put it back
            self._evict(self._index[victim])

    def _rank(self, key: bytes, parent: bytes | None) -> Rank:
        if parent is not None and not self._stored(parent):
            return Rank.ORPHAN
        return Rank.INTERIOR if self._children.get(key) else Rank.LEAF

    def _ssd_rank(self, index: SsdIndex, row: int) -> int:
        """The prefix policy's view of an SSD block, across both tiers."""
        parent = index.parent_of(row)
        if parent is not None and not self._stored(parent):
            return int(Rank.ORPHAN)
        key = index.key_of(row)
        if index.has_child(key) or self._children.get(key):
            return int(Rank.INTERIOR)
        return int(Rank.LEAF)

    def _ssd_removed(self, key: bytes) -> None:
        entry = self._index.get(key)
        if entry is not None:
            entry.on_ssd = False  # the SSD copy is gone: evicting the DRAM copy must write it
        self._notify("removed", key, "ssd")

    def _rerank(self, key: bytes) -> None:
        entry = self._index.get(key)
        if entry is not None:
            self._policy.set_rank(key, self._rank(key, entry.parent))

    def _commit(self, entry: _Entry, durable: bool, if_stored: bool | None = None) -> bool:
        """Publish a filled reservation; durable ones go through the SSD first."""
        if durable:
            return self._commit_durable(entry)
        with self._lock:
            if if_stored is not None and self._stored(entry.key) != if_stored:
                self._unpin_locked(entry)  # never published: frees the slot
                return False
            self._publish(entry, put=True)
        return True

    def _commit_durable(self, entry: _Entry) -> bool:
        """Write through to the SSD, wait for the journal, then publish in DRAM.

        The SSD decides the order of overlapping durable puts of a key: the highest seq wins in
        both tiers, so what readers see before a crash is what the store holds after it.
        """
        ssd = self._ssd
        assert ssd is not None
        key = entry.key
        try:
            seq = self._write_through(entry)
        except BaseException:
            self._unpin(entry)  # never published: frees the slot
            raise
        with self._lock:
            self._writing_through_done(key, seq)
            self._n["durable"] += 1
            row = ssd.find(key)
            row_seq = int(ssd.index.rows["seq"][row]) if row != EMPTY else -1
            if row_seq > seq:
                # A newer durable put of the key owns the SSD copy: ours comes before it. Until
                # that put publishes, DRAM must not serve anything older than it.
                current = self._index.get(key)
                if current is not None and current.seq != row_seq:
                    self._drop(current)
                    self._notify("removed", key, "dram")
                self._n["puts"] += 1
                self._unpin_locked(entry)
                return True
            entry.on_ssd = entry.durable = row_seq == seq
            entry.seq = seq
            self._publish(entry, put=True, ssd_seq=seq)
        return True

    def _writing_through_done(self, key: bytes, seq: int) -> None:
        seqs = self._writing_through[key]
        seqs.discard(seq)
        if not seqs:
            del self._writing_through[key]

    def _write_through(self, entry: _Entry) -> int:
        """Write a pending entry to the SSD and wait until it and its record are durable;
        returns the SSD sequence number of the write, registered in `_writing_through` (the
        caller takes it out once it has published)."""
        ssd = self._ssd
        assert ssd is not None
        key = entry.key
        with self._lock:
            self._check_open()
            plan = ssd.plan_write(key, entry.length, entry.parent, entry.tenant)
            self._writing_through.setdefault(key, set()).add(plan.seq)
        try:
            ssd.write_slot(plan, self._slot_pages(entry))
        except StorageIOError:
            with self._lock:
                self._writing_through_done(key, plan.seq)
                ssd.abort_write(plan)
                self._n["io_errors"] += 1
            raise
        with self._lock:
            try:
                ticket = ssd.commit_write(plan)
            except StorageIOError:
                self._writing_through_done(key, plan.seq)
                self._n["io_errors"] += 1
                raise
            journal = ssd.journal
            if ticket is not None:
                self._notify("stored", key, "ssd")
        assert journal is not None
        try:
            # None: a newer version of the key won the race; its record is queued already.
            journal.wait(ticket)
        except StorageIOError:
            with self._lock:
                self._writing_through_done(key, plan.seq)
                self._n["io_errors"] += 1
                # The journal is dead: no DEL record can be written; the key keeps its old copy.
                if ssd.undo_commit(plan):
                    self._notify("stored", entry.key, "ssd")
            raise
        return plan.seq

    def _slot_pages(self, entry: _Entry) -> memoryview:
        """The entry's value rounded up to whole pages (its slot is at least that large)."""
        end = entry.offset + -(-entry.length // PAGE) * PAGE
        return self._arena.view[entry.offset : end]

    def _publish(self, entry: _Entry, *, put: bool, ssd_seq: int | None = None) -> None:
        """Make a filled entry the key's DRAM value. An SSD copy of an older value goes: for a
        durable put (`ssd_seq`) one older than its own write, for a fast put any copy but one
        that a durable put of the key is still writing (those are newer or overlap it)."""
        key = entry.key
        old = self._index.get(key)
        if old is not None:
            self._drop(old)
        if self._ssd is not None and not entry.on_ssd:
            row = self._ssd.find(key)
            if row != EMPTY:
                row_seq = int(self._ssd.index.rows["seq"][row])
                if (
                    row_seq < ssd_seq
                    if ssd_seq is not None
                    else row_seq not in self._writing_through.get(key, ())
                ):
                    self._ssd.remove_row(row)  # an older value of this key
        entry.live = True
        entry.pins -= 1
        self._index[key] = entry
        if put:
            self._n["puts"] += 1
            self._n["bytes_in"] += entry.length
            self._notify("stored", key, "dram")
        self._n["stored"] += entry.length
        self._policy.insert(key, self._rank(key, entry.parent))
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
        if old is not None and old.pins and entry.tenant in self._quotas:
            # A reader pinned the old value after _fit_quota counted it as freed. Last: this
            # may release the lock (demotions), and the index is consistent by now.
            self._fit_quota(entry.tenant, key, 0, strict=False)

    def _drop(self, entry: _Entry) -> None:
        """Take a live entry out of the DRAM index; free its slot unless a view pins it."""
        key = entry.key
        del self._index[key]
        entry.live = False
        self._n["stored"] -= entry.length
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
            self._free(entry)

    def _evict(self, entry: _Entry) -> None:
        """Make a live, unpinned entry leave DRAM: dropped, or first written to the SSD.

        May release the lock while the SSD write runs; the entry is pinned meanwhile.
        """
        ssd = self._ssd
        if ssd is None or entry.on_ssd:
            self._drop(entry)
            self._notify("removed", entry.key, "dram")
            return
        assert self._sketch is not None
        if self._sketch.estimate(entry.key) < self.config.ssd.admission_min_uses:
            self._n["admission_rejected"] += 1
            self._drop(entry)
            self._notify("removed", entry.key, "dram")
            return
        self._demote(entry, drop=True)

    def _demote(self, entry: _Entry, *, drop: bool) -> None:
        """Write a DRAM block to the SSD (lock held on entry and exit, released for the I/O)."""
        ssd = self._ssd
        assert ssd is not None
        try:
            plan = ssd.plan_write(entry.key, entry.length, entry.parent, entry.tenant)
        except (CapacityError, StorageIOError) as exc:
            log.warning("cannot demote block %s: %s", entry.key.hex(), exc)
            if drop:
                self._drop(entry)
            return
        entry.pins += 1
        self._pinned.add(entry.key)
        self._lock.release()
        try:
            ssd.write_slot(plan, self._slot_pages(entry))
            failed = False
        except StorageIOError as exc:
            log.error("demotion of block %s failed: %s", entry.key.hex(), exc)
            failed = True
        finally:
            self._lock.acquire()
        if failed or not entry.live or entry.key in self._writing_through:
            # Failed, deleted / overwritten while writing, or a durable put of a newer value
            # is writing its own SSD copy, which ours must not replace.
            ssd.abort_write(plan)
            self._n["io_errors"] += failed
        else:
            try:
                committed = ssd.commit_write(plan) is not None
            except StorageIOError as exc:  # the journal failed: the block is only in DRAM
                log.error("demotion of block %s failed: %s", entry.key.hex(), exc)
                self._n["io_errors"] += 1
                committed = False
            if committed:
                entry.on_ssd = True
                self._n["demotions"] += 1
                self._notify("stored", entry.key, "ssd")
        self._unpin_locked(entry)
        if drop and entry.live:
            if entry.pins:
                # A reader got here first; keep it evictable later (now a clean copy).
                self._policy.insert(entry.key, self._rank(entry.key, entry.parent))
            else:
                self._drop(entry)
                self._notify("removed", entry.key, "dram")
        if ssd.checkpoint_due():
            self._checkpoint_in_background()

    def _checkpoint_in_background(self) -> None:
        assert self._ssd is not None
        try:
            finish = self._ssd.begin_checkpoint()
        except StorageIOError as exc:  # no new journal (disk full?): keep the current one
            log.error("checkpoint failed: %s", exc)
            self._n["io_errors"] += 1
            return

        def run() -> None:
            try:
                finish()
            except StorageIOError as exc:  # the old checkpoint and the journals still replay
                log.error("checkpoint failed: %s", exc)
                with self._lock:
                    self._n["io_errors"] += 1

        threading.Thread(target=run, name="kvoffload-checkpoint", daemon=True).start()

    def _promote(self, key: bytes, *, prefetch: bool = False) -> _Entry | None:
        """Read an SSD-only block into DRAM; the published entry, or None if it is gone or
        fails verification. Lock held on entry and exit, released for the read."""
        ssd = self._ssd
        assert ssd is not None
        while key in self._inflight:
            event = self._inflight[key]
            self._lock.release()
            try:
                event.wait()
            finally:
                self._lock.acquire()
            done = self._index.get(key)
            if done is not None:
                return done
        row = ssd.find(key)
        if row == EMPTY:
            return None
        snap = ssd.snapshot(row)
        tenant = ssd.tenants[int(ssd.index.rows["tenant"][row])]
        parent = ssd.index.parent_of(row)
        length = snap[2]
        if length > self.max_value_bytes:
            return None  # written under a larger DRAM limit; cannot be staged in DRAM
        ssd.pinned[row] = ssd.pinned.get(row, 0) + 1
        event = threading.Event()
        self._inflight[key] = event
        entry: _Entry | None = None
        try:
            size = slot_bytes(length)
            self._fit_quota(tenant, key, size, strict=False)
            try:
                entry = self._claim(key, length, size, parent, tenant)
                entry.seq = snap[3]
                entry.on_ssd = True
                dst = self._slot_pages(entry)
            except CapacityError:
                if prefetch:
                    raise
                # Pinned views hold all of DRAM: serve this get from a buffer of its own.
                entry = _Entry(key, -1, length, 0, parent, 0, tenant, pins=1)
                entry.staging = AlignedBuffer(size)
                dst = entry.staging.view
            self._lock.release()
            try:
                ok = ssd.read_slot(snap, dst)
                io_error = False
            except StorageIOError as exc:
                log.error("reading block %s from the SSD failed: %s", key.hex(), exc)
                ok, io_error = False, True
            finally:
                self._lock.acquire()
        finally:
            left = ssd.pinned.pop(row) - 1
            if left:
                ssd.pinned[row] = left
            del self._inflight[key]
            event.set()
        current = ssd.find(key)
        same = current == row and ssd.snapshot(current) == snap
        if not ok:
            self._unpin_locked(entry)
            if io_error:
                self._n["io_errors"] += 1
            elif same:
                # Deleted or replaced while we read, the slot may hold another block by now:
                # that is a miss, not damage. Only a block still indexed as read is corrupt.
                self._n["corrupt"] += 1
                log.warning("SSD block %s failed its checksum; dropped, served as a miss",
                            key.hex())  # fmt: skip
                ssd.remove_row(row)
            return None
        ssd.counters.bytes_read += length
        if key in self._index or not same:
            self._unpin_locked(entry)  # written or deleted while we read: ours is stale
            return self._index.get(key)
        ssd.index.touch(row, ssd.next_tick())
        if entry.staging is not None:
            entry.pins -= 1  # the caller's `_acquire` pins it
            return entry
        self._n["promotions"] += 1
        self._n["prefetches"] += prefetch
        self._publish(entry, put=False)
        self._notify("stored", key, "dram")
        return entry

    def _prefetch_one(self, key: bytes) -> None:
        try:
            with self._lock:
                if not self._closed and key not in self._index:
                    self._promote(key, prefetch=True)
        except KVOffloadError as exc:  # a background task: report, the get will retry
            log.warning("prefetch of block %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                self._queued.discard(key)

    def _flush_to_ssd(self) -> None:
        """Write every live DRAM block without an SSD copy to the SSD (clean shutdown)."""
        with self._lock:
            for entry in list(self._index.values()):
                if entry.live and not entry.on_ssd:
                    self._demote(entry, drop=False)

    def _claim(
        self, key: bytes, length: int, size: int, parent: bytes | None, tenant: str
    ) -> _Entry:
        """A pinned, unpublished entry on a fresh `size`-byte slot (may evict to make room)."""
        offset = self._reserve(size)
        entry = _Entry(key, offset, length, size, parent, self._next_tick(), tenant, pins=1)
        self._slots[offset] = self._slot_ends[offset + size] = entry
        self._charge(entry, +1)
        return entry

    def _reserve(self, size: int) -> int:
        """Find a free `size`-byte slot, evicting blocks when needed.

        Evicts the policy's victim, then widens the hole it left with the blocks on either side
        (colder first) until the value fits; pinned blocks are never moved or evicted, so this
        fails only when they leave no room. May release the lock while evicted blocks are
        written to the SSD.

        Raises:
            CapacityError: pinned blocks leave no hole of `size` bytes.
        """
        evicted = 0
        while True:
            offset = self._alloc.alloc(size)
            if offset is not None:
                return offset
            # Pinned blocks may leave no hole large enough at all: find out before evicting
            # everything else for nothing (checked only once evictions did not suffice).
            if evicted > 2 * size and not self._room_possible(size):
                victims = None
            else:
                victims = self._policy.evict(1, self._pinned)
            if victims is None:
                raise CapacityError(
                    f"no room for a {size}-byte slot: every block that could make room is "
                    "pinned by an unreleased view"
                )
            victim = self._index[victims[0]]
            self._n["evictions"] += 1
            evicted += victim.slot
            self._evict(victim)
            self._widen(victim.offset, size)

    def _room_possible(self, size: int) -> bool:
        """Whether evicting every unpinned block would leave a hole of `size` bytes."""
        at = 0
        for start in sorted(o for o, e in self._slots.items() if e.pins):
            if start - at >= size:
                return True
            at = start + self._slots[start].slot
        return self._alloc.size - at >= size

    def _widen(self, offset: int, size: int) -> None:
        """Evict the unpinned blocks next to the hole at `offset` (just freed) until it holds
        `size` bytes."""
        while True:
            hole = self._last_hole
            if not (hole[0] <= offset < hole[1] and self._alloc.is_free(*hole)):
                return  # not freed (a reader pinned it), or taken while the lock was released
            if hole[1] - hole[0] >= size:
                return
            sides = (self._slot_ends.get(hole[0]), self._slots.get(hole[1]))
            movable = [
                e for e in sides if e is not None and e.pins == 0 and self._index.get(e.key) is e
            ]
            if not movable:
                return
            entry = min(movable, key=lambda e: e.tick)
            self._policy.remove(entry.key)
            self._n["evictions"] += 1
            self._n["neighbours"] += 1
            self._evict(entry)
