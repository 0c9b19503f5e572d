"""Slot writes through io_uring (issue 30, step 2): durable puts, demotions and wipes submit
their slots through the `SlotRing`; the `ring.write` fault seam's EIO, ENOSPC, short writes
and delays reach those completions: a failed write is never published, its slot is freed and
the error counted; a delayed write across close keeps its buffer mapped. An io_uring_enter that
fails (the `ring.enter` seam) breaks its ring without ever sending the entries it left queued,
and the owner goes on with a fresh ring."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.errors import ConfigError, KVOffloadError, StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.faults import enter_errno, ring
from kvoffload.kvstore.ssd.fsck import fsck
from kvoffload.kvstore.ssd.ringpages import RingPages
from kvoffload.kvstore.ssd.slotio import AlignedBuffer, SlotFile

WAIT_S = 30  # a hang guard, never a timing assertion
BLOCK = 200_000
RING = core.slot_ring_type()
UNAVAILABLE = core.io_uring_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no io_uring: {UNAVAILABLE}")


def key(i: int) -> bytes:
    return (9100 + i).to_bytes(16, "little")


def value(i: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(1000 + i).bytes(size)


def config(path: Path, io_engine: str = "io_uring", dram: int = 4 << 20, **ssd: object
           ) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        DramConfig(capacity_bytes=dram, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, read_depth=2,
                  io_engine=io_engine, **ssd),  # type: ignore[arg-type]
        data_dir=str(path),
    )  # fmt: skip


def ring_pages(engine: Engine) -> RingPages:
    ssd = engine._ssd
    assert ssd is not None and isinstance(ssd.io.pages, RingPages)
    return ssd.io.pages


class Plan:
    """A KVOFFLOAD_FAULTS plan file, replaced atomically."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        self.set({})
        monkeypatch.setenv("KVOFFLOAD_FAULTS", str(path))

    def set(self, plan: dict[str, object]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, self.path)


def read_all(path: Path, keys: list[int]) -> dict[int, bytes | None]:
    """Each key's bytes in a store reopened on the thread path (DRAM cold)."""
    out: dict[int, bytes | None] = {}
    with Engine(config(path, "threads")) as engine:
        for i in keys:
            buf = bytearray(BLOCK)
            got = engine.get_into(key(i), buf)
            out[i] = None if got is None else bytes(buf[:got])
        assert engine.stats().tiers[1].corrupt_blocks == 0
    return out


def test_durable_puts_demotions_and_wipes_are_ring_submissions(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        pages = ring_pages(engine)
        engine.put(key(0), value(0), durable=True)
        # One durable put: its slot's header page and value pages in one submission.
        assert pages.counts() == (1, 2)
        for i in range(1, 40):  # 8 MiB of fast puts into 4 MiB of DRAM: blocks move down
            engine.put(key(i), value(i))
        engine.delete(key(0))  # the slot's header page is wiped, through the ring
        ssd = engine.stats().tiers[1]
        assert ssd.io_engine == "io_uring" and ssd.demotions > 0 and ssd.io_errors == 0
        submissions, entries = pages.counts()
        # Two entries a demotion; the writer's demotions go a batch to a submission.
        assert submissions >= 3 and entries >= 2 + 2 * ssd.demotions + 1
    # What the ring wrote, the thread path reads back intact, and fsck agrees.
    assert read_all(tmp_path, list(range(40))) == {0: None} | {i: value(i) for i in range(1, 40)}
    report = fsck(str(tmp_path))
    assert report.clean and report.good_blocks == report.indexed_blocks > 0


# Every slot's value (odd entries) or header (even ones) of a submission: a durable put's one
# slot, or each slot of a batch of demotions.
FAULTS = [
    pytest.param({"errno": "EIO", "entries": [1, 3, 5, 7]}, id="eio-value"),
    pytest.param({"errno": "ENOSPC", "entries": [0, 2, 4, 6]}, id="enospc-header"),
    pytest.param({"short": True, "entries": [1, 3, 5, 7]}, id="short-value"),
]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_durable_write_is_never_published_and_frees_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: dict[str, object]
) -> None:
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    store = tmp_path / "d"
    with Engine(config(store)) as engine:
        engine.put(key(0), value(0), durable=True)
        used = engine.stats().tiers[1].used_bytes
        plan.set({"ring.write": fault})
        with pytest.raises(StorageIOError):
            engine.put(key(0), value(1), durable=True)  # a new version of key 0
        with pytest.raises(StorageIOError):
            engine.put(key(1), value(1), durable=True)  # a new key
        ssd = engine.stats().tiers[1]
        # Counted, and the slots given back: the tier holds what it held before.
        assert ssd.io_errors == 2 and ssd.used_bytes == used and ssd.entries == 1
        plan.set({})
        buf = bytearray(BLOCK)
        assert engine.get_into(key(0), buf) == BLOCK and buf == value(0)
    # After a reopen (the journal replayed): the old version, never the failed one.
    assert read_all(store, [0, 1]) == {0: value(0), 1: None}
    assert fsck(str(store)).clean


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_demotion_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: dict[str, object]
) -> None:
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    store = tmp_path / "d"
    plan.set({"ring.write": fault})
    with Engine(config(store)) as engine:
        for i in range(40):
            # DRAM full and nothing could move down: that put is refused
            with contextlib.suppress(KVOffloadError):
                engine.put(key(i), value(i))
        ssd = engine.stats().tiers[1]
        # Every demotion failed (the writer may be planning one more: its slot is not
        # counted as an entry, and is given back when that write fails too).
        assert ssd.io_errors > 0 and ssd.entries == 0 and ssd.demotions == 0
        plan.set({})
    # Whatever reached the SSD (the clean close's flush, faults off) reads back whole.
    got = read_all(store, list(range(40)))
    assert all(v is None or v == value(i) for i, v in got.items())
    assert fsck(str(store)).clean


