"""SSD slot I/O through NIXL's file backends, as an alternative to the calling threads' own
`preadv`/`pwritev`: ``ssd.io_backend = "nixl-posix"`` (NIXL's POSIX backend over Linux AIO or
io_uring, as `ssd.nixl_queue` says) or ``"nixl-gds"`` (its GPUDirect Storage backend: the same
code, for a machine with a GPU and cuFile).

No thread of its own: the callers drive NIXL. A caller queues its request (a slot's header
page and value pages, or a header page alone); if no other caller is driving, it becomes the
driver: it posts everything queued, small slots merged into one NIXL transfer per direction (up
to 1 MiB: one submission for several slots when callers queue faster than the device answers),
checks for completions in sleeps that grow from 20 µs to 200 µs, finishes every request that
completes, and hands over once its own has. The others wait on a condition. Nothing polls while
no transfer is in flight, and NIXL's own progress thread is off (the POSIX backend needs none).
A dedicated I/O thread was tried first: on this 2-core machine each completion then cost two
thread wake-ups and reads ran at 0.5-0.9x the thread path; with the callers driving they are
at par (docs/design/ssd-tier.md).

Registered once: the slot file (its descriptor, whole length), the DRAM arena (the engine calls
`register_memory`) and a pool of header pages. A buffer outside them (a staging buffer, fsck's)
is registered for its one transfer.

NIXL reports a failed or short I/O as an error of the whole transfer: every request in it fails
with `StorageIOError`, the error the thread path raises, and the agent is rebuilt before the
next transfer (what the backend's queue holds after an error is not worth trusting).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

import kvoffload.kvstore.faults as faults
from kvoffload.core import io_uring_unavailable, slot_ring_type
from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore.config import PAGE, SsdConfig
from kvoffload.kvstore.ssd.ringpages import RingPages
from kvoffload.kvstore.ssd.slotio import (
    AlignedBuffer,
    BlockIO,
    SlotFile,
    select_slot_file,
)

__all__ = ["BACKENDS", "NixlFileIO", "NixlIOStats", "NixlPages", "SlotBackend",
           "nixl_available"]  # fmt: skip

log = logging.getLogger(__name__)

# io_backend -> NIXL plugin; nixl_queue -> the POSIX plugin's parameters.
BACKENDS = {"nixl-posix": "POSIX", "nixl-gds": "GDS"}
_QUEUES = {"aio": {"use_aio": "true"}, "uring": {"use_uring": "true"}}
_INSTALL = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1 (numpy is needed too)"
_BATCH_DESCS = 32  # descriptors in one transfer
# Bytes in one transfer: merging amortises a submission over small slots; a transfer ends when
# its slowest I/O does, so large slots go one by one (2 MiB reads ran faster alone).
_BATCH_BYTES = 1 << 20
_INFLIGHT_DESCS = 128  # below the POSIX plugin's kernel queue (256 entries)
_HEADER_PAGES = 64  # header pages of requests queued or in flight; more callers wait
_POLL_FIRST, _POLL_MAX = 20e-6, 2e-4  # seconds between completion checks
_names = itertools.count()
# What a close that gave up on a hung transfer left behind (agent, header pages): the kernel
# may still write into them, so they live as long as the process.
_LEAKED: list[object] = []


def _load_api() -> ModuleType:
    """NIXL's Python API (imported on first use: ~340 MB of libraries)."""
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        raise ConfigError(f"ssd.io_backend 'nixl-*' needs NIXL, which is not installed: {_INSTALL}"
                          f" ({exc})") from exc  # fmt: skip


def nixl_available() -> bool:
    """NIXL importable here (its POSIX backend then works; GDS needs a GPU and cuFile too)."""
    try:
        _load_api()
    except ConfigError:
        return False
    return True


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@dataclass
class NixlIOStats:
    """What the I/O thread did: requests served, transfers posted (fewer than requests when
    several slots shared one), completion checks, and the error path's work."""

    requests: int = 0
    transfers: int = 0
    descriptors: int = 0
    polls: int = 0
    temp_registrations: int = 0
    failed_transfers: int = 0
    rebuilds: int = 0


@dataclass(eq=False)
class _Request:
    write: bool
    local: list[tuple[int, int]]  # (address, length) in DRAM
    remote: list[tuple[int, int]]  # (offset, length) in the slot file
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""


