"""The SSD tier: a preallocated slot file, its compact index, journal, checkpoints and recovery.

Bookkeeping methods run under the engine's lock; `write_slot` and `read_slot` do the I/O and
run without it, on slots the bookkeeping has set aside. Nothing here knows about DRAM.

On disk, in the data directory::

    kvoffload.meta   JSON: format, store id, SSD geometry (checked on every open)
    LOCK             flock'ed while a process has the store open
    ssd.slots        the slot file (unless ssd.path names a file or block device)
    checkpoint       snapshot of the index (PUT and TENANT records) and the seq it covers
    journal.<gen>    changes since: PUT and DEL records, group-committed
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import crc32c
import numpy as np
import numpy.typing as npt

from kvoffload.errors import CapacityError, ConfigError, StorageIOError
from kvoffload.kvstore import faults
from kvoffload.kvstore.config import PAGE, EngineConfig
from kvoffload.kvstore.extents import ExtentAllocator
from kvoffload.kvstore.ssd import journal as jr
from kvoffload.kvstore.ssd.gds import select_slot_file
from kvoffload.kvstore.ssd.index import (
    EMPTY,
    ROW_DTYPE,
    RankFn,
    SsdIndex,
    ssd_slot_bytes,
    ssd_slot_sizes,
)
from kvoffload.kvstore.ssd.slotio import (
    AlignedBuffer,
    SlotFile,
    SlotHeader,
    pack_header,
    unpack_header,
)
from kvoffload.kvstore.stats import TierStats

__all__ = ["META_NAME", "Recovery", "SsdRead", "SsdTier", "SsdWipe", "WritePlan"]

log = logging.getLogger(__name__)

META_NAME = "kvoffload.meta"
# Store 2: slots are extents as large as their block (store 1 cut the file into size-classed
# slabs). A store-1 directory opens as store 2 unchanged: its slots are valid extents.
FORMAT = "kvoffload-store-2"
_LEGACY_FORMATS = {"kvoffload-store-1": ("slab_bytes", "class_growth")}
_QUOTA_BATCH = 64  # rows one pass over the index hands to a tenant over its SSD quota


@dataclass(frozen=True)
class StoreMeta:
    """The store's identity and SSD geometry, fixed when it is created (`kvoffload.meta`)."""

    store_id: str
    capacity_bytes: int
    max_value_bytes: int
    slot_path: str
    created: float
    format: str = FORMAT

    @classmethod
    def load(cls, path: Path) -> StoreMeta:
        """Raises: ConfigError if the file is unreadable or not a store of this format."""
        try:
            raw = json.loads(path.read_text())
            fmt = raw.get("format", FORMAT)
            if fmt != FORMAT and fmt not in _LEGACY_FORMATS:
                raise ConfigError(f"{path}: unknown store format {fmt!r}")
            for legacy in _LEGACY_FORMATS.get(fmt, ()):
                raw.pop(legacy, None)
            meta = cls(**raw)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path} is not a kvoffload store description: {exc}") from exc
        for name in ("capacity_bytes", "max_value_bytes"):
            if not isinstance(getattr(meta, name), int) or getattr(meta, name) <= 0:
                raise ConfigError(f"{path}: {name} must be a positive integer")
        return meta


@dataclass(frozen=True)
class Recovery:
    """What opening the store found (also what `kvoffload fsck` reports)."""

    checkpoint_records: int = 0
    journal_records: int = 0  # PUT and DEL records replayed from journals
    torn_bytes: int = 0  # cut from journal tails
    rejected_rows: int = 0  # rows whose slot lies outside the file or overlaps another
    blocks: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = ()


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


@dataclass
class _Counters:
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # blocks that failed their checksum (served as misses)
    io_errors: int = 0  # device or journal failures
    checkpoints: int = 0


@dataclass(eq=False, slots=True)
class SsdRead:
    """A block being read back (`find_block` .. `finish_read`): its row as it was indexed."""

    row: int
    snap: tuple[bytes, int, int, int, int]  # key, page, length, seq, crc
    parent: bytes | None
    tenant: str

    @property
    def length(self) -> int:
        return self.snap[2]