@pytest.mark.parametrize(
    ("io_engine", "delay"),
    [("io_uring", {"ring.write": {"delay_s": 1.0}}), ("threads", {"slot.write": "delay:1.0"})],
)
def test_a_write_delayed_across_close_keeps_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_engine: str, delay: dict[str, object]
) -> None:
    # The durable put's slot write completes late (a slow device) while the engine closes,
    # which does not wait for writes: the arena the write reads from stays mapped (exported
    # to the ring until the completion is reaped), the put fails cleanly (before the fix, its
    # thread died on the closed journal), and the store reopens with the block whole or
    # without it, never torn.
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    store = tmp_path / "d"
    engine = Engine(config(store, io_engine, close_wait_s=0.2))
    engine.put(key(1), value(1), durable=True)
    plan.set(delay)
    outcome: list[object] = []

    def put() -> None:
        try:
            engine.put(key(0), value(0), durable=True)
            outcome.append("ok")
        except KVOffloadError as exc:
            outcome.append(exc)

    writer = threading.Thread(target=put)
    writer.start()
    ssd = engine._ssd
    assert ssd is not None
    arena = engine._dram.arena
    event = threading.Event()
    while not ssd.cat.writing and writer.is_alive():
        event.wait(0.001)
    with contextlib.suppress(KVOffloadError):  # a close that raced the put may report it
        engine.close()
    writer.join(WAIT_S)
    assert not writer.is_alive() and len(outcome) == 1
    assert outcome[0] == "ok" or isinstance(outcome[0], KVOffloadError)
    del arena
    plan.set({})
    got = read_all(store, [0, 1])
    assert got[1] == value(1) and got[0] in (None, value(0))
    assert fsck(str(store)).clean