class _Agent:
    """One NIXL agent with one file backend, the slot file and the long-lived memory regions
    registered. Not thread-safe: `NixlFileIO` serialises every call."""

    def __init__(self, api: ModuleType, plugin: str, params: dict[str, str], fd: int, size: int,
                 regions: list[tuple[int, int]]) -> None:  # fmt: skip
        bind = importlib.import_module("nixl._bindings")
        # The bindings raise one exception class per NIXL status; all mean "this failed".
        self.errors: tuple[type[Exception], ...] = tuple(
            getattr(bind, n) for n in dir(bind) if n.startswith("nixl") and n.endswith("Error")
        ) + (RuntimeError, ValueError)
        self.name = f"kvoffload-ssd-{os.getpid()}-{next(_names)}"
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                       backends=[])  # fmt: skip
        self.agent: Any = api.nixl_agent(self.name, config)
        try:
            self.agent.create_backend(plugin, params)
        except self.errors as exc:
            hint = " (it needs a CUDA GPU and cuFile)" if plugin.startswith("GDS") else ""
            raise ConfigError(f"NIXL's {plugin} backend cannot be created here{hint}: "
                              f"{type(exc).__name__} {exc}") from exc  # fmt: skip
        self.fd = fd
        self._regs: list[Any] = [self.agent.register_memory([(0, size, fd, "")], "FILE")]
        for addr, length in regions:
            self.keep(self.register(addr, length))

    def keep(self, reg: Any) -> None:
        """Deregister `reg` with the agent's close."""
        self._regs.append(reg)

    def register(self, addr: int, length: int) -> Any:
        return self.agent.register_memory([(addr, length, 0, "")], "DRAM")

    def deregister(self, reg: Any) -> None:
        with contextlib.suppress(*self.errors):
            self.agent.deregister_memory(reg)

    def post(self, write: bool, local: list[tuple[int, int]],
             remote: list[tuple[int, int]]) -> tuple[Any, str]:  # fmt: skip
        """Create and post one transfer: (its handle, "DONE" | "PROC" | "ERR")."""
        agent = self.agent
        handle = agent.initialize_xfer(
            "WRITE" if write else "READ",
            agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM"),
            agent.get_xfer_descs([(o, n, self.fd) for o, n in remote], "FILE"),
            self.name,
        )
        try:
            return handle, str(agent.transfer(handle))
        except self.errors:
            self.release(handle)
            raise

    def check(self, handle: Any) -> str:
        return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        # A handle the backend cannot cancel stays on NIXL's own list of leaked handles.
        with contextlib.suppress(*self.errors):
            handle.release()

    def close(self) -> None:
        """Deregister everything and drop the agent. Idempotent."""
        if self.agent is None:
            return
        for reg in reversed(self._regs):
            self.deregister(reg)
        self._regs.clear()
        self.agent = None


@dataclass(eq=False)
class _Batch:
    write: bool
    requests: list[_Request]
    temp: list[Any]  # registrations made for this transfer alone
    size: int = 0  # descriptors
    bytes: int = 0
    handle: Any = None


