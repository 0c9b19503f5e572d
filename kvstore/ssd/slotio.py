"""Slot file I/O for the SSD tier: O_DIRECT vectored reads and writes, and the slot header.

A slot is a 4 KiB header page followed by the value's pages. The header makes every slot
self-describing, so the index can be rebuilt from the device alone (`kvoffload fsck --rebuild`):

====== ===== ===========================================
offset bytes field
====== ===== ===========================================
0      4     CRC32C of bytes 4..127
4      4     magic ``KVSL``
8      2     version (1)
10     2     flags (bit 0: has a parent)
12     2     tenant id
14     2     reserved
16     8     seq (the journal's order of changes)
24     16    key
40     16    parent key
56     8     value length
64     4     CRC32C of the value
68     60    tenant name, NUL-padded
====== ===== ===========================================
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import stat
import struct
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import crc32c

import kvoffload.kvstore.faults as faults
from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore.arena import AlignedBuffer
from kvoffload.kvstore.config import PAGE, format_size
from kvoffload.kvstore.ssd.ringpages import RingPages, thread_header_page

if TYPE_CHECKING:
    from kvoffload.kvstore.ssd.catalog import WritePlan

__all__ = [
    "SLOT_HEADER",
    "AlignedBuffer",
    "BlockIO",
    "Pages",
    "ThreadPages",
    "CuFileIO",
    "SlotFile",
    "SlotHeader",
    "gds_available",
    "pack_header",
    "select_slot_file",
    "unpack_header",
]

log = logging.getLogger(__name__)

_MAGIC = b"KVSL"
_HEADER = struct.Struct("<I4sHHHHQ16s16sQI60s")
SLOT_HEADER = _HEADER.size  # 128
_HAS_PARENT = 1


@dataclass(frozen=True, slots=True)
class SlotHeader:
    seq: int
    key: bytes
    parent: bytes | None
    length: int
    crc: int
    tenant: int
    tenant_name: str


def pack_header(into: memoryview, h: SlotHeader) -> None:
    """Write `h` at the start of `into` (a header page)."""
    body = _HEADER.pack(0, _MAGIC, 1, _HAS_PARENT if h.parent is not None else 0, h.tenant, 0,
                        h.seq, h.key, h.parent or bytes(16), h.length, h.crc,
                        h.tenant_name.encode())  # fmt: skip
    into[:SLOT_HEADER] = body
    into[:4] = crc32c.crc32c(into[4:SLOT_HEADER]).to_bytes(4, "little")


def unpack_header(page: memoryview | bytes) -> SlotHeader | None:
    """The header at the start of `page`, or None if there is no valid one."""
    view = memoryview(page)[:SLOT_HEADER]
    crc, magic, version, flags, tenant, _, seq, key, parent, length, pcrc, name = _HEADER.unpack(
        view
    )
    if magic != _MAGIC or version != 1 or crc != crc32c.crc32c(view[4:]):
        return None
    return SlotHeader(seq, key, parent if flags & _HAS_PARENT else None, length, pcrc, tenant,
                      name.rstrip(b"\x00").decode(errors="replace"))  # fmt: skip


def _advance(buffers: Sequence[memoryview], done: int) -> list[memoryview]:
    """What is left of `buffers` after `done` bytes moved."""
    if len(buffers) == 2 and done == len(buffers[0]) + len(buffers[1]):
        return []  # a slot's header and value in one transfer: the common case, quickly
    out: list[memoryview] = []
    for buf in buffers:
        if done >= len(buf):
            done -= len(buf)
            continue
        out.append(buf[done:])
        done = 0
    return out


class SlotFile:
    """The preallocated file (or block device) that holds the slots.

    Opened with O_DIRECT so block reads and writes bypass the page cache (a cache of KV blocks
    would only duplicate the DRAM tier); falls back to buffered I/O where the file system
    refuses O_DIRECT (tmpfs), with a warning.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        # Another path for the reads and writes (kvikio's cuFile: `select_slot_file`); the
        # descriptor still preallocates and flushes.
        self.device: CuFileIO | None = None
        self.direct = True
        self.created = not os.path.exists(path)  # a failed open removes only a file it made
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise StorageIOError(f"opening SSD slot file {path}: {exc.strerror}") from exc
            log.warning("%s: O_DIRECT refused by the file system; using buffered I/O", path)
            self.direct = False
            try:
                self.fd = os.open(path, flags, 0o644)
            except OSError as exc2:
                raise StorageIOError(f"opening SSD slot file {path}: {exc2.strerror}") from exc2
        self._size_before = 0
        try:
            self._size_before = os.fstat(self.fd).st_size
            if self._size_before < size and not _is_block_device(self.fd):
                # Reserve the blocks now: a full disk fails here, at open, not mid-put.
                os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            self.discard()
            raise StorageIOError(
                f"allocating {format_size(size)} for {path}: {exc.strerror}"
            ) from exc
        # Fault-injection seams: tests replace these, or name a plan in KVOFFLOAD_FAULTS.
        self._preadv = faults.wrap("slot.read", os.preadv)
        self._pwritev = faults.wrap("slot.write", os.pwritev)
        self._fdatasync = faults.wrap("slot.flush", os.fdatasync)

    def discard(self) -> None:
        """Close, and give back what opening took: the file if it made it, else the room it
        grew the file by (a failed store create leaves a given file or device as it was)."""
        with contextlib.suppress(OSError):
            if self.created:
                os.unlink(self.path)
            elif not _is_block_device(self.fd):
                os.ftruncate(self.fd, self._size_before)
        self.close()

    def read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers` (page-aligned, page-multiple) from `offset`.

        Raises:
            StorageIOError: the device failed or the file ended early.
        """
        if self.device is not None:
            self.device.transfer("read", offset, buffers)
            return
        todo = buffers
        while todo:
            try:
                n = self._preadv(self.fd, todo, offset)
            except OSError as exc:
                raise StorageIOError(f"read of {self.path} at {offset} failed: {exc}") from exc
            if n == 0:
                raise StorageIOError(f"{self.path} ended at {offset} inside a slot")
            offset += n
            todo = _advance(todo, n)

    def write(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Write `buffers` (page-aligned, page-multiple) at `offset`. Not yet stable: `flush`
        makes every completed write so.

        Raises:
            StorageIOError: the device failed (EIO, ENOSPC); the slot's old content is gone.
        """
        if self.device is not None:
            self.device.transfer("write", offset, buffers)  # made stable by flush(), as here
            return
        todo = list(buffers)
        while todo:
            try:
                n = self._pwritev(self.fd, todo, offset)
            except OSError as exc:
                raise StorageIOError(f"write to {self.path} at {offset} failed: {exc}") from exc
            offset += n
            todo = _advance(todo, n)

    def flush(self) -> None:
        """Put every write that has completed on stable storage (the device cache flushed, and
        the file system's record of which preallocated blocks hold data).

        Raises:
            StorageIOError: the device failed; which slots are stable is then unknown.
        """
        try:
            self._fdatasync(self.fd)
        except OSError as exc:
            raise StorageIOError(f"flushing {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        if self.device is not None:
            self.device.close()
        os.close(self.fd)


def _is_block_device(fd: int) -> bool:
    return stat.S_ISBLK(os.fstat(fd).st_mode)


class Pages(Protocol):
    """How a `BlockIO` moves pages: a header page to use, and transfers at an offset."""

    engine: str  # what moves them, as stats report it: "io_uring", "threads", "nixl-posix"..

    def header_page(self) -> AbstractContextManager[memoryview]:
        """A page-aligned header page of the caller's own while the context lasts."""
        ...

    def transfer(self, write: bool, offset: int, buffers: Sequence[memoryview]) -> None:
        """Move `buffers` (page-aligned, whole pages) to or from the slot file at `offset`.

        Raises:
            StorageIOError: the device failed.
        """
        ...

    def register_memory(self, view: memoryview) -> None:
        """Memory most transfers use (the DRAM arena); only a backend that registers memory
        with the kernel or a library needs to know."""
        ...

    def close(self) -> None:
        """Stop what the backend runs."""
        ...


class ThreadPages:
    """`Pages` on the calling threads (`ssd.io_backend` "posix", `ssd.io_engine` "threads"):
    each thread has a header page of its own and does the I/O itself."""

    engine = "threads"

    def __init__(self, slots: SlotFile) -> None:
        self.slots = slots
        self._pages = threading.local()

    def register_memory(self, view: memoryview) -> None:
        """Nothing to register: the kernel reads into any page-aligned memory."""

    def close(self) -> None:
        """Nothing runs here: the calling threads do the I/O."""

    def header_page(self) -> AbstractContextManager[memoryview]:
        return thread_header_page(self._pages)

    def transfer(self, write: bool, offset: int, buffers: Sequence[memoryview]) -> None:
        if write:
            self.slots.write(offset, buffers)
        else:
            self.slots.read(offset, buffers)


class BlockIO:
    """Blocks in a slot file: a header page, then the value's pages. Runs without the engine's
    lock, on slots set aside for it. The pages move through `pages`: the calling threads'
    own I/O (`ThreadPages`, the default) or NIXL's (`kvstore.ssd.nixl_io.NixlPages`)."""

    def __init__(self, slots: SlotFile, pages: Pages | None = None) -> None:
        self.slots = slots
        self.pages: Pages = ThreadPages(slots) if pages is None else pages

    @property
    def engine(self) -> str:
        """What moves the pages: "io_uring", "threads", "kvikio", "nixl-posix", "nixl-gds"."""
        return "kvikio" if self.slots.device is not None else self.pages.engine

    def register_memory(self, view: memoryview) -> None:
        """Memory most transfers use (the DRAM arena), for pages that register memory."""
        self.pages.register_memory(view)

    def ring_stats(self) -> dict[str, int]:
        """The io_uring ring pool's gauges and counters, submissions and entries included
        (`RingPages.registration`: one snapshot); empty on any other pages."""
        pages = self.pages
        return pages.registration() if isinstance(pages, RingPages) else {}

    def close(self) -> None:
        """Stop what the pages' backend runs."""
        self.pages.close()

    def write(self, plan: WritePlan, tenant_name: str, payload: memoryview) -> None:
        """Write header and value (sets `plan.crc`); `payload` is page-aligned and spans whole
        pages. The slot is stable once the journal record queued for it is.

        Raises:
            StorageIOError: the device failed.
        """
        plan.crc = crc32c.crc32c(payload[: plan.length])
        pages = self.pages
        with pages.header_page() as page:
            page[:] = bytes(PAGE)
            pack_header(page, SlotHeader(plan.seq, plan.key, plan.parent, plan.length, plan.crc,
                                         plan.tenant, tenant_name))  # fmt: skip
            pages.transfer(True, plan.offset, [page, payload])

    @property
    def write_batch_slots(self) -> int:
        """Slots `write_batch` puts in flight at once: the ring's depth (two entries a slot)
        on io_uring, else 1 (the calling thread writes them one by one)."""
        pages = self.pages
        return max(1, pages.depth // 2) if isinstance(pages, RingPages) else 1

    def write_batch(
        self, writes: Sequence[tuple[WritePlan, str, memoryview]]
    ) -> list[StorageIOError | None]:
        """`write` of each (plan, tenant name, payload), in one submission on the io_uring
        path (two entries a slot: its header page, its value): per slot None if it was
        written whole, else its error (a failed or short entry, logged by the caller). One
        slot's failure does not stop the others'."""
        pages = self.pages
        if not isinstance(pages, RingPages):
            out: list[StorageIOError | None] = []
            for plan, tenant_name, payload in writes:
                try:
                    self.write(plan, tenant_name, payload)
                    out.append(None)
                except StorageIOError as exc:
                    out.append(exc)
            return out
        out = [None] * len(writes)
        with pages.lease() as lease:
            headers = lease.header_pages(len(writes))
            entries: list[tuple[int, memoryview]] = []
            slots: list[tuple[int, list[tuple[int, memoryview]]]] = []  # (index, its entries)
            for i, (plan, tenant_name, payload) in enumerate(writes):
                plan.crc = crc32c.crc32c(payload[: plan.length])
                page = headers[i * PAGE : (i + 1) * PAGE]
                page[:] = bytes(PAGE)
                pack_header(page, SlotHeader(plan.seq, plan.key, plan.parent, plan.length,
                                             plan.crc, plan.tenant, tenant_name))  # fmt: skip
                try:
                    mine = pages.entries(True, plan.offset, [page, payload])
                except StorageIOError as exc:
                    out[i] = exc  # refused before submission; the others still go
                    continue
                slots.append((i, mine))
                entries += mine
            # Every slot's entries in one submission; its buffers held until all are reaped.
            results = pages.submit(lease, True, entries) if entries else []
        at = 0
        for i, mine in slots:
            out[i] = pages.failure(True, mine, results[at : at + len(mine)])
            at += len(mine)
        return out

    def read(
        self, row_snapshot: tuple[bytes, int, int, int, int], dst: memoryview, value: bool = True
    ) -> bool:
        """Read a block into `dst` (page-aligned, whole pages); False if it fails verification.

        `row_snapshot` is (key, page, length, seq, crc) taken under the lock. `value` False
        checks the slot header only: the caller sums the value as it copies it out.

        Raises:
            StorageIOError: the device failed.
        """
        pages = self.pages
        with pages.header_page() as page:
            pages.transfer(False, row_snapshot[1] * PAGE, [page, dst])
            return _verify(row_snapshot, page, dst, value)

    @property
    def batches(self) -> bool:
        """Whether `read_batch` puts a batch in one submission (else it reads one by one)."""
        return isinstance(self.pages, RingPages)

    def read_batch(
        self,
        reads: Sequence[tuple[tuple[bytes, int, int, int, int], memoryview]],
        value: bool = True,
    ) -> list[bool | None]:
        """`read` of each (row snapshot, dst), in one submission on the io_uring path: per
        block whether it verified (`value` as for `read`), or None if its I/O failed or came
        back short (logged).

        Raises:
            StorageIOError: the ring itself failed (every block's I/O is over by then).
        """
        pages = self.pages
        if not isinstance(pages, RingPages):
            out: list[bool | None] = []
            for snap, dst in reads:
                try:
                    out.append(self.read(snap, dst, value))
                except StorageIOError as exc:
                    log.error("reading block %s from the SSD failed: %s", snap[0].hex(), exc)
                    out.append(None)
            return out
        with pages.lease() as lease:
            headers = lease.header_pages(len(reads))
            entries: list[tuple[int, memoryview]] = []
            for i, (snap, dst) in enumerate(reads):
                entries.append((snap[1] * PAGE, headers[i * PAGE : (i + 1) * PAGE]))
                entries.append((snap[1] * PAGE + PAGE, dst))
            results = pages.submit(lease, False, entries)
            out = []
            for i, (snap, dst) in enumerate(reads):
                got_head, got = results[2 * i], results[2 * i + 1]
                if got_head != PAGE or got != len(dst):
                    bad = got_head if got_head != PAGE else got
                    why = os.strerror(-bad) if bad < 0 else f"short read ({bad} bytes)"
                    log.error("reading block %s from the SSD failed: %s", snap[0].hex(), why)
                    out.append(None)
                else:
                    out.append(_verify(snap, headers[i * PAGE : (i + 1) * PAGE], dst, value))
            return out

    def wipe(self, offset: int) -> None:
        """Zero a slot's header page, so a rebuild from slot headers cannot bring a deleted
        block back.

        Raises:
            StorageIOError: the device failed.
        """
        pages = self.pages
        with pages.header_page() as page:
            page[:] = bytes(PAGE)
            pages.transfer(True, offset, [page])


def _verify(
    snap: tuple[bytes, int, int, int, int], page: memoryview, dst: memoryview, value: bool = True
) -> bool:
    """Whether a slot read into (`page`, `dst`) is the block `snap` names, intact (with
    `value` False, its header only: the value's CRC32C is then the caller's to check)."""
    key, _, length, seq, crc = snap
    fields = _HEADER.unpack(page[:SLOT_HEADER])
    # (crc, magic, version, flags, tenant, _, seq, key, parent, length, value crc, name):
    # the header must be intact and name this very block; then the value must match.
    if fields[0] != crc32c.crc32c(page[4:SLOT_HEADER]):
        return False
    if fields[1:3] != (_MAGIC, 1) or fields[6:8] != (seq, key):
        return False
    if fields[9] != length or fields[10] != crc:
        return False
    return not value or crc32c.crc32c(dst[:length]) == crc


# GPUDirect Storage: slot I/O through kvikio (cuFile) when it is installed and a CUDA device is
# present, so a later step can move blocks between SSD and GPU memory without a host bounce.
# Same contract as `SlotFile.read` / `write` for host buffers; kvikio's `pread`/`pwrite` also
# accept device buffers, which is the point. `select_slot_file` falls back to the O_DIRECT host
# path whenever either is missing.


def gds_available() -> bool:
    """kvikio importable and at least one CUDA device visible."""
    if importlib.util.find_spec("kvikio") is None:
        return False
    try:
        import cupy  # kvikio's own dependency

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device: the host path serves
        return False


class CuFileIO:
    """A slot file's reads and writes through kvikio's cuFile handle (`SlotFile.device`)."""

    def __init__(self, path: str) -> None:
        import kvikio

        self.path = path
        self._cufile = kvikio.CuFile(path, "r+")

    def transfer(self, verb: str, offset: int, buffers: Sequence[memoryview]) -> None:
        op = self._cufile.pread if verb == "read" else self._cufile.pwrite
        for buf in buffers:
            try:
                done = op(buf, len(buf), offset).get()
            except Exception as exc:  # kvikio raises its own runtime errors
                raise StorageIOError(f"cuFile {verb} of {self.path} at {offset}: {exc}") from exc
            if done != len(buf):
                raise StorageIOError(f"cuFile {verb} of {self.path} at {offset}: short transfer")
            offset += len(buf)

    def close(self) -> None:
        self._cufile.close()


def select_slot_file(backend: str, path: str, size: int) -> SlotFile:
    """The slot file for `backend`: "posix", "kvikio", or "auto" (kvikio when usable).

    Raises:
        ConfigError: "kvikio" asked for but not usable here.
    """
    if backend == "kvikio" or (backend == "auto" and gds_available()):
        if not gds_available():
            raise ConfigError("ssd.io_backend = 'kvikio' needs the kvikio package and a CUDA GPU")
        log.info("SSD slot I/O through kvikio (GPUDirect Storage)")
        slots = SlotFile(path, size)  # preallocation, O_DIRECT fd for fdatasync
        slots.device = CuFileIO(path)
        return slots
    return SlotFile(path, size)