def test_a_ring_write_holds_its_buffer_until_reaped() -> None:
    # A write into a full pipe is in flight until the pipe is drained: meanwhile the buffer it
    # writes from cannot be resized (the ring holds its export) and close() leaves the ring
    # mapped; the write then completes with every byte.
    assert RING is not None
    r_ring = RING(2)
    r, w = os.pipe()
    os.set_blocking(w, False)
    filled = 0
    while True:
        try:
            filled += os.write(w, bytes(65536))
        except BlockingIOError:
            break
    os.set_blocking(w, True)
    buf = bytearray(b"kvstore!")
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(r_ring.submit([(w, 0, buf, True)])))
    worker.start()
    try:
        in_flight = threading.Event()
        for _ in range(WAIT_S * 1000):
            try:  # a resize, refused while the ring holds the buffer
                buf.append(0)
                buf.pop()
            except BufferError:
                in_flight.set()
                break
            in_flight.wait(0.001)
        assert in_flight.is_set()
        assert r_ring.close() is False and not r_ring.closed
        with pytest.raises(BufferError):
            buf.append(1)
    finally:
        drained = 0
        while drained < filled + 8:
            chunk = os.read(r, 65536)
            drained += len(chunk)
            if drained >= filled + 8 or not worker.is_alive() and drained >= filled:
                break
        worker.join(WAIT_S)
        os.close(r)
        os.close(w)
    assert out == [[8]] and r_ring.closed
    buf.append(1)


def test_writes_are_bounded_before_submission(tmp_path: Path) -> None:
    assert RING is not None
    slots = SlotFile(str(tmp_path / "slots"), 4 * PAGE)
    pages = RingPages(slots, RING, 2)
    buf = AlignedBuffer(2 * PAGE)
    with pytest.raises(StorageIOError, match="past its end"):
        pages.transfer(True, 3 * PAGE, [buf.view])  # would grow the file
    with pytest.raises(StorageIOError, match="whole pages"):
        pages.transfer(True, 0, [buf.view[:100]])
    with pytest.raises(StorageIOError, match="whole pages"):
        pages.transfer(True, 512, [buf.view[:PAGE]])
    assert pages.counts() == (0, 0) and os.fstat(slots.fd).st_size == 4 * PAGE
    pages.close()
    buf.close()
    slots.close()


def test_the_short_fault_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    plan.set({"ring.write": {"short": True, "errno": "EIO"}})
    with pytest.raises(ConfigError, match="short"):
        ring("ring.write")
    plan.set({"ring.write": {"short": 1}})
    with pytest.raises(ConfigError, match="short"):
        ring("ring.write")
    plan.set({"ring.write": {"short": True, "entries": [1]}})
    fault = ring("ring.write")
    assert fault is not None and fault.shorten([PAGE, 2 * PAGE, -5]) == [PAGE, PAGE, -5]


# ---------------------------------------------------------------------------- a failed enter


def test_a_failed_enter_breaks_the_ring_and_its_queued_entries_are_never_sent(
    tmp_path: Path,
) -> None:
    # io_uring_enter fails (ENXIO: not a retry) with a slot write queued in the SQ ring and not
    # taken. Found in review: the ring stayed usable with the entry still queued, so the next
    # submission sent it too and the stale write landed in the file (its buffer given back by
    # then). Now the entry is withdrawn and the ring refuses every later submission.
    assert RING is not None
    path = tmp_path / "slots"
    path.write_bytes(b"".join(bytes([i]) * PAGE for i in range(8)))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        stale, fresh = AlignedBuffer(PAGE), AlignedBuffer(PAGE)
        stale.view[:] = b"\xaa" * PAGE
        fresh.view[:] = b"\xbb" * PAGE
        ring = RING(4)
        with pytest.raises(OSError) as failed:
            ring.submit([(fd, 3 * PAGE, stale.view, True)], enter_fail=errno.ENXIO)
        assert failed.value.errno == errno.ENXIO
        later: list[int] | OSError
        try:
            later = ring.submit([(fd, 5 * PAGE, fresh.view, True)])
        except OSError as exc:
            later = exc
        # Neither write reached the file: the stale one was never sent (read back through
        # the page cache: O_DIRECT reads want aligned buffers).
        assert path.read_bytes() == b"".join(bytes([i]) * PAGE for i in range(8))
        assert isinstance(later, OSError) and later.errno == errno.EIO and ring.broken
        assert ring.counts == (0, 0)
        # Nothing in flight: close unmaps it now.
        assert ring.close() is True and ring.closed
        # A fresh ring writes as usual.
        again = RING(4)
        assert again.submit([(fd, 5 * PAGE, fresh.view, True)]) == [PAGE]
        data = path.read_bytes()
        assert data[3 * PAGE : 4 * PAGE] == bytes([3]) * PAGE
        assert data[5 * PAGE : 6 * PAGE] == b"\xbb" * PAGE
        again.close()
        with pytest.raises(ValueError, match="enter_fail"):
            RING(4).submit([], enter_fail=-1)
    finally:
        os.close(fd)