class NixlFileIO:
    """Transfers between DRAM and one slot file through a NIXL file backend, driven by the
    callers themselves (see the module's docstring).

    `start=False` holds every request queued until `start()` (a test queues several first, to
    see them share a transfer). `close_wait_s` bounds how long `close` waits for what is in
    flight (`ssd.close_wait_s`).
    """

    def __init__(self, slots: SlotFile, io_backend: str, nixl_queue: str = "aio", *,
                 start: bool = True, close_wait_s: float = 10.0) -> None:  # fmt: skip
        if io_backend not in BACKENDS:
            raise ConfigError(f"not a NIXL io_backend: {io_backend!r}; one of {sorted(BACKENDS)}")
        self.path = slots.path
        self.plugin = BACKENDS[io_backend]
        self._params = dict(_QUEUES[nixl_queue]) if self.plugin == "POSIX" else {}
        self._fd, self._size = slots.fd, slots.size
        self._api = _load_api()
        self._headers = AlignedBuffer(_HEADER_PAGES * PAGE)
        self._pages: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(_HEADER_PAGES):
            self._pages.put(i)
        self._regions = [(_address(self._headers.view), self._headers.size)]
        self._agent_lock = threading.Lock()  # the driver and register_memory share the agent
        try:
            self._agent = _Agent(self._api, self.plugin, self._params, self._fd, self._size,
                                 self._regions)  # fmt: skip
        except BaseException:
            self._headers.close()
            raise
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._inflight: list[_Batch] = []  # touched by the driver alone
        self._driving = False  # a caller is driving the agent now
        self._started = start
        self._close_wait_s = close_wait_s
        self._closing = False
        self._dead = ""  # why NIXL I/O stopped, if a driver hit a bug
        self._broken = False  # a transfer failed: rebuild the agent once none is in flight
        self._stats = NixlIOStats()  # `requests` changes under the condition, the rest under
        # the agent lock (by the driver)

    def start(self) -> None:
        with self._cond:
            self._started = True
            self._cond.notify_all()

    def stats(self) -> NixlIOStats:
        with self._cond:
            return NixlIOStats(**vars(self._stats))

    def register_memory(self, view: memoryview) -> None:
        """Register `view` for the life of this object (the DRAM arena: every transfer that
        lands in it then needs no registration of its own)."""
        region = (_address(view), len(view))
        with self._agent_lock:
            try:
                self._agent.keep(self._agent.register(*region))
            except self._agent.errors as exc:  # each transfer then registers its own buffers
                log.warning("NIXL cannot register %d bytes of DRAM: %s", region[1], exc)
                return
            self._regions.append(region)

    @contextlib.contextmanager
    def header_page(self) -> Iterator[memoryview]:
        """A registered page for a slot header, back in the pool on exit (blocks while every
        page is in use: requests queued or in flight bound that)."""
        i = self._pages.get()
        try:
            yield self._headers.view[i * PAGE : (i + 1) * PAGE]
        finally:
            self._pages.put(i)

    def transfer(self, write: bool, pieces: Sequence[tuple[memoryview, int]]) -> None:
        """Move each (buffer, file offset) piece, all one way, as one request; returns when
        every byte has moved. Buffers are page-aligned and whole pages (O_DIRECT).

        Raises:
            StorageIOError: NIXL or the device failed (or the file range is outside the slot
                file); what the buffers or slots hold afterwards is undefined.
        """
        local = [(_address(buf), len(buf)) for buf, _ in pieces]
        remote = [(offset, len(buf)) for buf, offset in pieces]
        request = _Request(write, local, remote)
        with self._cond:
            if self._closing or self._dead:
                raise StorageIOError(f"{self._verb(request)}: NIXL I/O is closed {self._dead}")
            self._pending.append(request)
            self._stats.requests += 1
        interrupted: BaseException | None = None
        while not request.done.is_set():
            try:
                self._serve(request)
            except BaseException as exc:  # the kernel may still fill the buffer: wait it out
                interrupted = exc
        if interrupted is not None:
            raise interrupted
        if request.error:
            raise StorageIOError(request.error)

    def close(self) -> None:
        """Wait for what is queued or in flight, then release the agent. Idempotent; a
        transfer after it raises StorageIOError. A transfer still unfinished after
        `close_wait_s` (a hung device) is given up on: the agent, its registrations and the
        header pages stay alive for the life of the process, since the kernel may still
        write into them, and close returns (the engine reports the hung reads)."""
        deadline = time.monotonic() + self._close_wait_s
        queued: list[_Request] | None = None  # set when close gives up
        busy = 0
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._started = True
            self._cond.notify_all()
            while self._driving or self._pending or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    # Queued, never posted: failed now, or a driver would post them later on
                    # a slot file the store has closed by then.
                    queued = list(self._pending)
                    self._pending.clear()
                    busy = sum(len(b.requests) for b in self._inflight)
                    _LEAKED.append((self._agent, self._headers))
                    break
                self._cond.wait(left)
        if queued is not None:
            log.error("NIXL I/O on %s: %d requests still in flight after %.1f s at close; "
                      "its agent and buffers are leaked", self.path, busy,
                      self._close_wait_s)  # fmt: skip
            for request in queued:
                self._finish(request, f"{self._verb(request)}: NIXL I/O closed while a "
                                      "transfer before it hung")  # fmt: skip
            with self._cond:
                self._cond.notify_all()  # their callers wait on the condition, not the event
            return
        with self._agent_lock:
            self._agent.close()
        # A caller's traceback may still hold a header page; then the GC unmaps the pool later.
        with contextlib.suppress(BufferError):
            self._headers.close()

    # ------------------------------------------------------------------ driving

    def _verb(self, request: _Request) -> str:
        where = request.remote[0][0] if request.remote else 0
        return f"{'write to' if request.write else 'read of'} {self.path} at {where} failed"

    def _serve(self, request: _Request) -> None:
        """Wait for `request`, driving the agent while no other caller does."""
        with self._cond:
            while not request.done.is_set() and (self._driving or not self._started):
                self._cond.wait()  # the driver tells every waiter when it completes work
            if request.done.is_set():
                return
            self._driving = True
        try:
            self._drive(request)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise  # an interrupt: another caller takes over what is in flight
            log.exception("NIXL slot I/O failed unexpectedly")
            self._abandon(f"(a driver failed: {exc!r})")
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()

    def _drive(self, request: _Request) -> None:
        """Post what is queued (several requests per transfer), check for completions in
        sleeps of 20 to 200 µs, and finish every request that completes, until `request` has."""
        delay = _POLL_FIRST
        inflight = self._inflight
        while not request.done.is_set():
            with self._cond:
                take = [] if self._broken and inflight else self._take(inflight)
            with self._agent_lock:
                if self._broken and not inflight:
                    self._rebuild()
                for batch in take:
                    self._post(batch, inflight)
                done = [batch for batch in inflight if self._poll(batch)]
            for batch in done:
                inflight.remove(batch)
            if done or take:
                with self._cond:
                    self._cond.notify_all()
            if request.done.is_set():
                return
            delay = _POLL_FIRST if done else min(delay * 2, _POLL_MAX)
            time.sleep(delay)

    def _abandon(self, why: str) -> None:
        """Fail everything queued or in flight, for good: a bug in the driving code or an agent
        that cannot be rebuilt, not an I/O error (the kernel may then still be moving bytes of
        what was in flight; nothing better is left to do)."""
        with self._cond:
            self._dead = why
            waiting = [r for b in self._inflight for r in b.requests] + list(self._pending)
            self._inflight.clear()
            self._pending.clear()
        for request in waiting:
            self._finish(request, f"{self._verb(request)}: NIXL I/O stopped {why}")

    def _take(self, inflight: list[_Batch]) -> list[_Batch]:
        """Queued requests as batches of one direction and at most `_BATCH_DESCS`
        descriptors, while there is room in flight (lock held). The first request is taken
        whatever its size when nothing is in flight, so none waits forever."""
        room = _INFLIGHT_DESCS - sum(b.size for b in inflight)
        batches: list[_Batch] = []
        current: dict[bool, _Batch] = {}
        while self._pending:
            request = self._pending[0]
            n = len(request.local)
            if n > room and (inflight or batches):
                break
            self._pending.popleft()
            room -= n
            nbytes = sum(length for _, length in request.local)
            batch = current.get(request.write)
            if (batch is None or batch.size + n > _BATCH_DESCS
                    or batch.bytes + nbytes > _BATCH_BYTES):  # fmt: skip
                batch = current[request.write] = _Batch(request.write, [], [])
                batches.append(batch)
            batch.requests.append(request)
            batch.size += n
            batch.bytes += nbytes
        return batches

    def _covered(self, addr: int, length: int) -> bool:
        return any(start <= addr and addr + length <= start + n for start, n in self._regions)

    def _post(self, batch: _Batch, inflight: list[_Batch]) -> None:
        agent = self._agent
        local = [piece for r in batch.requests for piece in r.local]
        remote = [piece for r in batch.requests for piece in r.remote]
        try:
            for addr, length in local:
                if not self._covered(addr, length):
                    batch.temp.append(agent.register(addr, length))
                    self._stats.temp_registrations += 1
            batch.handle, state = agent.post(batch.write, local, remote)
        except agent.errors as exc:
            self._fail(batch, f"NIXL {self.plugin} transfer: {type(exc).__name__} {exc}")
            return
        self._stats.transfers += 1
        self._stats.descriptors += len(local)
        if state == "DONE":
            self._complete(batch, "")
        elif state == "PROC":
            inflight.append(batch)
        else:
            self._fail(batch, f"NIXL {self.plugin} transfer: {state}")

    def _poll(self, batch: _Batch) -> bool:
        """Check one transfer; True once it has ended (and its callers are told)."""
        self._stats.polls += 1
        try:
            state = self._agent.check(batch.handle)
        except self._agent.errors as exc:
            state = f"{type(exc).__name__} {exc}"
        if state == "PROC":
            return False
        if state == "DONE":
            self._complete(batch, "")
        else:
            self._fail(batch, f"NIXL {self.plugin} transfer: {state}")
        return True

    def _fail(self, batch: _Batch, why: str) -> None:
        log.error("%s (%d requests)", why, len(batch.requests))
        self._stats.failed_transfers += 1
        self._broken = True
        self._complete(batch, why)

    def _complete(self, batch: _Batch, error: str) -> None:
        if batch.handle is not None:
            self._agent.release(batch.handle)
        for reg in batch.temp:
            self._agent.deregister(reg)
        for request in batch.requests:
            self._finish(request, f"{self._verb(request)}: {error}" if error else "")

    def _finish(self, request: _Request, error: str) -> None:
        request.error = error
        request.done.set()

    def _rebuild(self) -> None:
        """A fresh agent after a failed transfer (agent lock held, nothing in flight)."""
        self._agent.close()
        self._agent = _Agent(self._api, self.plugin, self._params, self._fd, self._size,
                             self._regions)  # fmt: skip
        self._broken = False
        self._stats.rebuilds += 1


