"""The io_uring ring pool of the SSD tier's slot I/O (`ssd.io_engine` "io_uring").

`RingPages` lends rings to callers and registers the slot file and the DRAM arena with them;
`kvstore.ssd.slotio.BlockIO` lays slots out and verifies them on top.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import kvoffload.kvstore.faults as faults
from kvoffload.errors import StorageIOError
from kvoffload.kvstore.arena import AlignedBuffer
from kvoffload.kvstore.config import PAGE

__all__ = ["RingFile", "RingPages", "thread_header_page"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def thread_header_page(pages: threading.local) -> Iterator[memoryview]:
    """A page-aligned header page of the calling thread's own (kept in `pages`, made on its
    first use), for pages that move one slot at a time on the caller's thread."""
    buf: AlignedBuffer | None = getattr(pages, "buf", None)
    if buf is None:
        buf = pages.buf = AlignedBuffer(PAGE)
    yield buf.view


class RingFile(Protocol):
    """What the ring pool reads of the slot file (`kvstore.ssd.slotio.SlotFile`): typed here
    so that slotio, which lays slots out on top of the pool, is not imported back."""

    path: str
    size: int
    fd: int
    direct: bool


class _Lease:
    """A ring lent to one caller, with header pages for a batch of its size."""

    def __init__(self, ring: Any) -> None:
        self.ring = ring
        self.headers: AlignedBuffer | None = None
        self.cloned = False  # the arena's registration was tried on this ring

    def header_pages(self, count: int) -> memoryview:
        if self.headers is None or self.headers.size < count * PAGE:
            self.headers = AlignedBuffer(max(count, 8) * PAGE)
        return self.headers.view