def test_a_failed_enter_fails_the_write_cleanly_and_the_next_one_gets_a_fresh_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    store = tmp_path / "d"
    with Engine(config(store)) as engine:
        pages = ring_pages(engine)
        assert pages.pinned.wait(WAIT_S)  # the ring that pinned the arena is the one pooled
        engine.put(key(0), value(0), durable=True)
        used = engine.stats().tiers[1].used_bytes
        (source,) = [lease.ring for lease in pages._all]
        assert source.registered == (1, 1)
        plan.set({"ring.enter": "ENXIO"})
        with pytest.raises(StorageIOError, match="io_uring"):
            engine.put(key(0), value(2), durable=True)  # a new version of key 0
        ssd = engine.stats().tiers[1]
        assert ssd.io_errors == 1 and ssd.used_bytes == used and ssd.entries == 1
        # The broken ring left the pool (closed); every ring left there still runs.
        assert all(not lease.ring.broken for lease in pages._free)
        assert source.broken and source.closed
        # It held the arena's pin, and no other ring did: the arena is pinned again.
        assert pages.pinned.wait(WAIT_S)
        plan.set({})
        engine.put(key(1), value(1), durable=True)
        live = [lease.ring for lease in pages._all if not lease.ring.closed]
        assert live and all(ring.registered == (1, 1) for ring in live)
        assert pages.registration()["memory_refused"] == 0
        buf = bytearray(BLOCK)
        assert engine.get_into(key(0), buf) == BLOCK and buf == value(0)
    # After a reopen: the old version of key 0, never the failed write's bytes.
    assert read_all(store, [0, 1]) == {0: value(0), 1: value(1)}
    assert fsck(str(store)).clean


def test_broken_rings_leave_the_gauges_and_keep_their_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found in review: a broken ring stayed in the pool's list, closed, so the rings gauges
    # counted dead rings and closing it zeroed its counters (submissions went down).
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    with Engine(config(tmp_path / "d")) as engine:
        pages = ring_pages(engine)
        assert pages.pinned.wait(WAIT_S)
        seen = [pages.registration()]
        for i in range(3):
            engine.put(key(i), value(i), durable=True)  # through the ring
            seen.append(pages.registration())
            plan.set({"ring.enter": "ENXIO"})
            with pytest.raises(StorageIOError, match="io_uring"):
                engine.put(key(10 + i), value(10 + i), durable=True)  # breaks its ring
            plan.set({})
            seen.append(pages.registration())
            assert pages.pinned.wait(WAIT_S)  # the broken ring held the pin: pinned again
        engine.put(key(3), value(3), durable=True)
        seen.append(pages.registration())
        live = [lease.ring for lease in pages._all if not lease.ring.closed]
        last = seen[-1]
        assert last["rings"] == len(live) == len(pages._all)
        assert last["rings_with_file"] == sum(r.registered[0] > 0 for r in live)
        assert last["rings_with_memory"] == sum(r.registered[1] > 0 for r in live)
        (tier,) = [t for t in engine.stats().tiers if t.name == "ssd"]
        assert tier.io_rings == len(live)
        counters = ("fixed_file_entries", "fixed_memory_entries", "submissions", "entries")
        for name in counters:
            got = [snap[name] for snap in seen]
            assert got == sorted(got), (name, got)  # never down
        assert last["submissions"] > seen[0]["submissions"]
    # Closed: no ring is live, and the counters keep what every ring did.
    after = pages.registration()
    assert after["rings"] == after["rings_with_file"] == after["rings_with_memory"] == 0
    assert all(after[name] >= last[name] for name in counters) and not pages._all


def test_the_enter_fault_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    assert enter_errno() == 0
    plan.set({"ring.enter": "EBADF"})
    assert enter_errno() == errno.EBADF
    for bad in ("delay:0.1", "ENOSUCH", 5):
        plan.set({"ring.enter": bad})
        with pytest.raises(ConfigError, match="ring.enter"):
            enter_errno()
