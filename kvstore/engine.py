"""The engine facade: the public API over the manager, the read path, the mover and the tiers.

Tiering: new blocks land in DRAM. A block evicted from DRAM is written to the SSD (write-back)
if the admission filter lets it, by a background writer that keeps free DRAM ahead of the puts
(`dram.demote_low`/`demote_high`); a block found only on the SSD is read back into DRAM (promoted)
and served from there; `prefetch` does the same ahead of time on background threads. A durable
put writes through to the SSD and waits for its journal record before it returns.

Who does what: the manager (`kvstore.manager`) keeps the books (the DRAM index, lineage,
quotas, counters) and decides what moves: it prepares plans and completes them with their
outcome; the mover (`kvstore.mover`) executes them against the tiers and never sees the
manager; the read path (`kvstore.reads`) drives gets, batches and prefetches through both. The
tiers (`kvstore.dram`, `kvstore.ssd.tier`) keep their own books behind one `Tier` protocol
(`kvstore.tier`), fastest first; nothing here asks whether an SSD is there. One lock, the
engine's, guards all of it; value bytes move with it released, on pinned slots.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from kvoffload.buffers import Bytes, as_readable, as_writable
from kvoffload.core import copy_crc32c
from kvoffload.errors import ConfigError, InvalidArgumentError, KVOffloadError, StorageIOError
from kvoffload.kvstore.config import DramConfig, EngineConfig
from kvoffload.kvstore.described import DescribedBlock, DescribedTable, Listing, take_listing
from kvoffload.kvstore.dram import DramEntry, DramTier
from kvoffload.kvstore.manager import EngineStats, Manager, TierListener
from kvoffload.kvstore.mover import Mover
from kvoffload.kvstore.reads import HotHandles, Reads
from kvoffload.kvstore.ssd.recovery import Recovery
from kvoffload.kvstore.ssd.store import META_NAME
from kvoffload.kvstore.ssd.tier import SsdTier
from kvoffload.kvstore.tier import TierStats

__all__ = [
    "KEY_BYTES",
    "MAX_META_BYTES",
    "arena_of",
    "TierListener",
    "BlockView",
    "DescribedBlock",
    "HotHandles",
    "DescribedTable",
    "Engine",
    "EngineStats",
    "PutReservation",
    "Recovery",
    "TierStats",
]

log = logging.getLogger(__name__)

KEY_BYTES = 16
# Block metadata is opaque here; the fronts bound it more tightly (client_sdk.BlockMeta). This
# bound keeps a put's journal records few whatever a caller passes.
MAX_META_BYTES = 4096
HOLD_WINDOW = 16  # `hold_window`, unless the SSD read depth is larger


class PutReservation:
    """A claimed, not yet visible slot; see `Engine.reserve`."""

    __slots__ = ("_durable", "_entry", "_manager", "array", "buffer")

    def __init__(self, manager: Manager, entry: DramEntry, durable: bool, array: Bytes,
                 buffer: memoryview) -> None:  # fmt: skip
        self._manager: Manager | None = manager
        self._entry = entry
        self._durable = durable
        # Writable views of exactly the value's bytes (`Manager.reserve` takes them).
        self.array = array
        self.buffer = buffer

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
            KVOffloadError: the engine closed (or began to) since the slot was reserved.
            StorageIOError: a durable write failed (EIO, ENOSPC, journal failure).
            CapacityError: no SSD slot could be freed for a durable write.
            InvalidArgumentError: `if_stored` with a durable reservation.
        """
        if if_stored is not None and self._durable:
            raise InvalidArgumentError("a durable put cannot be conditional")
        return self._finish().commit(self._entry, self._durable, if_stored)

    def abort(self) -> None:
        """Give the slot back; the key keeps its old value. Idempotent."""
        if self._manager is not None:
            self._finish().unpin(self._entry)  # never published: this frees the slot

    def _finish(self) -> Manager:
        manager = self._manager
        if manager is None:
            raise KVOffloadError("this reservation was already committed or aborted")
        self._manager = None
        self.buffer.release()
        return manager

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

    __slots__ = ("_entry", "_manager", "data")

    def __init__(self, manager: Manager, entry: DramEntry, data: memoryview) -> None:
        self._manager: Manager | None = manager
        self._entry = entry
        self.data = data

    def __len__(self) -> int:
        return self._entry.length

    @property
    def value_crc(self) -> int | None:
        """CRC32C of the whole value, if the engine checked these bytes against it when it
        read the block back from the SSD (None otherwise: sum them to verify)."""
        return self._entry.crc

    def release(self) -> None:
        """Unpin the block; `data` must not be used afterwards. Idempotent."""
        if self._manager is not None:
            self.data.release()
            self._manager.unpin(self._entry)
            self._manager = None

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