class RingPages:
    """`Pages` through io_uring (`ssd.io_engine` "io_uring", `kvoffload/core/uring.c`).

    A pool of rings: a caller takes a free one (or makes one) for its submission and gives it
    back, so concurrent callers never share a ring, and a ring exists per caller at once (a
    batch's reader, each get's own thread, a durable put, the demotion writer), not per thread
    ever seen. Each submission waits for all its completions with the GIL released, its buffers
    exported until they are reaped. `BlockIO.read_batch` puts a whole batch of slots in one
    submission; `transfer` one slot's header and value pages, read or written (a durable put,
    a demotion, a wipe); the journal's group commit then syncs the slot file as before.

    With `register` (`ssd.ring_register`), each new ring gets the slot file in its file table,
    and the DRAM arena goes in the buffer tables: `register_memory` pins it once, in one ring
    made on a thread of its own (about 85 ms a GiB here: off the open and the requests), and
    every ring clones that table when it is next lent (microseconds). A registration the
    kernel refuses is counted (`registration`) and that ring runs on plain descriptors or
    addresses; until the pin is done, rings run on plain addresses.
    """

    engine = "io_uring"

    def __init__(self, slots: RingFile, ring_type: type, depth: int, *, register: bool = True
                 ) -> None:  # fmt: skip
        self.slots = slots
        self._ring_type = ring_type
        self.depth = depth  # entries in flight per ring (a slot read is two)
        self._lock = threading.Lock()
        self._free: list[_Lease] = []
        self._all: list[_Lease] = []  # the live rings: a closed one leaves (`_retire`)
        # Counters of the rings closed so far (fixed-file and fixed-memory entries,
        # submissions, entries): closing a ring zeroes its own, and the pool's never go down.
        self._gone = [0, 0, 0, 0]
        self._closed = False
        self._pages = threading.local()  # each thread's header page for `transfer`
        self._register = register
        self._source: Any = None  # the ring that pinned the arena; the others clone its table
        self._arena: memoryview | None = None  # what `register_memory` was given
        self._refused = {"files": 0, "memory": 0}  # registrations the kernel refused
        self._clone_unsupported = False  # a kernel before 6.12: only the pinning ring has it
        self.pinned = threading.Event()  # the arena's pin was tried (tests wait on it)

    def register_memory(self, view: memoryview) -> None:
        """Pin the arena in a ring's buffer table, on a thread of its own."""
        if not self._register:
            self.pinned.set()
            return
        self._arena = view
        self._start_pin()

    def _start_pin(self) -> None:
        try:  # a view of its own for the ring to hold: the arena's can be released
            mine = memoryview(self._arena) if self._arena is not None else None
        except ValueError:  # released: the engine is closing
            mine = None
        if mine is None:
            self.pinned.set()
            return
        self.pinned.clear()
        threading.Thread(target=self._pin, args=(mine,), name="kvoffload-ring-pin",
                         daemon=True).start()  # fmt: skip

    def _pin(self, memory: memoryview) -> None:
        try:
            try:
                lease = _Lease(self._ring_type(self.depth))
            except OSError as exc:
                self._refuse("memory", "the DRAM arena", exc)
                return
            self._register_file(lease.ring)
            lease.cloned = True
            try:
                lease.ring.register_memory(memoryview(memory))  # the ring's own export
            except (OSError, ValueError, BufferError) as exc:
                self._refuse("memory", "the DRAM arena", exc)  # ENOMEM: RLIMIT_MEMLOCK
            with self._lock:
                if not self._closed:
                    if lease.ring.registered[1]:
                        self._source = lease.ring
                    self._all.append(lease)
                    self._free.append(lease)
                    return
            lease.ring.close()  # closed meanwhile: the export goes with the ring
        finally:
            memory.release()  # ours; the ring's view keeps the arena until it is unmapped
            self.pinned.set()

    def _register_file(self, ring: Any) -> None:
        try:
            ring.register_files([self.slots.fd])
        except OSError as exc:
            self._refuse("files", f"the slot file {self.slots.path}", exc)

    def _clone(self, lease: _Lease) -> None:
        """Share the pinned arena with a ring that has not tried yet (once the pin is done)."""
        source = self._source
        if source is None or lease.cloned or self._clone_unsupported:
            return
        lease.cloned = True
        try:
            lease.ring.clone_memory(source)  # the arena's pages stay pinned once
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                self._refuse("memory", "the DRAM arena", exc)
                return
            # Before Linux 6.12: no cloning. Only the pinning ring uses fixed buffers; pinning
            # the arena once per ring would multiply what memlock must allow.
            with self._lock:
                first, self._clone_unsupported = not self._clone_unsupported, True
            if first:
                log.info("io_uring: this kernel cannot share registered buffers between rings "
                         "(Linux 6.12+); one ring uses the registered DRAM arena")  # fmt: skip
        except ValueError as exc:
            self._refuse("memory", "the DRAM arena", exc)

    def _refuse(self, what: str, name: str, exc: Exception) -> None:
        with self._lock:
            self._refused[what] += 1
            first = self._refused[what] == 1
        if first:
            log.warning("io_uring: cannot register %s (%s); its I/O uses plain %s",
                        name, exc, "descriptors" if what == "files" else "addresses")  # fmt: skip

    def registration(self) -> dict[str, int]:
        """Live rings, those with the slot file and with the arena registered (gauges);
        registrations the kernel refused, entries sent on a registered file and on registered
        memory, submissions and entries, of every ring so far (counters: they never go down).
        One snapshot under the pool's lock (a ring in use may still add to its own counts)."""
        with self._lock:
            rings = [lease.ring for lease in self._all]
            out = {
                "rings": len(rings),
                "rings_with_file": sum(r.registered[0] > 0 for r in rings),
                "rings_with_memory": sum(r.registered[1] > 0 for r in rings),
                "files_refused": self._refused["files"],
                "memory_refused": self._refused["memory"],
                "clone_unsupported": int(self._clone_unsupported),
            }
            names = ("fixed_file_entries", "fixed_memory_entries", "submissions", "entries")
            for i, name in enumerate(names):
                out[name] = self._gone[i] + sum((*r.fixed, *r.counts)[i] for r in rings)
        return out

    def _retire(self, lease: _Lease) -> None:
        """Fold a ring's counters into the pool's and drop it from the live rings, before it
        is closed (lock held)."""
        ring = lease.ring
        for i, n in enumerate((*ring.fixed, *ring.counts)):
            self._gone[i] += n
        self._all.remove(lease)

    @contextlib.contextmanager
    def lease(self) -> Iterator[_Lease]:
        """A ring of the caller's own while the context lasts.

        Raises:
            StorageIOError: the pages are closed, or the kernel refused a new ring.
        """
        with self._lock:
            if self._closed:
                raise StorageIOError(f"slot I/O of {self.slots.path} is closed")
            lease = self._free.pop() if self._free else None
        if lease is None:
            try:
                lease = _Lease(self._ring_type(self.depth))
            except OSError as exc:
                raise StorageIOError(f"io_uring_setup for {self.slots.path}: {exc}") from exc
            if self._register:
                self._register_file(lease.ring)
            with self._lock:
                self._all.append(lease)
        if self._register:
            self._clone(lease)
        repin = False
        try:
            yield lease
        finally:
            with self._lock:
                if self._closed or lease.ring.broken:
                    # Reaped by now: unmapped here. A broken ring (its io_uring_enter failed)
                    # never runs again; the next caller makes a fresh one.
                    self._retire(lease)
                    lease.ring.close()
                    if lease.ring is self._source:  # new rings clone another's table
                        self._source = next((other.ring for other in self._all
                                             if other.ring.registered[1]
                                             and not other.ring.closed), None)  # fmt: skip
                        repin = self._source is None and not self._closed
                else:
                    self._free.append(lease)
            if repin:  # no ring holds the table any more: pin the arena again, off this thread
                self._start_pin()

    def header_page(self) -> AbstractContextManager[memoryview]:
        return thread_header_page(self._pages)

    def submit(self, lease: _Lease, write: bool, entries: Sequence[tuple[int, memoryview]]
               ) -> list[int]:  # fmt: skip
        """Move each (offset, buffer) of `entries` in one submission: bytes moved or -errno
        each. The fault seam answers here as `slot.read`/`slot.write` do on the thread path."""
        try:
            faults.check("slot.write" if write else "slot.read")
        except OSError as exc:
            return [-(exc.errno or errno.EIO)] * len(entries)
        fault = faults.ring("ring.write" if write else "ring.read")
        enter = faults.enter_errno()
        fd = self.slots.fd
        batch = [(fd, offset, buf, write) for offset, buf in entries]
        try:
            if fault is None and not enter:
                results: list[int] = lease.ring.submit(batch)
            elif fault is None:
                results = lease.ring.submit(batch, enter_fail=enter)
            else:
                results = lease.ring.submit(batch, fault.delay_s, fault.fail(len(batch)), enter)
                results = fault.shorten(results)
        except (OSError, ValueError) as exc:  # the ring broke or was closed under us
            raise StorageIOError(f"io_uring on {self.slots.path}: {exc}") from exc
        return results

    def transfer(self, write: bool, offset: int, buffers: Sequence[memoryview]) -> None:
        """One slot's pages (a write: its header page and value, or a wipe's header page) in
        one submission. A short write is a failure like EIO (the caller frees the slot and
        never publishes it): O_DIRECT into a preallocated slot moves all or fails, so a short
        one means the device is in trouble, not that a retry would finish it."""
        entries = self.entries(write, offset, buffers)
        with self.lease() as lease:
            results = self.submit(lease, write, entries)
        failed = self.failure(write, entries, results)
        if failed is not None:
            raise failed

    def entries(self, write: bool, offset: int, buffers: Sequence[memoryview]
                ) -> list[tuple[int, memoryview]]:  # fmt: skip
        """One slot's (offset, buffer) entries, checked before anything is submitted.

        Raises:
            StorageIOError: a buffer is not whole pages at a page offset, or a write would
                run past the file's end (and grow it).
        """
        entries = []
        for buf in buffers:
            if len(buf) % PAGE or (offset % PAGE and self.slots.direct):
                raise StorageIOError(
                    f"slot I/O on {self.slots.path} at {offset}: {len(buf)} bytes is not whole "
                    "pages at a page offset"
                )
            entries.append((offset, buf))
            offset += len(buf)
        if write and offset > self.slots.size:  # would grow the file; a read is short there
            raise StorageIOError(f"write to {self.slots.path} ends at {offset}, past its end")
        return entries

    def failure(self, write: bool, entries: Sequence[tuple[int, memoryview]],
                results: Sequence[int]) -> StorageIOError | None:  # fmt: skip
        """The error of the first of one slot's `entries` that failed or moved short."""
        for (at, buf), got in zip(entries, results, strict=True):
            if got != len(buf):
                verb = "write to" if write else "read of"
                why = os.strerror(-got) if got < 0 else f"{got} of {len(buf)} bytes (short)"
                return StorageIOError(f"{verb} {self.slots.path} at {at} failed: {why}")
        return None

    def counts(self) -> tuple[int, int]:
        """(submissions, entries) of every ring so far, closed ones too: a batch of n slot
        reads is one submission of 2n entries."""
        out = self.registration()
        return out["submissions"], out["entries"]

    def close(self) -> None:
        """Close every ring; one with a batch in flight closes when its caller is done."""
        with self._lock:
            self._closed = True
            self._source = self._arena = None
            free, self._free = self._free, []
            for lease in free:
                self._retire(lease)
        for lease in free:
            lease.ring.close()
