"""Slot I/O through io_uring (`kvoffload/core/uring.c`, `ssd.io_engine`): the ring's own
contract (per-entry results, bounds, buffers held while in flight, close during a batch), how
the engine picks it, a batch's reads in one submission, faults in its completions, and the
same answers as the thread path."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload.core as core
from kvoffload.errors import ConfigError, KVOffloadError, StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.reads import Reads
from kvoffload.kvstore.ssd.ringpages import RingPages
from kvoffload.kvstore.ssd.slotio import AlignedBuffer, BlockIO, SlotFile

WAIT_S = 30  # a hang guard, never a timing assertion
BLOCK = 200_000
RING = core.slot_ring_type()
UNAVAILABLE = core.io_uring_unavailable()
needs_ring = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no io_uring: {UNAVAILABLE}")


def key(i: int) -> bytes:
    return (7000 + i).to_bytes(16, "little")


def value(i: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(i).bytes(size)


def config(path: Path, io_engine: str = "io_uring", depth: int = 4, **ssd: object
           ) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, read_depth=depth,
                  io_engine=io_engine, **ssd),  # type: ignore[arg-type]
        data_dir=str(path),
    )  # fmt: skip


def cold_store(path: Path, n: int) -> None:
    """`n` blocks on the SSD; the next open starts with DRAM empty."""
    with Engine(config(path, "threads")) as engine:
        for i in range(n):
            engine.put(key(i), value(i), durable=True)


def ring_pages(engine: Engine) -> RingPages:
    ssd = engine._ssd
    assert ssd is not None and isinstance(ssd.io.pages, RingPages)
    return ssd.io.pages


@pytest.fixture
def slot_fd(tmp_path: Path) -> Iterator[int]:
    """An O_DIRECT file of 16 pages, page i filled with byte i."""
    path = tmp_path / "slots"
    path.write_bytes(b"".join(bytes([i]) * PAGE for i in range(16)))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    yield fd
    os.close(fd)


# ---------------------------------------------------------------------------- the ring


@needs_ring
def test_a_batch_reports_each_entry(slot_fd: int) -> None:
    assert RING is not None
    ring = RING(4)
    bufs = [AlignedBuffer(PAGE) for _ in range(10)]  # more entries than the depth
    got = ring.submit([(slot_fd, i * PAGE, b.view, False) for i, b in enumerate(bufs)])
    assert got == [PAGE] * 10
    assert [bytes(b.view) for b in bufs] == [bytes([i]) * PAGE for i in range(10)]
    src = AlignedBuffer(2 * PAGE)
    src.view[:] = b"w" * 2 * PAGE
    end, bad = AlignedBuffer(2 * PAGE), AlignedBuffer(PAGE)
    got = ring.submit([
        (slot_fd, 2 * PAGE, src.view, True),  # a write
        (slot_fd, 15 * PAGE, end.view, False),  # short: the file ends after one page
        (slot_fd, 0, bad.view[1:], False),  # O_DIRECT refuses an unaligned buffer
        (1 << 20, 0, bad.view, False),  # no such descriptor
    ])  # fmt: skip
    assert got == [2 * PAGE, PAGE, -errno.EINVAL, -errno.EBADF]
    assert bytes(end.view[:PAGE]) == bytes([15]) * PAGE
    assert ring.submit([(slot_fd, 3 * PAGE, bufs[0].view, False)]) == [PAGE]
    assert bytes(bufs[0].view) == b"w" * PAGE
    assert ring.counts == (3, 15) and ring.submit([]) == []
    assert ring.close() and ring.closed
    with pytest.raises(ValueError, match="closed"):
        ring.submit([(slot_fd, 0, bufs[0].view, False)])


@needs_ring
def test_bad_entries_are_refused_before_anything_is_submitted(slot_fd: int) -> None:
    assert RING is not None
    for depth in (0, -1, 4097):
        with pytest.raises(ValueError, match="depth"):
            RING(depth)
    ring = RING(2)
    buf = bytearray(PAGE)
    for entries, error in [
        ([(-1, 0, buf, False)], ValueError),
        ([(slot_fd, -PAGE, buf, False)], ValueError),
        ([(slot_fd, (1 << 63) - 10, buf, False)], ValueError),  # offset + length overflows
        ([(slot_fd, 1 << 64, buf, False)], OverflowError),
        ([(slot_fd, 0, b"read-only", False)], BufferError),  # a read needs a writable buffer
        ([(slot_fd, 0, buf)], TypeError),
        ([[slot_fd, 0, buf, False]], TypeError),
        ([(slot_fd, 0, 12, False)], TypeError),
        (5, TypeError),
        ([(slot_fd, 0, buf, False)] * 65537, ValueError),
    ]:
        with pytest.raises(error):
            ring.submit(entries)
    for delay in (-1.0, float("nan"), 61.0):
        with pytest.raises(ValueError, match="delay_s"):
            ring.submit([(slot_fd, 0, buf, False)], delay)
    for fail in ([(1, 5)], [(0, 0)], [(-1, 5)], [(0, 5000)], [5], 7):
        with pytest.raises((ValueError, TypeError)):
            ring.submit([(slot_fd, 0, buf, False)], 0.0, fail)
    buf.extend(b"x")  # no export was left behind by a refused call
    assert ring.counts == (0, 0)
    ring.close()


@needs_ring
def test_injected_errors_replace_only_the_chosen_entries(slot_fd: int) -> None:
    assert RING is not None
    ring = RING(4)
    bufs = [AlignedBuffer(PAGE).view for _ in range(3)]
    got = ring.submit([(slot_fd, 0, b, False) for b in bufs], 0.001, [(1, errno.EIO)])
    assert got == [PAGE, -errno.EIO, PAGE]
    ring.close()


@needs_ring
def test_a_buffer_stays_held_until_its_completion_is_reaped_and_close_waits_for_it() -> None:
    # A read from an empty pipe is in flight until the pipe is written: meanwhile the buffer
    # cannot be resized (its export is held), close() leaves the ring mapped, and the batch
    # still completes into the buffer; the ring is unmapped once it is reaped.
    assert RING is not None
    ring = RING(2)
    r, w = os.pipe()
    buf = bytearray(8)
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(ring.submit([(r, 0, buf, False)])))
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
        assert ring.close() is False  # not now: a batch is in flight
        assert not ring.closed
        with pytest.raises(BufferError):
            buf.append(1)
    finally:
        os.write(w, b"kvstore!")
        worker.join(WAIT_S)
        os.close(r)
        os.close(w)
    assert out == [[8]] and buf[:8] == b"kvstore!"
    assert ring.closed  # the batch's caller unmapped it
    buf.append(1)


# ---------------------------------------------------------------------------- choosing it


def test_the_engine_reports_its_io_engine_and_refuses_a_ring_it_cannot_run(
    tmp_path: Path,
) -> None:
    with Engine(config(tmp_path / "t", "threads")) as engine:
        assert engine.stats().tiers[1].io_engine == "threads"
    with Engine(config(tmp_path / "a", "auto")) as engine:
        want = "threads" if UNAVAILABLE else "io_uring"
        assert engine.stats().tiers[1].io_engine == want
    with pytest.raises(ConfigError, match="io_engine"):
        SsdConfig(io_engine="spdk")
    script = (
        "import sys; from kvoffload.kvstore import Engine, EngineConfig, DramConfig, SsdConfig\n"
        "from kvoffload.errors import ConfigError\n"
        "d = sys.argv[1]\n"
        "mk = lambda e, p: EngineConfig(DramConfig(capacity_bytes=4 << 20, prefault=False),\n"
        "    SsdConfig(capacity_bytes=16 << 20, io_engine=e), data_dir=d + '/pure-' + p)\n"
        "with Engine(mk('auto', 'a')) as e: print(e.stats().tiers[1].io_engine)\n"
        "try: Engine(mk('io_uring', 'b'))\n"
        "except ConfigError as exc: print('refused:', exc)\n"
    )
    env = dict(os.environ, KVOFFLOAD_PURE_PYTHON="1")
    env.pop("KVOFFLOAD_REQUIRE_EXT", None)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "threads"
    assert second.startswith("refused:") and "KVOFFLOAD_PURE_PYTHON" in second


@needs_ring
def test_the_disabled_sysctl_turns_the_ring_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysctl = tmp_path / "io_uring_disabled"
    sysctl.write_text("2\n")
    monkeypatch.setattr(core, "DISABLED_SYSCTL", str(sysctl))
    monkeypatch.setattr(core, "_probed", None)
    why = core.io_uring_unavailable()
    assert why is not None and "disabled" in why
    with Engine(config(tmp_path / "a", "auto")) as engine:
        assert engine.stats().tiers[1].io_engine == "threads"
    with pytest.raises(ConfigError, match="io_uring_disabled"):
        Engine(config(tmp_path / "b", "io_uring"))
    sysctl.write_text("0\n")
    monkeypatch.setattr(core, "_probed", None)
    assert core.io_uring_unavailable() is None


# ---------------------------------------------------------------------------- in the engine


@needs_ring
def test_a_batch_of_cold_reads_is_one_submission(tmp_path: Path) -> None:
    cold_store(tmp_path, 10)
    with Engine(config(tmp_path)) as engine:
        pages = ring_pages(engine)
        views = engine.get_many([key(i) for i in range(10)])
        assert [None if v is None else bytes(v.data) for v in views] == [
            value(i) for i in range(10)
        ]
        for v in views:
            assert v is not None
            v.release()
        # Ten slots, each a header page and its value pages, in one submission per read-pool
        # thread (read_depth 4: parts of 3, 3, 3 and 1 slots).
        assert pages.counts() == (4, 20)
        dram, ssd = engine.stats().tiers
        assert ssd.io_engine == "io_uring" and ssd.io_errors == ssd.corrupt_blocks == 0
        assert ssd.hits == dram.promotions == 10 and dram.pinned == 0


@needs_ring
def test_a_parts_reads_are_completed_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each read-pool thread's part of a batch is published, copied out and reported to the
    # caller in one go (one lock round and one wake-up a part, not one a block).
    cold_store(tmp_path, 10)
    parts: list[int] = []
    complete = Reads._complete

    def counted(self: Reads, batch: Any, plans: Any, oks: Any) -> None:
        parts.append(len(plans) if isinstance(plans, (list, tuple)) else 1)  # 1: a plan alone
        complete(self, batch, plans, oks)

    monkeypatch.setattr(Reads, "_complete", counted)
    with Engine(config(tmp_path)) as engine:
        bufs = [bytearray(BLOCK) for _ in range(10)]
        assert engine.get_many_into([key(i) for i in range(10)], bufs) == [BLOCK] * 10
        assert [bytes(b) for b in bufs] == [value(i) for i in range(10)]
        ssd = engine.stats().tiers[1]
        assert ssd.io_submissions == 4 and ssd.hits == 10 and engine.stats().tiers[0].pinned == 0
    assert sorted(parts) == [1, 3, 3, 3]  # read_depth 4: parts of 3, 3, 3 and 1 slots


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


@needs_ring
def test_eio_on_one_entry_of_a_batch_is_a_counted_miss_never_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold_store(tmp_path / "d", 6)
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    # read_depth 1: one read-pool thread, so the batch is one submission of 12 entries.
    with Engine(config(tmp_path / "d", depth=1)) as engine:
        pages = ring_pages(engine)
        # Entry 3 of the batch is block 1's value pages (2i: its header, 2i+1: its value).
        plan.set({"ring.read": {"errno": "EIO", "entries": [3]}})
        bufs = [bytearray(BLOCK) for _ in range(6)]
        got = engine.get_many_into([key(i) for i in range(6)], bufs)
        ssd = engine.stats().tiers[1]
        assert ssd.io_errors == 1 and ssd.corrupt_blocks == 0
        # Block 1's bytes did land in DRAM, but its entry said EIO: that read is a miss, and
        # the get reads the block again alone (one more submission, of two entries).
        assert got == [BLOCK] * 6 and [bytes(b) for b in bufs] == [value(i) for i in range(6)]
        assert pages.counts() == (2, 14)
    with Engine(config(tmp_path / "d", depth=1)) as engine:  # DRAM empty again
        plan.set({"ring.read": {"errno": "EIO"}})  # every entry
        bufs = [bytearray(b"u" * BLOCK) for _ in range(5)]
        got = engine.get_many_into([key(i) for i in range(1, 6)], bufs)
        assert got == [None] * 5 and all(b == b"u" * BLOCK for b in bufs)
        ssd = engine.stats().tiers[1]
        # Each block: its batch entry and its read alone; an I/O error drops nothing.
        assert ssd.io_errors == 10 and ssd.corrupt_blocks == 0 and ssd.entries == 6
        plan.set({})
        assert engine.get_many_into([key(i) for i in range(1, 6)], bufs) == [BLOCK] * 5
        assert [bytes(b) for b in bufs] == [value(i) for i in range(1, 6)]


@needs_ring
def test_a_short_read_is_a_miss(tmp_path: Path) -> None:
    slots = SlotFile(str(tmp_path / "slots"), 4 * PAGE)
    assert RING is not None
    io = BlockIO(slots, RingPages(slots, RING, 4))
    dst = AlignedBuffer(2 * PAGE)
    # The slot's value would run past the file's end: the kernel moves less than asked.
    snap = (key(0), 3, 2 * PAGE, 1, 0)
    assert io.read_batch([(snap, dst.view), ((key(1), 0, PAGE, 1, 0), dst.view[:PAGE])]) == [
        None,
        False,  # read whole, but no slot was ever written there
    ]
    with pytest.raises(StorageIOError, match="short"):
        io.pages.transfer(False, 3 * PAGE, [dst.view])
    io.close()
    with pytest.raises(StorageIOError, match="closed"):
        io.read_batch([(snap, dst.view)])
    slots.close()


@needs_ring
def test_completions_delayed_past_close_land_in_memory_that_is_still_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ring's completions come late (a slow device) while the engine closes: close gives
    # up after close_wait_s and leaves the arena mapped; the batch then completes into it.
    cold_store(tmp_path / "d", 6)
    plan = Plan(tmp_path / "faults.json", monkeypatch)
    engine = Engine(config(tmp_path / "d", close_wait_s=0.2))
    plan.set({"ring.read": {"delay_s": 1.0}})
    errors: list[BaseException] = []
    got: list[object] = []

    def get() -> None:
        try:
            got.append(engine.get_many_into([key(i) for i in range(6)],
                                            [bytearray(BLOCK) for _ in range(6)]))  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=get)
    reader.start()
    arena = engine._dram.arena
    event = threading.Event()
    while not engine._m.inflight and reader.is_alive():
        event.wait(0.001)
    with pytest.raises(KVOffloadError):
        engine.close()
    assert not arena._map.closed  # the late completions may write here yet
    reader.join(WAIT_S)
    assert not reader.is_alive()
    assert errors or got  # the get ended: with an error (closed) or with its answers
    for e in errors:
        assert isinstance(e, KVOffloadError)
    plan.set({})
    with Engine(config(tmp_path / "d")) as again:
        buf = bytearray(BLOCK)
        assert again.get_into(key(5), buf) == BLOCK and buf == value(5)


# ---------------------------------------------------------------------------- differential


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "durable", "get", "get_many", "delete"]),
        st.integers(0, 40),
        st.integers(1, 60_000),
    ),  # fmt: skip
    min_size=1,
    max_size=60,
)


@needs_ring
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_io_uring_and_threads_give_the_same_answers(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, int]]
) -> None:
    # Small DRAM (1 MiB) over a large SSD: blocks move down and back up all the time, and
    # nothing is dropped, so both engines must answer every get alike.
    base = tmp_path_factory.mktemp("diff")
    engines = [
        Engine(
            EngineConfig(
                DramConfig(capacity_bytes=1 << 20, max_value_bytes=64 << 10, prefault=False),
                SsdConfig(
                    capacity_bytes=32 << 20, admission_min_uses=1, read_depth=4, io_engine=name
                ),
                data_dir=str(base / name),
            )
        )  # fmt: skip
        for name in ("io_uring", "threads")
    ]
    try:
        for op, i, size in ops:
            answers = []
            for engine in engines:
                if op in ("put", "durable"):
                    engine.put(key(i), value(i * 7 + size, size), durable=op == "durable")
                    answers.append(None)
                elif op == "get":
                    view = engine.get(key(i))
                    answers.append(None if view is None else bytes(view.data))
                    if view is not None:
                        view.release()
                elif op == "get_many":
                    views = engine.get_many([key((i + j) % 41) for j in range(8)])
                    answers.append([None if v is None else bytes(v.data) for v in views])
                    for v in views:
                        if v is not None:
                            v.release()
                else:
                    answers.append(engine.delete(key(i)))
            assert answers[0] == answers[1], (op, i)
        stats = [e.stats().tiers[1] for e in engines]
        assert [s.io_engine for s in stats] == ["io_uring", "threads"]
        assert stats[0].entries == stats[1].entries
        assert stats[0].io_errors == stats[1].io_errors == 0
        assert stats[0].corrupt_blocks == stats[1].corrupt_blocks == 0
    finally:
        for engine in engines:
            engine.close()