@dataclass(frozen=True, slots=True)
class SsdWipe:
    """A deleted block's slot, kept out of reuse until its header page is wiped."""

    key: bytes
    journal: jr.Journal
    ticket: int
    offset: int
    size: int


@contextlib.contextmanager
def _doing(what: str) -> Iterator[None]:
    """Report an OSError as a StorageIOError that says what was being done to which file."""
    try:
        yield
    except OSError as exc:
        raise StorageIOError(f"{what}: {exc.strerror or exc}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, what: str) -> None:
    """temp file -> full write -> fsync -> rename -> fsync of the directory. A failure leaves
    the old file as it was and no temp file (a full disk must not fill up further).

    Raises:
        StorageIOError: naming `what` (meta, journal, checkpoint) and the file.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with _doing(f"writing the {what} {tmp}"), open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            faults.check(f"{what}.write")
            os.fsync(fh.fileno())
        with _doing(f"renaming {tmp} to {path.name}"):
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    except StorageIOError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# What a create makes before kvoffload.meta, the last step (LOCK aside).
_CREATE_FILES = frozenset({"ssd.slots", "journal.00000001", "journal.00000001.tmp",
                           META_NAME + ".tmp"})  # fmt: skip


def _create_leftovers(d: Path) -> list[Path] | None:
    """What a create killed before writing kvoffload.meta left in `d` (holding no block: its
    journal has no PUT or DEL), or None if `d` holds anything else."""
    with _doing(f"listing {d}"):
        found = [p for p in d.iterdir() if p.name != "LOCK"]
    if any(p.name not in _CREATE_FILES for p in found):
        return None
    journal = d / "journal.00000001"
    if journal.exists():
        with _doing(f"reading {journal}"):
            records, _ = jr.parse(journal.read_bytes())
        if np.isin(records["type"], (jr.PUT, jr.DEL)).any():
            return None
    return found


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


class SsdTier:
    """Blocks on SSD: who is where (index), how to find room (allocator + eviction), and how
    the index survives crashes (journal + checkpoints)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: RankFn,
        lock: threading.Lock | None = None,
        on_stored: Callable[[bytes], None] = lambda key: None,
        on_removed: Callable[[bytes], None] = lambda key: None,
        read_only: bool = False,
    ) -> None:
        self.config = config
        # The lock every coarse operation expects held (the engine's); released for I/O.
        self._lock = lock or threading.Lock()
        self._rank = rank
        self._on_stored = on_stored
        self._on_removed = on_removed
        # Durable puts between planning their write and publishing, by key: their seqs. A
        # demotion of an older DRAM value of such a key must not commit over them, and a fast
        # put must not delete their copies.
        self._writing: dict[bytes, set[int]] = {}
        self._read_only = read_only
        self.dir = Path(config.data_dir)
        # What creating a new store made, removed again if the create fails (here, or in the
        # engine around the tier: `abandon`). kvoffload.meta is written last.
        self._made: list[Path] = []
        self._creating = False  # this open creates the store
        self.journal: jr.Journal | None = None
        self._open_dir(read_only)
        try:
            self._open(read_only)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Close without a checkpoint, releasing the directory; a store that this open created
        is removed again (the slot file if it was made, else shrunk back)."""
        journal, self.journal = self.journal, None
        if journal is not None:
            with contextlib.suppress(StorageIOError):
                journal.close()
        slots: SlotFile | None = getattr(self, "slots", None)
        if slots is not None:
            slots.discard() if self._creating else slots.close()
        if self._creating:
            self._undo_create()
        self._unlock()

    def _open(self, read_only: bool) -> None:
        ssd, config = self.config.ssd, self.config
        self.meta, creating = self._load_or_create_meta(read_only)
        self.capacity = self.meta.capacity_bytes // PAGE * PAGE
        largest = ssd_slot_bytes(self.meta.max_value_bytes)
        if self.capacity < largest:
            raise ConfigError(f"SSD capacity must hold at least one slot of {largest} bytes")
        self.alloc = ExtentAllocator(self.capacity)
        self.index = SsdIndex(ssd.policy or config.dram.policy)
        self.quotas: dict[int, int] = {}  # tenant id -> SSD slot bytes it may hold
        self.store_id = bytes.fromhex(self.meta.store_id)
        self.max_value_bytes = self.meta.max_value_bytes
        slot_path = self.meta.slot_path or str(self.dir / "ssd.slots")
        self.slots = select_slot_file(
            self.config.ssd.io_backend, slot_path, self.meta.capacity_bytes
        )
        self.tenants: list[str] = [""]
        self._tenant_ids = {"": 0}
        self.seq = 0
        self.tick = 0
        self.pinned: dict[int, int] = {}  # row -> readers in flight
        # Slots freed by a record not yet durable: (journal, ticket, offset, bytes). The journal
        # is kept with its ticket: a checkpoint may switch journals before the slot is queued.
        self._pending_free: list[tuple[jr.Journal, int, int, int]] = []
        self.counters = _Counters()
        self._pages = threading.local()
        self._generation = 0
        self._records_since_checkpoint = 0
        self.recovery = self._recover(read_only)
        if not read_only:
            self._generation += 1
            if creating:
                self._made.append(self._journal_path(self._generation))
            self.journal = self._open_journal(self._generation)
        if creating:
            self._made.append(self.dir / META_NAME)
            _write_atomic(self.dir / META_NAME, json.dumps(asdict(self.meta), indent=2).encode(),
                          "meta")  # fmt: skip

    def _undo_create(self) -> None:
        """Remove what a failed create made, newest first (the data directory last)."""
        for path in reversed(self._made):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s after a failed create: %s", path, exc)
        self._made.clear()

    # ------------------------------------------------------------------ open / recovery

    def _open_dir(self, read_only: bool) -> None:
        d = self.dir
        creating = self._creating = not (d / META_NAME).exists()
        if not d.exists():
            if read_only:
                raise ConfigError(f"data directory {d} does not exist")
            if not d.parent.is_dir():
                raise ConfigError(
                    f"data directory {d} cannot be created: its parent {d.parent} does not exist"
                )
            with _doing(f"creating the data directory {d}"):
                d.mkdir()
            self._made.append(d)
        elif not d.is_dir():
            raise ConfigError(f"data directory {d} is not a directory")
        elif creating and _create_leftovers(d) is None:
            raise ConfigError(
                f"data directory {d} is not empty and holds no {META_NAME}: it is not a "
                "kvoffload store (refusing to write into it)"
            )
        lock = d / "LOCK"
        if creating and not read_only and not lock.exists():
            self._made.append(lock)
        try:
            with _doing(f"opening {lock}"):
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except BaseException:
            self._undo_create()
            raise
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"store {d} is in use by another process") from None
        if creating and (d / META_NAME).exists():
            # Another process created the store while we waited for the lock: it is theirs.
            self._creating = False
            self._made.clear()
        elif creating and not read_only:
            leftovers = _create_leftovers(d) or []
            if leftovers:
                log.warning("%s: removing what an interrupted create left: %s", d,
                            ", ".join(p.name for p in leftovers))  # fmt: skip
            for path in leftovers:
                with _doing(f"removing {path}, left by an interrupted create"):
                    path.unlink()

    def _load_or_create_meta(self, read_only: bool) -> tuple[StoreMeta, bool]:
        """The store's meta and whether the store is new (its meta then still to be written)."""
        ssd = self.config.ssd
        path = self.dir / META_NAME
        max_value = ssd.max_value_bytes or self.config.dram.effective_max_value_bytes
        wanted = StoreMeta(
            store_id=uuid.uuid4().hex,
            capacity_bytes=ssd.capacity_bytes,
            max_value_bytes=max_value,
            slot_path=ssd.path,  # "" = ssd.slots in the store's directory (stays relocatable)
            created=time.time(),
        )
        if not path.exists():
            if read_only or not ssd.capacity_bytes:
                raise ConfigError(f"{self.dir} holds no store and no SSD capacity was given")
            return wanted, True
        meta = StoreMeta.load(path)
        # Opened without a geometry (e.g. by fsck), a store keeps its own.
        checks = ["capacity_bytes"] if ssd.capacity_bytes else []
        checks += ["max_value_bytes"] if ssd.max_value_bytes else []
        checks += ["slot_path"] if ssd.path else []
        for name in checks:
            have, want = getattr(meta, name), getattr(wanted, name)
            if have != want:
                raise ConfigError(
                    f"store {self.dir} was created with {name}={have!r}, the config asks for "
                    f"{want!r}; use the original setting or a new directory"
                )
        if meta.format != FORMAT and not self._read_only:
            meta = dataclasses.replace(meta, format=FORMAT)
            _write_atomic(path, json.dumps(asdict(meta), indent=2).encode(), "meta")
            log.info("%s: store format upgraded to %s", path, FORMAT)
        return meta, False

    def _journal_path(self, generation: int) -> Path:
        return self.dir / f"journal.{generation:08d}"

    def _journal_paths(self) -> list[tuple[int, Path]]:
        found = []
        for p in self.dir.glob("journal.*"):
            suffix = p.name.partition(".")[2]
            if suffix.isdigit():
                found.append((int(suffix), p))
        return sorted(found)

    def _recover(self, read_only: bool) -> Recovery:
        started = time.perf_counter()
        notes: list[str] = []
        parts: list[npt.NDArray[np.void]] = []
        first_gen = 0
        ck_records = 0
        checkpoint = self.dir / "checkpoint"
        if checkpoint.exists():
            replay = jr.read_file(str(checkpoint), self.store_id)
            if len(replay.records) != replay.declared:
                raise StorageIOError(
                    f"{checkpoint} is damaged ({len(replay.records)} of {replay.declared} "
                    "records readable); run `kvoffload fsck --rebuild`"
                )
            parts.append(replay.records)
            first_gen = replay.generation
            ck_records = len(replay.records)
        torn = j_records = 0
        for gen, path in self._journal_paths():
            self._generation = max(self._generation, gen)
            if gen < first_gen:
                continue
            replay = jr.read_file(str(path), self.store_id)
            if replay.dropped_bytes:
                torn += replay.dropped_bytes
                verb = "found" if read_only else "cut"
                notes.append(f"{path.name}: {verb} {replay.dropped_bytes} bytes of torn tail")
                log.warning("%s: %s %d bytes of torn or corrupt tail", path, verb,
                            replay.dropped_bytes)  # fmt: skip
                if not read_only:
                    with _doing(f"cutting the torn tail of {path}"), open(path, "r+b") as fh:
                        fh.truncate(os.path.getsize(path) - replay.dropped_bytes)
            parts.append(replay.records)
            j_records += int(np.isin(replay.records["type"], (jr.PUT, jr.DEL)).sum())
        rejected = self._apply(np.concatenate(parts) if parts else np.zeros(0, jr.RECORD))
        if rejected:
            notes.append(f"{rejected} rows did not fit the slot layout and were dropped")
        self._records_since_checkpoint = j_records
        return Recovery(ck_records, j_records, torn, rejected, len(self.index),
                        time.perf_counter() - started, tuple(notes))  # fmt: skip

    def _apply(self, records: npt.NDArray[np.void]) -> int:
        """Rebuild index and allocator from records: per key, the highest seq wins."""
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
        _, first = np.unique(records["key"][newest], return_index=True)
        winners = newest[first]
        winners = winners[kinds[winners] == jr.PUT]
        winners = winners[np.argsort(records["seq"][winners], kind="stable")]  # oldest first
        return self._install(records[winners])

    def _install(self, final: npt.NDArray[np.void]) -> int:
        """Load PUT records into an empty index and allocator; returns how many were refused."""
        rows = np.zeros(len(final), dtype=ROW_DTYPE)
        for name in ("key", "parent", "page", "length", "tenant", "seq"):
            rows[name] = final[name]
        rows["flags"] = final["flags"]
        rows["crc"] = final["pcrc"]
        ok = restore_slots(self.alloc, rows["page"], rows["length"], self.max_value_bytes)
        self.index.load(rows[ok])
        return int((~ok).sum())

    def _open_journal(self, generation: int) -> jr.Journal:
        """Create journal `generation` atomically (a crash never leaves one without a header),
        then open it for appending."""
        path = self._journal_path(generation)
        head = jr.file_header(self.store_id, generation, self.seq)
        # Tenant names go into every journal so that a journal replays on its own.
        names = [jr.record(jr.TENANT, 0, tenant=i, name=n.encode())
                 for i, n in enumerate(self.tenants) if i]  # fmt: skip
        _write_atomic(path, head + (jr.pack(np.concatenate(names)) if names else b""), "journal")
        return jr.Journal(
            str(path), sync_interval=self.config.ssd.sync_interval_s, before_sync=self.slots.flush
        )

    # ------------------------------------------------------------------ bookkeeping (locked)

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
        if self.index.tenant_bytes.get(tid, 0) + size <= quota:
            return
        target = max(0, quota - size - quota // 64)
        while self.index.tenant_bytes.get(tid, 0) > target:
            victims = self.index.coldest_of_tenant(tid, self.tick, set(self.pinned), _QUOTA_BATCH)
            if not len(victims):
                if self.index.tenant_bytes.get(tid, 0) + size <= quota:
                    return  # the rest is being read, but this write fits
                raise CapacityError(
                    f"tenant {name!r} is at its SSD quota of {quota} bytes and every block it "
                    "holds there is being read"
                )
            for row in victims:
                if self.index.tenant_bytes.get(tid, 0) <= target:
                    break
                self.counters.evictions += 1
                self.remove_row(int(row))

    def _release_pending(self, *, wait: bool = False) -> None:
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
        self._release_pending()
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
                self._release_pending(wait=True)
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
        offset, bytes) for `release_slot`, after the caller has wiped the slot (`wipe_slot`).
        `notify` False skips the removal callback (the caller's own delete)."""
        assert self.journal is not None
        key = self.index.key_of(row)
        offset, size = self._slot_of(row)
        self.seq += 1
        ticket = self.journal.append(jr.pack(jr.record(jr.DEL, self.seq, key)))
        self.index.remove(row)
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
        return True

    def release_slot(self, journal: jr.Journal, ticket: int, offset: int, size: int) -> None:
        self._pending_free.append((journal, ticket, offset, size))

    def wipe_slot(self, offset: int) -> None:
        """Zero a slot's header page (unlocked), so a rebuild from slot headers cannot bring a
        deleted block back.

        Raises:
            StorageIOError: the device failed.
        """
        page = self._header_page()
        page.view[:] = bytes(PAGE)
        self.slots.write(offset, [page.view])

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
        try:
            ticket = self.journal.append(jr.pack(rec))
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
                                 int(self.index.tick[old]))  # fmt: skip
            self.index.remove(old)
        self.index.insert(plan.key, page=plan.offset // PAGE, length=plan.length, seq=plan.seq,
                          crc=plan.crc, parent=plan.parent, tenant=plan.tenant,
                          tick=self.next_tick())  # fmt: skip
        self.counters.bytes_written += plan.length
        self._records_since_checkpoint += 1
        return ticket

    def abort_write(self, plan: WritePlan) -> None:
        """Give back a slot that was never committed (no journal record names it)."""
        self.alloc.free(plan.offset, plan.size)

    # ------------------------------------------------------------------ I/O (unlocked)

    def _header_page(self) -> AlignedBuffer:
        buf: AlignedBuffer | None = getattr(self._pages, "buf", None)
        if buf is None:
            buf = self._pages.buf = AlignedBuffer(PAGE)
        return buf

    def write_slot(self, plan: WritePlan, payload: memoryview) -> None:
        """Write header and value; `payload` is page-aligned and spans whole pages. The slot is
        stable once the journal record that `commit_write` queues for it is.

        Raises:
            StorageIOError: the device failed.
        """
        plan.crc = crc32c.crc32c(payload[: plan.length])
        page = self._header_page()
        page.view[:] = bytes(PAGE)
        pack_header(page.view, SlotHeader(plan.seq, plan.key, plan.parent, plan.length, plan.crc,
                                          plan.tenant, self.tenants[plan.tenant]))  # fmt: skip
        self.slots.write(plan.offset, [page.view, payload])

    def read_slot(self, row_snapshot: tuple[bytes, int, int, int, int], dst: memoryview) -> bool:
        """Read a block into `dst` (page-aligned, whole pages); False if it fails verification.

        `row_snapshot` is (key, page, length, seq, crc) taken under the lock.

        Raises:
            StorageIOError: the device failed.
        """
        key, page_no, length, seq, crc = row_snapshot
        page = self._header_page()
        self.slots.read(page_no * PAGE, [page.view, dst])
        header = unpack_header(page.view)
        if header is None or (header.key, header.seq, header.length) != (key, seq, length):
            return False
        return crc32c.crc32c(dst[:length]) == crc == header.crc

    def snapshot(self, row: int) -> tuple[bytes, int, int, int, int]:
        rows = self.index.rows
        return (self.index.key_of(row), int(rows["page"][row]), int(rows["length"][row]),
                int(rows["seq"][row]), int(rows["crc"][row]))  # fmt: skip

    # ------------------------------------------------------------------ coarse operations
    # What the engine calls. Each expects the lock held and holds it again on return; the ones
    # that do I/O release it meanwhile, on a slot set aside or a row pinned beforehand.

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def contains(self, key: bytes) -> bool:
        return self.index.find(key) != EMPTY

    def length_of(self, key: bytes) -> int | None:
        row = self.index.find(key)
        return None if row == EMPTY else int(self.index.rows["length"][row])

    def seq_of(self, key: bytes) -> int:
        """The seq of the key's SSD copy; -1 if there is none."""
        row = self.index.find(key)
        return int(self.index.rows["seq"][row]) if row != EMPTY else -1

    def drop_older(self, key: bytes, seq: int | None) -> None:
        """A new value of `key` was published in DRAM: an SSD copy of an older value goes. For
        a durable put (`seq` of its own write) a copy older than that write; for a fast put
        (None) any copy but one that a durable put of the key is still writing (those are
        newer or overlap it)."""
        row = self.index.find(key)
        if row == EMPTY:
            return
        row_seq = int(self.index.rows["seq"][row])
        if row_seq < seq if seq is not None else row_seq not in self._writing.get(key, ()):
            self.remove_row(row)

    def write_through(
        self, key: bytes, length: int, parent: bytes | None, tenant: str, payload: memoryview
    ) -> int:
        """Write a block and wait until it and its journal record are durable; returns the
        write's seq, registered as in flight until `write_through_done`. Releases the lock for
        the write and the wait.

        Raises:
            CapacityError: no slot could be freed.
            StorageIOError: the device or the journal failed; the key keeps its old copy.
        """
        plan = self.plan_write(key, length, parent, tenant)
        self._writing.setdefault(key, set()).add(plan.seq)
        try:
            with self._unlocked():
                self.write_slot(plan, payload)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.abort_write(plan)
            self.counters.io_errors += 1
            raise
        try:
            ticket = self.commit_write(plan)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.counters.io_errors += 1
            raise
        journal = self.journal
        assert journal is not None
        if ticket is not None:
            self._on_stored(key)
        try:
            with self._unlocked():
                # None: a newer version of the key won the race; its record is queued already.
                journal.wait(ticket)
        except StorageIOError:
            self.write_through_done(key, plan.seq)
            self.counters.io_errors += 1
            # The journal is dead: no DEL record can be written; the key keeps its old copy.
            if self.undo_commit(plan):
                self._on_stored(key)
            raise
        return plan.seq

    def write_through_done(self, key: bytes, seq: int) -> None:
        """The durable put that wrote `seq` has published (or failed)."""
        seqs = self._writing[key]
        seqs.discard(seq)
        if not seqs:
            del self._writing[key]

    def demote(self, plan: WritePlan, payload: memoryview, keep: Callable[[], bool]) -> bool:
        """Write a planned block from DRAM (pinned by the caller) and commit it unless it
        failed, `keep()` no longer holds, or a durable put of the key is writing a newer copy,
        which ours must not replace. True if committed. Releases the lock for the write."""
        key = plan.key
        try:
            with self._unlocked():
                self.write_slot(plan, payload)
            failed = False
        except StorageIOError as exc:
            log.error("demotion of block %s failed: %s", key.hex(), exc)
            failed = True
        if failed or not keep() or key in self._writing:
            self.abort_write(plan)
            self.counters.io_errors += failed
            return False
        try:
            committed = self.commit_write(plan) is not None
        except StorageIOError as exc:  # the journal failed: the block is only in DRAM
            log.error("demotion of block %s failed: %s", key.hex(), exc)
            self.counters.io_errors += 1
            return False
        if committed:
            self._on_stored(key)
        return committed

    def find_block(self, key: bytes) -> SsdRead | None:
        """The key's block as indexed now, to read back; None if the SSD does not hold it."""
        row = self.index.find(key)
        if row == EMPTY:
            return None
        tenant = self.tenants[int(self.index.rows["tenant"][row])]
        return SsdRead(row, self.snapshot(row), self.index.parent_of(row), tenant)

    def pin(self, read: SsdRead) -> None:
        """Keep the block's slot from eviction until `unpin`."""
        self.pinned[read.row] = self.pinned.get(read.row, 0) + 1

    def unpin(self, read: SsdRead) -> None:
        left = self.pinned.pop(read.row) - 1
        if left:
            self.pinned[read.row] = left

    def read_into(self, read: SsdRead, dst: memoryview) -> bool | None:
        """Read a pinned block into `dst` (page-aligned, whole pages): whether it verified, or
        None if the device failed. Releases the lock for the read."""
        try:
            with self._unlocked():
                return self.read_slot(read.snap, dst)
        except StorageIOError as exc:
            log.error("reading block %s from the SSD failed: %s", read.snap[0].hex(), exc)
            return None

    def finish_read(self, read: SsdRead, ok: bool | None) -> bool | None:
        """Account for a `read_into` that returned `ok` (the block unpinned by now): None if
        the read failed, else whether the block is still the key's indexed copy. A block that
        failed verification while still indexed as read is corrupt and is dropped; one that
        was deleted or replaced meanwhile may hold another block by now: a miss, not damage."""
        current = self.index.find(read.snap[0])
        same = current == read.row and self.snapshot(current) == read.snap
        if not ok:
            if ok is None:
                self.counters.io_errors += 1
            elif same:
                self.counters.corrupt += 1
                log.warning("SSD block %s failed its checksum; dropped, served as a miss",
                            read.snap[0].hex())  # fmt: skip
                self.remove_row(read.row)
            return None
        self.counters.bytes_read += read.length
        return same

    def touch(self, read: SsdRead) -> None:
        """The block was read back into DRAM: it is recently used."""
        self.index.touch(read.row, self.next_tick())

    def detach(self, key: bytes) -> SsdWipe | None:
        """Delete `key`'s block from the index (no removal callback: the caller's own delete);
        its slot stays out of reuse until `wipe`. None if the SSD does not hold it."""
        row = self.index.find(key)
        if row == EMPTY:
            return None
        return SsdWipe(key, *self.detach_row(row, notify=False))

    def wipe(self, wipe: SsdWipe) -> None:
        """Zero a detached block's header page, then let its slot be reused. Called without
        the lock; takes it for the last step."""
        try:
            self.wipe_slot(wipe.offset)
        except StorageIOError as exc:
            # Still deleted from the index; only a rebuild from slot headers could revive it.
            log.error("could not wipe the slot of deleted block %s: %s", wipe.key.hex(), exc)
        with self._lock:
            self.release_slot(wipe.journal, wipe.ticket, wipe.offset, wipe.size)

    def checkpoint_if_due(self) -> None:
        """Checkpoint once the journal has grown enough; the slow part runs on a thread."""
        if not self.checkpoint_due():
            return
        try:
            finish = self.begin_checkpoint()
        except StorageIOError as exc:  # no new journal (disk full?): keep the current one
            log.error("checkpoint failed: %s", exc)
            self.counters.io_errors += 1
            return

        def run() -> None:
            try:
                finish()
            except StorageIOError as exc:  # the old checkpoint and the journals still replay
                log.error("checkpoint failed: %s", exc)
                with self._lock:
                    self.counters.io_errors += 1

        threading.Thread(target=run, name="kvoffload-checkpoint", daemon=True).start()

    def stats(self, n: dict[str, int]) -> TierStats:
        """This tier's counters; `n` holds the engine's (hits, misses, moves between tiers)."""
        c = self.counters
        return TierStats(
            name="ssd",
            capacity_bytes=self.capacity,
            used_bytes=self.used_bytes,
            stored_bytes=self.stored_bytes(),
            entries=len(self.index),
            pinned=len(self.pinned),
            hits=n["ssd_hits"],
            misses=n["misses"],
            evictions=c.evictions,
            bytes_written=c.bytes_written,
            bytes_read=c.bytes_read,
            demotions=n["demotions"],
            promotions=n["promotions"],
            prefetches=n["prefetches"],
            corrupt_blocks=c.corrupt,
            io_errors=c.io_errors,
        )

    def tenant_usage(self) -> dict[str, int]:
        """SSD slot bytes held per tenant name (tenants that hold anything)."""
        return {self.tenants[t]: b for t, b in self.index.tenant_bytes.items()}

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_due(self) -> bool:
        return self._records_since_checkpoint > max(100_000, 2 * len(self.index))

    def begin_checkpoint(self) -> Callable[[], None]:
        """Snapshot the index and switch to a new journal (lock held; a numpy copy).

        Returns the slow part, to run without the lock: flush the old journal, write the
        checkpoint file atomically, delete the journals it covers.
        """
        assert self.journal is not None
        # Pending frees hold tickets of the current journal; settle them before it changes.
        self._release_pending(wait=True)
        old = self.journal
        self._generation += 1
        gen = self._generation
        rows = self.index.export()
        recs = np.zeros(len(rows), dtype=jr.RECORD)
        recs["type"] = jr.PUT
        for name in ("key", "parent", "page", "length", "tenant", "seq"):
            recs[name] = rows[name]
        recs["flags"] = rows["flags"]
        recs["pcrc"] = rows["crc"]
        tenants = [jr.record(jr.TENANT, 0, tenant=i, name=n.encode())
                   for i, n in enumerate(self.tenants) if i]  # fmt: skip
        body = np.concatenate([*tenants, recs]) if tenants else recs
        seq = self.seq
        self.journal = self._open_journal(gen)
        self._records_since_checkpoint = 0

        def finish() -> None:
            old.close()  # the snapshot already holds its records; this only flushes them
            data = jr.file_header(self.store_id, gen, seq, len(body)) + jr.pack(body)
            _write_atomic(self.dir / "checkpoint", data, "checkpoint")
            for g, path in self._journal_paths():
                if g < gen:
                    with _doing(f"removing {path}, which the checkpoint covers"):
                        path.unlink()
            self.counters.checkpoints += 1

        return finish

    def close(self, *, checkpoint: bool = True) -> None:
        """Checkpoint (optionally), flush and close the journal, release the store.

        Raises:
            StorageIOError: the checkpoint or the journal failed; the store is still released.
        """
        try:
            if self.journal is not None:
                try:
                    if checkpoint:
                        self.begin_checkpoint()()
                finally:
                    journal, self.journal = self.journal, None
                    journal.close()
        finally:
            self.slots.close()
            self._unlock()

    def _unlock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    # ------------------------------------------------------------------ stats

    @property
    def used_bytes(self) -> int:
        return self.alloc.used_bytes

    def stored_bytes(self) -> int:
        return int(self.index.rows["length"][self.index.live_rows()].sum())