class NixlPages:
    """`kvstore.ssd.slotio.Pages` through `NixlFileIO`: the same slot layout, verification
    and error contract as the calling threads' path; header pages come from the registered
    pool."""

    def __init__(self, slots: SlotFile, io_backend: str, nixl_queue: str = "aio", *,
                 close_wait_s: float = 10.0) -> None:  # fmt: skip
        self.slots = slots
        self.engine = io_backend  # what stats report
        self.files = NixlFileIO(slots, io_backend, nixl_queue, close_wait_s=close_wait_s)

    def register_memory(self, view: memoryview) -> None:
        self.files.register_memory(view)

    def close(self) -> None:
        self.files.close()

    def header_page(self) -> AbstractContextManager[memoryview]:
        return self.files.header_page()

    def transfer(self, write: bool, offset: int, buffers: Sequence[memoryview]) -> None:
        try:
            faults.check("slot.write" if write else "slot.read")  # the thread path's seams
        except OSError as exc:
            verb = "write to" if write else "read of"
            raise StorageIOError(f"{verb} {self.slots.path} at {offset} failed: {exc}") from exc
        pieces = []
        for buf in buffers:
            pieces.append((buf, offset))
            offset += len(buf)
        self.files.transfer(write, pieces)


@dataclass(frozen=True, slots=True)
class SlotBackend:
    """The one seam for slot I/O (python-diskcache's `Disk`): the only reader of
    `ssd.io_backend`. It says how the slot file is opened (O_DIRECT, or kvikio's cuFile) and
    how blocks move through it (the calling threads, or NIXL); the store and the tier ask it,
    never the config."""

    config: SsdConfig

    def open_file(self, path: str, size: int) -> SlotFile:
        """The slot file ("kvikio", or "auto" with kvikio usable: through cuFile).

        Raises:
            ConfigError: "kvikio" asked for but not usable here.
        """
        backend = self.config.io_backend
        return select_slot_file("posix" if backend in BACKENDS else backend, path, size)

    def open_io(self, slots: SlotFile) -> BlockIO:
        """The block I/O over `slots` ("nixl-*": through NIXL; else by `ssd.io_engine`).

        Raises:
            ConfigError: a NIXL backend was asked for and NIXL or that backend is missing
                here, or io_uring was asked for and cannot run here.
        """
        config = self.config
        if config.io_backend in BACKENDS:
            pages = NixlPages(slots, config.io_backend, config.nixl_queue,
                              close_wait_s=config.close_wait_s)  # fmt: skip
            log.info("SSD slot I/O through NIXL's %s backend", pages.files.plugin)
            return BlockIO(slots, pages)
        engine = config.io_engine
        if slots.device is not None or engine == "threads":
            return BlockIO(slots)  # kvikio's cuFile moves the pages itself
        why = io_uring_unavailable()
        ring_type = slot_ring_type()
        if why is None and ring_type is not None:
            # Two entries a slot (header page, value pages): `read_depth` slots in flight.
            return BlockIO(slots, RingPages(slots, ring_type, 2 * config.read_depth,
                                            register=config.ring_register))  # fmt: skip
        if engine == "io_uring":
            raise ConfigError(f"ssd.io_engine = 'io_uring' cannot run here: {why}")
        log.info("SSD slot I/O on threads: %s", why)
        return BlockIO(slots)
