"""The mover: executes the plans the manager prepares, against the tiers, and hands back
their outcome; it keeps no books and never sees the manager.

A plan says which block moves between which tier and which DRAM memory: a read back up into
DRAM (`ReadPlan`), a DRAM block written down to the SSD on eviction or at a clean close
(`WriteBack`), a durable put's write through (`WriteThrough`), a deleted slot's wipe
(`SsdWipe`). The manager completes each with what executing it returned. The mover also owns
the threads the I/O runs on: a prefetch pool, and a read pool that serves a batch of reads
(`submit_reads`: each read completes, on the pool thread that did it, through the batch's
callback; on io_uring each pool thread takes a part of the batch in one submission), and the
background demotion writer (`Demoter`: its thread and its loop, which asks its `WriterHost`,
the manager, what to evict and books each outcome through it).

Methods that take the engine's lock held on entry hold it again on return; the tiers release
it while the bytes move (on a DRAM entry and an SSD row pinned meanwhile).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Protocol

import crc32c

from kvoffload.kvstore.dram import DramEntry
from kvoffload.kvstore.ssd.catalog import WritePlan
from kvoffload.kvstore.ssd.tier import SsdRead, SsdTier, SsdWipe

__all__ = [
    "Fuse",
    "Demoter",
    "Mover",
    "ReadLatch",
    "ReadPlan",
    "ReadPool",
    "ReadsDone",
    "WriteBack",
    "WriteThrough",
    "WriterHost",
]

log = logging.getLogger(__name__)


class ReadLatch:
    """What other readers of a key wait on while its block is read back (`Manager.inflight`):
    `threading.Event`'s `set`/`wait` on one lock, held from creation until `set`. An Event is
    a Condition, its lock and a waiter list, made and notified in Python for every cold block
    although a waiter is rare (issue 30, small blocks)."""

    __slots__ = ("_done", "_lock")

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Wake every waiter, now and later (called with the engine's lock held: once)."""
        if not self._done:  # a second set is a no-op, as an Event's
            self._done = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it was set within `timeout` seconds (None: wait until it is). Once set it
        answers True without the lock, as an Event does (a waiter passing the lock on must not
        make another's short wait fail), and a blocking wait re-checks the flag every 50 ms, so
        a waiter interrupted while it held the lock cannot strand the others."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return self._done
            if self._lock.acquire(True, left):  # pass it on: the next waiter takes it at once
                self._lock.release()
                return True
        return True


@dataclass(eq=False, slots=True)
class ReadPlan:
    """A block to read back into DRAM (prepared to completed): the SSD block (pinned), the
    DRAM entry it lands in (pinned, unpublished), where its bytes go, and the event other
    readers of the key wait on. `fused`: the read checks the slot header only, and the
    value's CRC32C is summed as the value is copied into the get's buffer (`Reads`), before
    the block is published."""

    key: bytes
    tier: SsdTier
    block: SsdRead
    entry: DramEntry
    dst: memoryview
    event: ReadLatch
    fused: bool = False


# How a get takes an SSD block's value into its buffer while summing it (one pass over
# the bytes instead of a check where they landed, then a copy): `fuse(key, entry, crc)`
# copies the value of `entry` (read, not published yet) into the key's buffer and says
# whether its CRC32C is `crc`, having zeroed what it copied if not; None: it copied nothing
# (no buffer fits), and the value is checked where it landed.
Fuse = Callable[[bytes, DramEntry, int], "bool | None"]

# How a batch's reads are reported from the read pool: (plans, whether each verified; None:
# its I/O failed), every plan exactly once.
ReadsDone = Callable[[Sequence[ReadPlan], Sequence["bool | None"]], None]


@dataclass(eq=False, slots=True)
class WriteBack:
    """A live DRAM block (pinned) to write down to `tier` as `write` plans it; committed
    only while `keep()` holds (the block was not deleted or overwritten meanwhile)."""

    entry: DramEntry
    tier: SsdTier
    write: WritePlan
    payload: memoryview
    keep: Callable[[], bool]


@dataclass(eq=False, slots=True)
class WriteThrough:
    """A durable put's filled reservation (pinned, unpublished) to write to `tier` and wait
    for its journal record."""

    entry: DramEntry
    tier: SsdTier
    payload: memoryview


_Call = tuple[Callable[..., object], tuple[Any, ...]]


class ReadPool:
    """`threads` threads running submitted calls first in, first out; started on the first.

    Lighter per call than `ThreadPoolExecutor` (no Future and work item per call, no thread
    bookkeeping per submit): a batch's reads report to the batch themselves. The threads are
    daemons: a read hung in the kernel does not hold up the interpreter's exit.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._size = threads
        self._name = name
        self._calls: SimpleQueue[_Call | None] = SimpleQueue()
        self._lock = threading.Lock()  # orders submits against shutdown's stop marks
        self._threads: list[threading.Thread] = []
        self._shut = False

    @property
    def size(self) -> int:
        """Threads of the pool."""
        return self._size

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue `fn(*args)`; what it raises is logged, it should report on its own.

        Raises:
            RuntimeError: the pool is shut down (as `ThreadPoolExecutor.submit`).
        """
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new reads after shutdown")
            if not self._threads:
                for i in range(self._size):
                    thread = threading.Thread(target=self._work, name=f"{self._name}_{i}",
                                              daemon=True)  # fmt: skip
                    thread.start()
                    self._threads.append(thread)
            self._calls.put((fn, args))

    def shutdown(self, wait: bool = True) -> None:
        """Stop once every call submitted so far has run; with `wait`, return only then."""
        with self._lock:
            if not self._shut:
                self._shut = True
                for _ in self._threads:
                    self._calls.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                fn(*args)
            except BaseException:  # a read reports its own failures; this is a last resort
                log.exception("kvoffload: a batch read failed")


class WriterHost(Protocol):
    """What the demotion writer's loop asks of the books (the manager): every method but
    the lock expects the lock held."""

    lock: threading.Lock

    def writer_woken(self) -> None:
        """A pass begins: the wakes sent so far are served."""
        ...

    def wants_room(self) -> bool:
        """Whether the writer should evict more now: it runs, the engine is open with a tier
        below, and less than the high watermark of DRAM is free."""
        ...

    def plan_demotions(self, limit: int) -> list[WriteBack] | None:
        """Up to `limit` of the policy's victims planned for writing down (pinned), taken
        until they would free enough; victims that need no write leave DRAM now. None when
        every block is pinned."""
        ...

    def complete_demotions(self, plans: Sequence[WriteBack], committed: Sequence[bool]) -> None:
        """Each planned victim's outcome: published below and out of DRAM, or not."""
        ...


class Demoter:
    """The background demotion writer: one thread that runs a pass each time it is woken,
    until `stop`. A pass takes the host's victims (the policy decides, the writer only
    executes) up to `batch` at a time, writes them down together (one io_uring submission;
    one after another on the thread path) and completes each, until the host has room
    enough or is stopping.

    Wakes that come while a pass runs fold into one more pass. `stop` lets the pass in
    progress end (it checks `wants_room` between batches, after the batch in flight is
    reaped), runs one more, and joins the thread.
    """

    def __init__(
        self,
        host: WriterHost,
        write: Callable[[Sequence[WriteBack]], list[bool]],
        batch: int,
        name: str = "kvoffload-demote",
    ) -> None:
        self._host = host
        self._write = write
        self._batch = batch
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """End the thread after one more pass; returns once it has ended. Idempotent."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            stopping = self._stop  # read before the pass: a stop during it gets one more
            try:
                self._pass()
            except BaseException:  # a pass reports its own failures; this is a last resort
                log.exception("kvoffload: a background demotion pass failed")
            if stopping:
                return

    def _pass(self) -> None:
        """The policy's victims leave DRAM, written down if they need it, a batch at a time,
        until the host has room; ends early once the writer stops or close began, or every
        block is pinned."""
        host = self._host
        with host.lock:
            host.writer_woken()
            while host.wants_room():
                plans = host.plan_demotions(self._batch)
                if plans is None:
                    return  # every block is pinned: the readers' releases make room
                if not plans:
                    continue  # victims that needed no write left already
                committed = [False] * len(plans)
                try:
                    committed = self._write(plans)  # lock released while in flight
                finally:
                    # Always completed: a plan never completed would pin its block for good.
                    host.complete_demotions(plans, committed)


class Mover:
    """Runs plans against the tiers, on the caller's thread or on the I/O pools."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None  # prefetches
        self.reads: ReadPool | None = None  # the slot reads of batched gets
        self.demoter: Demoter | None = None  # the background demotion writer

    def start(self, io_threads: int, read_depth: int) -> None:
        """Start the prefetch pool and the batch read pool (there is a tier to read from)."""
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-prefetch")
        self.reads = ReadPool(read_depth, "kvoffload-read")

    def start_demoter(self, host: WriterHost, batch: int) -> Demoter:
        """Start the background demotion writer over `host`'s books, `batch` victims at a
        time."""
        self.demoter = Demoter(host, self.write_back_batch, batch)
        return self.demoter

    def stop_demoter(self) -> None:
        """Stop the demotion writer (after its last pass); nothing if none runs."""
        if self.demoter is not None:
            self.demoter.stop()

    def shutdown(self, *, wait: bool) -> None:
        """Stop both pools and the demotion writer. Queued prefetches are dropped; a batch's
        queued reads are not (each must report to its batch, else that get waits)."""
        self.stop_demoter()
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
        if self.reads is not None:
            self.reads.shutdown(wait=wait)

    # ------------------------------------------------------------------ reads

    def read(self, plan: ReadPlan) -> bool | None:
        """Read a planned block (lock held, released for the read): whether it verified, or
        None if the device failed."""
        return _verified(plan, plan.tier.read_into(plan.block, plan.dst, not plan.fused))

    def read_or_miss(self, plan: ReadPlan) -> bool | None:
        """`read`, where an I/O path failing in a way of its own (not a `StorageIOError`,
        which the tier turns into None itself) makes that block a miss, not a lost DRAM
        slot."""
        return _read_or_miss(plan.tier.read_into, plan)

    def submit_reads(self, plans: Sequence[ReadPlan], done: ReadsDone) -> int:
        """Start a batch of reads on the read pool (called without the lock); they complete
        there through `done(plans, oks)`: a part's reads together on io_uring (its books
        then cost one lock and one hand-off, not one a block), else each read on its own.
        Returns how many were started, in order: fewer than all once the pool has shut down
        (the engine is closing); those not started are not reported."""
        reads = self.reads
        assert reads is not None
        if len(plans) > 1 and plans[0].tier.batches:
            # io_uring: the batch cut into one part per pool thread, each one submission on
            # its thread, then verified and completed there in order, so that one part's
            # checksums run while another's reads are in flight (`bench ssd`: the whole batch
            # in one submission left 32 blocks' checksums to one thread, after the last read:
            # 0.6x the threads at 2 MiB; one part a thread: at par).
            per = -(-len(plans) // reads.size)
            for n in range(0, len(plans), per):
                try:
                    reads.submit(_read_batch_and_report, plans[n : n + per], done)
                except RuntimeError:
                    return n
            return len(plans)
        for n, plan in enumerate(plans):
            try:
                reads.submit(_read_and_report, plan, done)
            except RuntimeError:  # the pool shut down: close() began meanwhile
                return n
        return len(plans)

    def submit_prefetch(self, run: Callable[[bytes], None], key: bytes) -> None:
        """Run `run(key)` on the prefetch pool.

        Raises:
            RuntimeError: the pool shut down.
        """
        if self.pool is not None:
            self.pool.submit(run, key)

    # ------------------------------------------------------------------ writes

    def write_back(self, plan: WriteBack) -> bool:
        """Write a DRAM block down (lock held, released for the write); True if the tier
        committed it."""
        return plan.tier.demote(plan.write, plan.payload, plan.keep)

    def write_back_batch(self, plans: Sequence[WriteBack]) -> list[bool]:
        """`write_back` of each plan (one tier below: all go to it), their writes in one
        submission on io_uring (lock held, released for the writes); whether each
        committed."""
        if len(plans) == 1:
            return [self.write_back(plans[0])]
        return plans[0].tier.demote_batch([(p.write, p.payload, p.keep) for p in plans])

    def write_through(self, plan: WriteThrough) -> int:
        """Write a durable put and wait for its journal record (lock held, released for the
        write and the wait); the write's seq.

        Raises:
            CapacityError: no slot could be freed.
            StorageIOError: the device or the journal failed.
        """
        e = plan.entry
        return plan.tier.write_through(e.key, e.length, e.parent, e.tenant, plan.payload, e.meta)

    def wipe(self, tier: SsdTier, wipe: SsdWipe) -> None:
        """Zero a deleted block's header page and let its slot be reused (called without the
        lock)."""
        tier.wipe(wipe)


def _verified(plan: ReadPlan, ok: bool | None) -> bool | None:
    """`ok`; a block that verified keeps the value CRC it was checked against (`DramEntry.crc`:
    the one pass over its bytes a local reader needs). A fused read's value is not checked
    yet: `Reads` sets it once the copy out has summed the value."""
    if ok and not plan.fused:
        plan.entry.crc = plan.block.snap[4]
    return ok


def _read_or_miss(
    read_into: Callable[[SsdRead, memoryview, bool], bool | None], plan: ReadPlan
) -> bool | None:
    try:
        return _verified(plan, read_into(plan.block, plan.dst, not plan.fused))
    except Exception:
        log.exception("kvoffload: reading block %s from the SSD failed", plan.key.hex())
        return None


def _read_batch_and_report(plans: Sequence[ReadPlan], done: ReadsDone) -> None:
    """A batch's slot reads in one submission on a pool thread, then their completion there,
    all together. Every plan is reported, whatever fails."""
    results: list[bool | None] = [None] * len(plans)
    try:
        # One SSD tier below DRAM: every plan of a batch reads from it.
        # A batch's plans are all fused or none (one `fetch_many` makes them).
        results = plans[0].tier.read_batch_unlocked([p.block for p in plans],
                                                    [p.dst for p in plans],
                                                    not plans[0].fused)  # fmt: skip
    except Exception:
        log.exception("kvoffload: reading %d blocks from the SSD failed", len(plans))
    finally:
        if len(results) != len(plans):  # never leave a plan unreported: its batch would wait
            results = [None] * len(plans)
        done(plans, [_verified(plan, ok) for plan, ok in zip(plans, results, strict=True)])


def _read_and_report(plan: ReadPlan, done: ReadsDone) -> None:
    """A batch's slot read on a pool thread, then its completion there (a Future per read
    and a hand-off of each to the caller cost more than the read's own Python)."""
    ok = None
    try:
        ok = _read_or_miss(plan.tier.read_unlocked, plan)
    finally:
        done([plan], [ok])


def check_fused(plan: ReadPlan, fuse: Fuse | None) -> bool:
    """Whether a fused read's value matches its slot's CRC32C, summed as `fuse` copies it
    into the get's buffer (or where it landed, if `fuse` copied nothing); a match is the
    entry's `crc`, as for a read checked in place. Called without the lock: the key is still
    in flight, so nothing publishes, evicts or frees its entry meanwhile."""
    crc = plan.block.snap[4]
    try:
        ok = fuse(plan.key, plan.entry, crc) if fuse is not None else None
    except Exception:
        # A buffer that fails mid-copy: still the block's one check, where it landed (the
        # batch's caller meets the same buffer again in its own copy and raises there).
        log.exception("kvoffload: copying block %s out failed", plan.key.hex())
        ok = None
    if ok is None:
        ok = crc32c.crc32c(plan.dst[: plan.entry.length]) == crc
    if ok:
        plan.entry.crc = crc
    return ok
