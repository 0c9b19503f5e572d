"""A store's directory: its lock, its description (`kvoffload.meta`), creating it (and undoing
a create that failed), and the journal and checkpoint files that the SSD tier replays.

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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

import kvoffload.kvstore.faults as faults
import kvoffload.kvstore.ssd.journal as jr
from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore.config import EngineConfig

__all__ = ["FORMAT", "META_NAME", "Replay", "StoreDir", "StoreMeta"]

log = logging.getLogger(__name__)

META_NAME = "kvoffload.meta"
# Store 2: slots are extents as large as their block (store 1 cut the file into size-classed
# slabs). A store-1 directory opens as store 2 unchanged: its slots are valid extents.
# Store 3: journals and checkpoints may hold META records (block metadata, journal.py). A store
# 1 or 2 has none, so it is migrated by rewriting its description; code that reads only store
# 2 refuses a store 3 by its format, before it could misread a META record.
FORMAT = "kvoffload-store-3"
_LEGACY_FORMATS = {
    "kvoffload-store-1": ("slab_bytes", "class_growth"),
    "kvoffload-store-2": (),
}


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
                raise ConfigError(
                    f"{path}: unknown store format {fmt!r} (this kvoffload reads {FORMAT} and "
                    f"migrates {', '.join(sorted(_LEGACY_FORMATS))}); a newer kvoffload wrote "
                    "it: open it with that version"
                )
            for legacy in _LEGACY_FORMATS.get(fmt, ()):
                raw.pop(legacy, None)
            meta = cls(**raw)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path} is not a kvoffload store description: {exc}") from exc
        for name in ("capacity_bytes", "max_value_bytes"):
            if not isinstance(getattr(meta, name), int) or getattr(meta, name) <= 0:
                raise ConfigError(f"{path}: {name} must be a positive integer")
        return meta


@dataclass
class Replay:
    """What a store's checkpoint and journals hold (`StoreDir.replay`)."""

    records: npt.NDArray[np.void]
    checkpoint_records: int
    journal_records: int  # PUT and DEL records in journals
    torn_bytes: int  # cut from journal tails
    notes: list[str]
    generation: int  # the newest journal's


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