def _check_keys(key: bytes, parent: bytes | None) -> None:
    _check_key(key)
    if parent is not None:
        _check_key(parent, "parent")


def _check_meta(meta: object) -> None:
    if meta is not None and (not isinstance(meta, bytes) or len(meta) > MAX_META_BYTES):
        raise InvalidArgumentError(f"block metadata must be bytes of <= {MAX_META_BYTES} bytes")


def _check_length(length: int, max_value_bytes: int) -> None:
    if length < 0:
        raise InvalidArgumentError(f"value length must not be negative, got {length}")
    if length > max_value_bytes:
        raise InvalidArgumentError(
            f"value of {length} bytes exceeds the largest slot ({max_value_bytes} bytes);"
            " raise dram.max_value_bytes or store smaller blocks"
        )


def _open_lower(config: EngineConfig, m: Manager, mover: Mover) -> list[SsdTier]:
    """The tiers below DRAM that the config asks for (the SSD, if any), attached to the
    manager, with the mover's I/O threads started for them."""
    data_dir = config.data_dir
    # A data directory that already holds a store is opened with its own geometry.
    if not (config.ssd.capacity_bytes or (data_dir and (Path(data_dir) / META_NAME).exists())):
        return []
    ssd = SsdTier(config, rank=m.lower_rank, lock=m.lock,
                  on_stored=functools.partial(m.stored_below, SsdTier.name),
                  on_removed=functools.partial(m.removed_below, SsdTier.name))  # fmt: skip
    limit = config.dram.effective_max_value_bytes
    if ssd.max_value_bytes < limit:
        ssd.abandon()  # a store created just now is removed again
        raise ConfigError(
            f"dram.max_value_bytes ({limit}) exceeds the store's SSD slot "
            f"limit ({ssd.max_value_bytes}); lower it"
        )
    m.attach(ssd)
    mover.start(config.ssd.io_threads, config.ssd.read_depth)
    return [ssd]


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
        self._lock = threading.Lock()
        self._dram = DramTier(dram)
        self._mover = mover = Mover()
        self._m = m = Manager(self.config, self._lock, self._dram, mover)
        self._reads = Reads(m, mover)
        self._index = m.index
        lower = _open_lower(self.config, m, mover)  # attached to the manager
        self._pool = mover.pool
        try:
            self._dram.map_arena()
        except BaseException:
            for tier in lower:
                tier.abandon()
            raise
        self._arena = self._dram.arena
        for tier in lower:
            tier.register_memory(self._arena.view)  # for slot I/O that registers memory (NIXL)
        if lower and dram.demote_background:
            m.start_writer()  # last: nothing that can fail comes after it

    @property
    def max_value_bytes(self) -> int:
        """The largest value `put` accepts."""
        return self.config.dram.effective_max_value_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._arena.size

    @property
    def _ssd(self) -> SsdTier | None:
        """The SSD tier, for tests and `bench ssd` that look inside it."""
        return next(iter(self._m.lower), None)

    @_ssd.setter
    def _ssd(self, ssd: None) -> None:
        # Tests and `bench ssd` simulate a crash with None: the engine loses the tier, so
        # every path behaves as without one.
        self._m.detach_lower()

    @property
    def recovery(self) -> Recovery | None:
        """What opening the SSD tier found (None without an SSD tier)."""
        return next((tier.recovery for tier in self._m.lower), None)

    def meta_of(self, key: bytes) -> bytes | None:
        """The metadata the key's value was stored with, or None (a miss, or none given)."""
        _check_key(key)
        with self._lock:
            self._m.check_open()
            holder = self._m.holder(key)
            return None if holder is None else holder.meta_of(key)

    def describe(self, key: bytes) -> tuple[bool, bytes | None, bytes | None]:
        """Whether `key` is stored, with the parent key and the metadata it was stored with
        (what a copy of the block onto another node needs to keep its place in the chain)."""
        _check_key(key)
        with self._lock:
            self._m.check_open()
            entry = self._m.index.lookup(key)
            if entry is not None:
                return True, entry.parent, entry.meta
            for tier in self._m.lower:
                if tier.contains(key):
                    return True, tier.parent_of(key), tier.meta_of(key)
            return False, None, None

    def clear(self) -> int:
        """Delete every stored block (DRAM and below); how many keys were deleted. For a
        cluster node that (re)joins: what it held before may be older than its replicas'."""
        with self._lock:
            self._m.check_open()
            keys = {entry.key for entry in self._m.index.values()}
            for tier in self._m.lower:
                keys.update(tier.keys())
        return sum(self._m.delete(key) for key in keys)

    def described_table(self) -> DescribedTable:
        """Every stored block that has metadata, as arrays: key, tenant, metadata, tiers.

        Read from the indexes alone (no slot is read), so a daemon can announce what a
        restarted store holds. The lock is held only to copy the books (`described_listing`).
        """
        return self.described_listing().table()

    def described_listing(self) -> Listing:
        """The first half of `described_table`: the books copied under the lock. Its `table()`
        is the second half, without the lock (`bench ssd` times the two apart)."""
        with self._lock:
            self._m.check_open()
            return take_listing(self._m)

    def described_blocks(self) -> list[DescribedBlock]:
        """`described_table` as one `DescribedBlock` per block."""
        return self.described_table().blocks()

    @property
    def hold_window(self) -> int:
        """Blocks of a batched get a caller should hold at once: with DRAM all pinned, each
        further SSD block takes a side buffer (see docs/design/architecture.md, the engine)."""
        return max(HOLD_WINDOW, self.config.ssd.read_depth)

    def get_many(self, keys: Sequence[bytes]) -> list[BlockView | None]:
        """`get` for each key. The SSD-only blocks among them are read with up to
        `ssd.read_depth` reads in flight at once (a block already being read for another
        caller is waited for, not read again)."""
        for key in keys:
            _check_key(key)
        with self._lock:
            entries = self._reads.acquire_many(keys)
            return [None if e is None else BlockView(self._m, e, self._dram.value(e).toreadonly())
                    for e in entries]  # fmt: skip

    def get_into(self, key: bytes, buffer: object) -> int | None:
        """Copy the value into `buffer` (bytearray, numpy array, CPU tensor, writable view).

        Returns:
            The number of bytes written, or None on a miss. A miss leaves the buffer
            untouched, except for a block read back from the SSD that fails its checksum
            there: its value is checked as it is copied into the buffer (one pass over the
            bytes), so then the value's length of the buffer is zeroed (never a byte of the
            damaged block); the block is dropped and counted (`ssd.corrupt`). The same zeroing
            happens to a good block deleted in the instant between its check and its
            publication (a miss then too).

        Raises:
            InvalidArgumentError: the buffer is read-only, not contiguous or too small.
        """
        return self.get_many_into([key], [buffer])[0]

    def get_many_into(self, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
        """`get_into` for each (key, buffer) pair; SSD-only blocks are read as for `get_many`,
        each copied out as soon as it is read, while the others are still read, and checked
        against its slot's CRC32C in the same pass, before it is published in DRAM. A miss
        leaves its buffer untouched, or zeroed over the value's length where a damaged SSD
        block was copied (see `get_into`).

        Raises:
            InvalidArgumentError: not one buffer per key, or a buffer read-only, not contiguous
                or too small for its value (buffers of other keys may have been written).
        """
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        for key in keys:
            _check_key(key)
        dsts = [as_writable(b) for b in buffers]
        where: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            where.setdefault(key, []).append(i)
        copied: dict[int, DramEntry] = {}  # what a buffer holds already
        fused: dict[int, DramEntry] = {}  # what a read copied while summing (not published yet)

        def copy(i: int, entry: DramEntry) -> None:
            dsts[i][: entry.length] = np.frombuffer(self._dram.value(entry), dtype=np.uint8)
            copied[i] = entry

        def fuse(key: bytes, entry: DramEntry, crc: int) -> bool | None:
            first = where[key][0]
            dst = dsts[first]
            if entry.length > dst.size:
                return None  # the caller raises for it; the block is checked where it landed
            # Marked copied only once the copy returned: a copy that raises leaves the block
            # to the plain copy below (or its error), never reported with an unwritten buffer.
            same = copy_crc32c(dst.data, self._dram.value(entry)) == crc
            fused[first] = entry
            if same:
                return True
            dst[: entry.length] = 0  # no byte of a damaged block stays in the buffer
            return False

        def ready(key: bytes, entry: DramEntry) -> bool:
            first = where[key][0]  # the one `acquire_many` hands this entry to
            if fused.get(first) is entry:
                copied[first] = entry
                return True
            if entry.length > dsts[first].size:
                return False
            copy(first, entry)
            return True  # not read again: a side buffer it took may go (they are bounded)

        with self._lock:
            m, reads = self._m, self._reads
            if len(keys) > 1:
                entries = reads.acquire_many(keys, ready, fuse)
            else:
                entries = [reads.acquire(keys[0], fuse=fuse)]
        try:
            for entry, dst in zip(entries, dsts, strict=True):
                if entry is not None and entry.length > dst.size:
                    raise InvalidArgumentError(
                        f"buffer of {dst.size} bytes is too small for a {entry.length}-byte value"
                    )
            for i, entry in enumerate(entries):
                if entry is not None and copied.get(i) is not entry:
                    if fused.get(i) is not entry:
                        copy(i, entry)
                elif entry is None and i in fused:
                    # Copied and checked, then deleted before it was published: a miss.
                    dsts[i][: fused[i].length] = 0
        finally:
            with self._lock:
                for entry in entries:
                    if entry is not None:
                        m.unpin_locked(entry)
        return [None if e is None else e.length for e in entries]

    def put(
        self,
        key: bytes,
        value: object,
        *,
        parent: bytes | None = None,
        durable: bool = False,
        tenant: str = "",
        meta: bytes | None = None,
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
            meta: opaque block metadata (at most `MAX_META_BYTES`), kept with the block in
                both tiers and across restarts (`meta_of`, `described_blocks`); a put without
                it drops what an older value of the key had.

        Raises:
            InvalidArgumentError: bad key, parent or metadata, value larger than
                `max_value_bytes`, a durable put without an SSD tier.
            CapacityError: no slot can be freed because every candidate is pinned, or the
                value alone exceeds the tenant's quota.
            StorageIOError: a durable put could not reach stable storage; the key keeps its
                old value.
        """
        self.put_parts(key, (value,), parent=parent, durable=durable, tenant=tenant, meta=meta)

    def put_parts(
        self,
        key: bytes,
        parts: Sequence[object],
        *,
        parent: bytes | None = None,
        durable: bool = False,
        tenant: str = "",
        meta: bytes | None = None,
    ) -> None:
        """Store the concatenation of `parts` under `key` without joining them first.

        Raises:
            InvalidArgumentError, CapacityError, StorageIOError: as for `put`.
        """
        arrays = [as_readable(p) for p in parts]
        reservation = self.reserve(
            key,
            sum(a.size for a in arrays),
            parent=parent,
            durable=durable,
            tenant=tenant,
            meta=meta,
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
        meta: bytes | None = None,
    ) -> PutReservation:
        """Claim a slot for a `length`-byte value and hand out its memory to fill in place.

        The value becomes visible only at `commit()`; until then readers see the old value
        (or a miss). A reservation that is neither committed nor aborted holds its slot, so use
        it as a context manager: leaving the block without a commit aborts. This lets a
        network front receive payload bytes straight into the arena.

        Raises:
            InvalidArgumentError, CapacityError: as for `put`.
        """
        _check_keys(key, parent)
        _check_meta(meta)
        if durable and not self._m.lower:
            raise InvalidArgumentError(
                "a durable put needs the SSD tier; open the store with an SSD capacity"
            )
        _check_length(length, self.max_value_bytes)
        entry, array, buffer = self._m.reserve(key, length, parent, tenant, meta)
        return PutReservation(self._m, entry, durable, array, buffer)

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
            entry = self._reads.acquire(key)
            if entry is None:
                return None
            data = self._dram.value(entry).toreadonly()
        return BlockView(self._m, entry, data)

    def hot_handles(self) -> HotHandles | None:
        """What the daemon's C get path needs to serve DRAM hits as `get` does; None when it
        cannot (see `Reads.hot_handles`)."""
        return self._reads.hot_handles()

    def contains(self, key: bytes) -> bool:
        """Whether any tier holds `key`."""
        _check_key(key)
        with self._lock:
            self._m.check_open()
            return self._m.stored(key)

    def size_of(self, key: bytes) -> int | None:
        """Length of the stored value, or None on a miss."""
        _check_key(key)
        with self._lock:
            self._m.check_open()
            holder = self._m.holder(key)
            return None if holder is None else holder.length_of(key)

    def lookup(self, keys: Sequence[bytes], tiers: list[str] | None = None) -> int:
        """How many leading keys of a chain are stored in any tier (the usable prefix); with
        `tiers`, each run key's tier ("dram", or "ssd" only on the SSD) is appended to it."""
        for key in keys:
            _check_key(key)
        return self._reads.lookup(keys, tiers)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Start reading SSD-only blocks of `keys` into DRAM in the background.

        Reads already in flight (from another prefetch or a get) are not repeated. Returns how
        many of `keys` are stored in either tier.
        """
        for key in keys:
            _check_key(key)
        return self._reads.prefetch(keys)

    def delete(self, key: bytes) -> bool:
        """Remove `key` from every tier; True if it was stored. A pinned view stays valid."""
        _check_key(key)
        return self._m.delete(key)

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
        self._m.set_quota(tenant, quota_bytes, ssd_bytes)

    def set_tier_listener(self, listener: TierListener | None) -> None:
        """Call `listener(kind, key, tier)` whenever a block enters or leaves a tier.

        Reported: puts and promotions landing in DRAM ("stored", "dram"), DRAM evictions
        ("removed", "dram"), blocks written to the SSD by demotion or a durable put ("stored",
        "ssd"), and blocks leaving the SSD other than by `delete` ("removed", "ssd"). Not
        reported: the caller's deletes. The listener runs on the thread that made the change
        with the engine lock held, so reports come in the order of the changes: it must be
        quick and must not call the engine. What it raises is counted (`listener_errors` in
        `stats()`) and logged once, never passed on: the change it reports has happened.
        """
        with self._lock:
            self._m.listener = listener

    def checkpoint(self) -> None:
        """Snapshot the SSD index now (it also happens on its own as the journal grows)."""
        m = self._m
        with self._lock:
            if m.lower:
                m.check_open()
            finishes = [tier.begin_checkpoint() for tier in m.lower]
        for finish in finishes:
            finish()  # the file is written without the lock

    def stats(self) -> EngineStats:
        with self._lock:
            return self._m.snapshot(self.config.dram.policy)

    def close(self) -> None:
        """Stop background work, write DRAM-only blocks to the SSD (`ssd.flush_on_close`),
        checkpoint the SSD index and unmap the arena. Later calls raise KVOffloadError; a close
        racing another returns once that one has finished.

        Raises:
            StorageIOError: the final flush or checkpoint failed (what was acknowledged as
                durable stays durable; the next open replays the journal), or an SSD read hung
                past `ssd.close_wait_s`: closed all the same, its memory leaked
                (docs/design/ssd-tier.md).
        """
        m = self._m
        with self._lock:
            first = m.begin_close()  # calls from now on fail with KVOffloadError
        if not first:  # another close() runs: return once it has flushed and unmapped
            m.closed_event.wait()
            return
        try:
            self._close(self.config.ssd.flush_on_close)
        finally:
            m.closed_event.set()

    def _close(self, flush: bool) -> None:
        m = self._m
        wait_s = self.config.ssd.close_wait_s
        # `closing` is set: no read begins from now on, so those in flight are all to wait for.
        hung = self._reads.wait(time.monotonic() + wait_s)
        # Before the flush: the writer's last pass writes what requests handed it, and the
        # flush then writes the rest (on this thread, nothing evicting beside it).
        m.stop_writer()
        # Without a hung read every task ends at once.
        self._mover.shutdown(wait=not hung)
        try:
            if flush:
                m.flush()
        finally:
            with self._lock:
                lower = m.retire(bool(hung))
            for tier in lower:
                tier.close()
            if not hung:
                # The io_uring rings held the arena exported (registered buffers) until their
                # tier closed just now: unmap it here, not in whichever later call's thread a
                # GC pass happens to free it (256 MiB of unmapping in a stranger's time).
                m.dram.arena.unmap()
        if hung:
            names = ", ".join(key.hex() for key in hung)
            log.error("close: SSD reads of blocks %s still hung after %.1f s; their memory stays "
                      "mapped (leaked)", names, wait_s)  # fmt: skip
            raise StorageIOError(
                f"the SSD did not finish reading blocks {names} within ssd.close_wait_s "
                f"({wait_s} s): the engine is closed, the memory those reads write into is leaked"
            )

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def arena_of(engine: Engine) -> memoryview:
    """The engine's whole DRAM arena, one mapping that never moves: a front that registers
    memory with an RDMA library (NIXL) registers it once and finds every value inside."""
    return engine._arena.view