class StoreDir:
    """The files of one store's directory, held locked from open to `unlock`."""

    def __init__(self, config: EngineConfig, read_only: bool) -> None:
        self.config = config
        self.dir = Path(config.data_dir)
        self.read_only = read_only
        # What creating a new store made, removed again if the create fails (here, or in the
        # engine around the tier: `abandon`). kvoffload.meta is written last.
        self.made: list[Path] = []
        self.creating = False  # this open creates the store
        self._open_dir(read_only)

    def undo_create(self) -> None:
        """Remove what a failed create made, newest first (the data directory last)."""
        for path in reversed(self.made):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s after a failed create: %s", path, exc)
        self.made.clear()

    def _open_dir(self, read_only: bool) -> None:
        """Check the directory (making it for a new store) and take its lock."""
        d = self.dir
        creating = self.creating = not (d / META_NAME).exists()
        if not d.exists():
            if read_only:
                raise ConfigError(f"data directory {d} does not exist")
            if not d.parent.is_dir():
                raise ConfigError(
                    f"data directory {d} cannot be created: its parent {d.parent} does not exist"
                )
            with _doing(f"creating the data directory {d}"):
                d.mkdir()
            self.made.append(d)
        elif not d.is_dir():
            raise ConfigError(f"data directory {d} is not a directory")
        elif creating and _create_leftovers(d) is None:
            raise ConfigError(
                f"data directory {d} is not empty and holds no {META_NAME}: it is not a "
                "kvoffload store (refusing to write into it)"
            )
        lock = d / "LOCK"
        if creating and not read_only and not lock.exists():
            self.made.append(lock)
        try:
            with _doing(f"opening {lock}"):
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except BaseException:
            self.undo_create()
            raise
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"store {d} is in use by another process") from None
        if creating and (d / META_NAME).exists():
            # Another process created the store while we waited for the lock: it is theirs.
            self.creating = False
            self.made.clear()
        elif creating and not read_only:
            leftovers = _create_leftovers(d) or []
            if leftovers:
                log.warning("%s: removing what an interrupted create left: %s", d,
                            ", ".join(p.name for p in leftovers))  # fmt: skip
            for path in leftovers:
                with _doing(f"removing {path}, left by an interrupted create"):
                    path.unlink()

    def load_or_create_meta(self) -> tuple[StoreMeta, bool]:
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
            if self.read_only or not ssd.capacity_bytes:
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
        if meta.format != FORMAT and not self.read_only:
            meta = dataclasses.replace(meta, format=FORMAT)
            _write_atomic(path, json.dumps(asdict(meta), indent=2).encode(), "meta")
            log.info("%s: store format upgraded to %s", path, FORMAT)
        return meta, False

    def write_meta(self, meta: StoreMeta) -> None:
        """Write a new store's description: the last step of a create."""
        self.made.append(self.dir / META_NAME)
        _write_atomic(self.dir / META_NAME, json.dumps(asdict(meta), indent=2).encode(), "meta")

    def journal_path(self, generation: int) -> Path:
        return self.dir / f"journal.{generation:08d}"

    def journal_paths(self) -> list[tuple[int, Path]]:
        found = []
        for p in self.dir.glob("journal.*"):
            suffix = p.name.partition(".")[2]
            if suffix.isdigit():
                found.append((int(suffix), p))
        return sorted(found)

    def replay(self, store_id: bytes) -> Replay:
        """The checkpoint's records and every journal's since, in order; a torn journal tail
        is cut (read-only: only reported).

        Raises:
            StorageIOError: the checkpoint is damaged or a file cannot be read.
        """
        read_only = self.read_only
        notes: list[str] = []
        parts: list[npt.NDArray[np.void]] = []
        first_gen = generation = 0
        ck_records = 0
        checkpoint = self.dir / "checkpoint"
        if checkpoint.exists():
            replay = jr.read_file(str(checkpoint), store_id)
            if len(replay.records) != replay.declared:
                raise StorageIOError(
                    f"{checkpoint} is damaged ({len(replay.records)} of {replay.declared} "
                    "records readable); run `kvoffload fsck --rebuild`"
                )
            parts.append(replay.records)
            first_gen = replay.generation
            ck_records = len(replay.records)
        torn = j_records = 0
        for gen, path in self.journal_paths():
            generation = max(generation, gen)
            if gen < first_gen:
                continue
            replay = jr.read_file(str(path), store_id)
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
        parts = [p for p in parts if len(p)]
        # Most opens after a clean close read a checkpoint and one empty journal: no copy then.
        records = parts[0] if len(parts) == 1 else np.concatenate(parts or [np.zeros(0, jr.RECORD)])
        return Replay(records, ck_records, j_records, torn, notes, generation)

    def open_journal(
        self,
        store_id: bytes,
        generation: int,
        seq: int,
        tenants: list[str],
        before_sync: Callable[[], None],
    ) -> jr.Journal:
        """Create journal `generation` atomically (a crash never leaves one without a header),
        then open it for appending."""
        path = self.journal_path(generation)
        head = jr.file_header(store_id, generation, seq)
        # Tenant names go into every journal so that a journal replays on its own.
        names = [jr.record(jr.TENANT, 0, tenant=i, name=n.encode())
                 for i, n in enumerate(tenants) if i]  # fmt: skip
        _write_atomic(path, head + (jr.pack(np.concatenate(names)) if names else b""), "journal")
        return jr.Journal(
            str(path), sync_interval=self.config.ssd.sync_interval_s, before_sync=before_sync
        )

    def write_checkpoint(
        self, store_id: bytes, generation: int, seq: int, body: npt.NDArray[np.void]
    ) -> None:
        """Write the checkpoint atomically, then delete the journals it covers."""
        data = jr.file_header(store_id, generation, seq, len(body)) + jr.pack(body)
        _write_atomic(self.dir / "checkpoint", data, "checkpoint")
        for g, path in self.journal_paths():
            if g < generation:
                with _doing(f"removing {path}, which the checkpoint covers"):
                    path.unlink()

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
