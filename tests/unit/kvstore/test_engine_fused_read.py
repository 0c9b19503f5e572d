"""A cold SSD block on its way into a `get_into`/`get_many_into` buffer is summed while it is
copied (one pass over its bytes) and published in DRAM only once that check passed; a block
that fails is a counted corrupt miss, dropped, never published, its buffer zeroed over the
value's length (the documented promise), on the ring, the thread path and the Python core."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import crc32c
import numpy as np
import pytest

import kvoffload.core as core
import kvoffload.kvstore.engine as engine_module
import kvoffload.kvstore.ssd.slotio as slotio
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults
from kvoffload.kvstore.config import PAGE

BLOCK = 200_000
SPARE = 4096  # buffer bytes past the value: never written
WAIT_S = 30  # a hang guard, never a timing assertion
ENGINES = ["io_uring", "threads"]


def key(i: int) -> bytes:
    return (7000 + i).to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def config(path: Path, io_engine: str) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(
            capacity_bytes=64 << 20, admission_min_uses=1, read_depth=4, io_engine=io_engine
        ),  # fmt: skip
        data_dir=str(path),
    )


@contextlib.contextmanager
def cold(
    path: Path, io_engine: str, n: int, damaged: tuple[int, ...] = (), at: int = PAGE + 1000
) -> Iterator[Engine]:
    """An engine over `n` blocks on the SSD only, a byte of the slots of `damaged` flipped on
    disk `at` bytes into the slot (its header page first: the default is in the payload)."""
    if io_engine == "io_uring" and core.io_uring_unavailable() is not None:
        pytest.skip(f"io_uring cannot run here: {core.io_uring_unavailable()}")
    with Engine(config(path, io_engine)) as engine:
        for i in range(n):
            engine.put(key(i), value(i), durable=True)
        assert engine._ssd is not None
        pages = {i: int(engine._ssd.index.rows["page"][engine._ssd.find(key(i))]) for i in damaged}
    with open(path / "ssd.slots", "r+b") as fh:
        for page in pages.values():
            fh.seek(page * PAGE + at)
            byte = fh.read(1)
            fh.seek(page * PAGE + at)
            fh.write(bytes([byte[0] ^ 0xFF]))
    with Engine(config(path, io_engine)) as engine:
        yield engine


def buffers(n: int) -> list[bytearray]:
    return [bytearray(b"\xab" * (BLOCK + SPARE)) for _ in range(n)]


def assert_damaged_miss(engine: Engine, buf: bytearray, i: int, corrupt: int = 1) -> None:
    assert bytes(buf[:BLOCK]) == bytes(BLOCK)  # zeroed: no byte of the damaged block
    assert bytes(buf[BLOCK:]) == b"\xab" * SPARE  # and nothing past the value
    assert engine.stats().tiers[1].corrupt_blocks == corrupt
    assert not engine.contains(key(i)) and engine.get(key(i)) is None  # dropped, not published


@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_damaged_block_in_a_fused_batch_is_a_counted_miss_never_published(
    tmp_path: Path, io_engine: str
) -> None:
    with cold(tmp_path, io_engine, 6, damaged=(2,)) as engine:
        bufs = buffers(6)
        got = engine.get_many_into([key(i) for i in range(6)], bufs)
        assert got == [BLOCK, BLOCK, None, BLOCK, BLOCK, BLOCK]
        assert [bytes(bufs[i][:BLOCK]) for i in (0, 1, 3, 4, 5)] == [
            value(i) for i in (0, 1, 3, 4, 5)
        ]
        assert_damaged_miss(engine, bufs[2], 2)
        assert engine.stats().tiers[0].promotions == 5  # the good ones only


@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_damaged_block_read_by_a_single_get_into_is_a_counted_miss(
    tmp_path: Path, io_engine: str
) -> None:
    with cold(tmp_path, io_engine, 2, damaged=(1,)) as engine:
        buf = buffers(1)[0]
        assert engine.get_into(key(1), buf) is None
        assert_damaged_miss(engine, buf, 1)
        assert engine.stats().tiers[0].promotions == 0


@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_batch_with_one_cold_block_reads_it_on_the_callers_thread_fused(
    tmp_path: Path, io_engine: str
) -> None:
    # One SSD-only block among DRAM hits: nothing to overlap, read on the calling thread.
    with cold(tmp_path, io_engine, 3, damaged=(2,)) as engine:
        assert engine.get_into(key(0), buffers(1)[0]) == BLOCK  # key 0 now in DRAM
        bufs = buffers(2)
        assert engine.get_many_into([key(0), key(1)], bufs) == [BLOCK, BLOCK]
        assert [bytes(b[:BLOCK]) for b in bufs] == [value(0), value(1)]
        bufs = buffers(2)
        assert engine.get_many_into([key(0), key(2)], bufs) == [BLOCK, None]
        assert bytes(bufs[0][:BLOCK]) == value(0)
        assert_damaged_miss(engine, bufs[1], 2)
        assert engine.stats().tiers[0].promotions == 2


@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_good_block_is_copied_published_once_then_served_from_dram(
    tmp_path: Path, io_engine: str
) -> None:
    with cold(tmp_path, io_engine, 4) as engine:
        bufs = buffers(4)
        assert engine.get_many_into([key(i) for i in range(3)], bufs[:3]) == [BLOCK] * 3
        assert engine.get_into(key(3), bufs[3]) == BLOCK  # a single cold get, fused too
        assert [bytes(b[:BLOCK]) for b in bufs] == [value(i) for i in range(4)]
        assert all(bytes(b[BLOCK:]) == b"\xab" * SPARE for b in bufs)
        dram, ssd = engine.stats().tiers
        assert dram.promotions == 4 and ssd.corrupt_blocks == 0
        read = ssd.bytes_read
        again = buffers(4)
        assert engine.get_many_into([key(i) for i in range(4)], again) == [BLOCK] * 4
        assert [bytes(b[:BLOCK]) for b in again] == [value(i) for i in range(4)]
        dram, ssd = engine.stats().tiers
        assert dram.promotions == 4 and ssd.bytes_read == read  # from DRAM: no slot read
        view = engine.get(key(0))
        assert view is not None
        with view:  # the CRC the copy checked is the one a local reader relies on
            assert view.value_crc == crc32c.crc32c(value(0))


def test_a_cold_block_is_summed_once_while_it_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What fails without the fused path: the slot read summed the value where it landed
    # (a pass of its own) before a plain copy out.
    value_sums: list[int] = []
    copies: list[int] = []
    real_copy = engine_module.copy_crc32c

    def summing(data: memoryview, crc: int = 0) -> int:
        if len(data) >= BLOCK:
            value_sums.append(len(data))
        return int(crc32c.crc32c(data, crc))

    def copying(dst: memoryview, src: memoryview) -> int:
        copies.append(len(src))
        return real_copy(dst, src)

    with cold(tmp_path, "threads", 5) as engine:
        monkeypatch.setattr(slotio, "crc32c", SimpleNamespace(crc32c=summing))
        monkeypatch.setattr(engine_module, "copy_crc32c", copying)
        bufs = buffers(5)
        assert engine.get_many_into([key(i) for i in range(4)], bufs[:4]) == [BLOCK] * 4
        assert engine.get_into(key(4), bufs[4]) == BLOCK
        assert value_sums == [] and sorted(copies) == [BLOCK] * 5
        assert [bytes(b[:BLOCK]) for b in bufs] == [value(i) for i in range(5)]


@pytest.mark.parametrize("damaged", [False, True])
def test_another_reader_of_a_block_in_a_fused_read_gets_the_checked_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    # Another thread's get of the key while the batch's copy-and-check runs waits for it
    # (the key is still in flight) and sees the block only if it passed: never read twice.
    copying, go = threading.Event(), threading.Event()
    real_copy = engine_module.copy_crc32c

    def held_copy(dst: memoryview, src: memoryview) -> int:
        copying.set()
        assert go.wait(WAIT_S)
        return real_copy(dst, src)

    with cold(tmp_path, "threads", 1, damaged=(0,) if damaged else ()) as engine:
        monkeypatch.setattr(engine_module, "copy_crc32c", held_copy)
        buf = buffers(1)[0]
        first: list[int | None] = []
        other: list[bytes | None] = []

        def get_into() -> None:
            first.append(engine.get_into(key(0), buf))

        def get() -> None:
            view = engine.get(key(0))
            other.append(None if view is None else bytes(view.data))
            if view is not None:
                view.release()

        reader = threading.Thread(target=get_into)
        reader.start()
        assert copying.wait(WAIT_S)
        assert key(0) in engine._m.inflight  # not published while it is being checked
        second = threading.Thread(target=get)
        second.start()
        second.join(0.2)
        assert second.is_alive()  # it waits for the check, not served around it
        go.set()
        reader.join(WAIT_S)
        second.join(WAIT_S)
        assert not reader.is_alive() and not second.is_alive()
        if damaged:
            assert first == [None] and other == [None]
            assert engine.stats().tiers[1].corrupt_blocks == 1
        else:
            assert first == [BLOCK] and other == [value(0)]
            assert engine.stats().tiers[0].promotions == 1  # read once, for both


def test_copy_crc32c_c_and_python_agree() -> None:
    if "c" not in core.available():
        pytest.skip("the C core did not build here")
    rng = np.random.default_rng(3)
    for n in (0, 1, 63, 64, 4095, 65536, 65537, 2 << 20):
        src = rng.bytes(n)
        out = {}
        for impl in ("c", "python"):
            previous = core.use(impl)
            try:
                dst = bytearray(n + 7)
                out[impl] = (core.copy_crc32c(memoryview(dst), memoryview(src)), bytes(dst))
            finally:
                core.use(previous)
        assert out["c"] == out["python"] == (crc32c.crc32c(src), src + bytes(7))
    with pytest.raises(ValueError, match="destination"):
        core.copy_crc32c(memoryview(bytearray(3)), memoryview(b"four"))


@pytest.mark.parametrize("many", [False, True])
def test_a_copy_that_raises_never_reports_a_hit_with_the_buffer_unwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, many: bool
) -> None:
    # Whatever the fused copy raises, a get that answers with a length has the value's bytes
    # in its buffer (it was reported as a hit with the buffer's old bytes before).
    def broken(dst: memoryview, src: memoryview) -> int:
        raise ValueError("copy_crc32c buffers overlap")

    with cold(tmp_path, "threads", 2) as engine:
        monkeypatch.setattr(engine_module, "copy_crc32c", broken)
        bufs = buffers(2)
        if many:
            got = engine.get_many_into([key(0), key(1)], bufs)
        else:
            got = [engine.get_into(key(0), bufs[0])]
        assert got == [BLOCK] * len(got)
        for i in range(len(got)):
            assert bytes(bufs[i][:BLOCK]) == value(i)


def test_the_python_copy_sums_the_source_not_the_callers_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The caller's buffer may change while it is summed (another thread, aliased buffers of
    # one batch); a sum of it could fail a good block, which is then dropped from the SSD.
    src = bytes(range(256)) * 64
    dst = bytearray(len(src))
    real = core._crc32c.crc32c
    expected = real(src)

    def scribbling(data: object) -> int:
        dst[:] = b"x" * len(dst)  # what a writer of the caller's buffer could do meanwhile
        return int(real(data))

    previous = core.use("python")
    try:
        monkeypatch.setattr(core._crc32c, "crc32c", scribbling)
        got = core.copy_crc32c(memoryview(dst), memoryview(src))
    finally:
        core.use(previous)
    assert got == expected
    assert bytes(dst) == src


def test_the_fused_read_answers_alike_in_c_and_python(tmp_path: Path) -> None:
    # The Python core (KVOFFLOAD_PURE_PYTHON=1's) copies and then sums: two passes, the same
    # answers, the same books.
    if "c" not in core.available():
        pytest.skip("the C core did not build here")
    answers = {}
    for impl in ("c", "python"):
        previous = core.use(impl)
        try:
            with cold(tmp_path / impl, "threads", 5, damaged=(1, 3)) as engine:
                bufs = buffers(5)
                got = engine.get_many_into([key(i) for i in range(5)], bufs)
                dram, ssd = engine.stats().tiers
                answers[impl] = (got, [bytes(b) for b in bufs], dram.promotions,
                                 ssd.corrupt_blocks)  # fmt: skip
        finally:
            core.use(previous)
    assert answers["c"] == answers["python"]
    got, bufs, promotions, corrupt = answers["c"]
    assert got == [BLOCK, None, BLOCK, None, BLOCK] and (promotions, corrupt) == (3, 2)
    assert bufs[1] == bufs[3] == bytes(BLOCK) + b"\xab" * SPARE


def test_pure_python_environment_runs_the_fused_read(tmp_path: Path) -> None:
    # KVOFFLOAD_PURE_PYTHON=1 in a fresh interpreter: the reference end to end.
    import subprocess
    import sys

    script = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_engine_fused_read import cold, buffers, key, value, BLOCK\n"
        "from pathlib import Path\n"
        "import kvoffload.core as core\n"
        "assert core.IMPLEMENTATION == 'python'\n"
        f"with cold(Path({str(tmp_path)!r}), 'threads', 3, damaged=(1,)) as engine:\n"
        "    bufs = buffers(3)\n"
        "    got = engine.get_many_into([key(i) for i in range(3)], bufs)\n"
        "    assert got == [BLOCK, None, BLOCK], got\n"
        "    assert bytes(bufs[1][:BLOCK]) == bytes(BLOCK)\n"
        "    assert bytes(bufs[2][:BLOCK]) == value(2)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, KVOFFLOAD_PURE_PYTHON="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("io_engine", ENGINES)
def test_fused_reads_into_side_buffers_while_pinned_views_hold_dram(
    tmp_path: Path, io_engine: str
) -> None:
    # DRAM all pinned: the batch's reads land in side buffers of their own, still checked as
    # they are copied out, and the side buffers all go back.
    with cold(tmp_path, io_engine, 24, damaged=(20,)) as engine:
        held = [engine.get(key(i)) for i in range(16)]  # ~3.3 MB of the 4 MiB arena pinned
        bufs = buffers(8)
        got = engine.get_many_into([key(i) for i in range(16, 24)], bufs)
        assert got == [BLOCK] * 4 + [None] + [BLOCK] * 3
        assert [bytes(bufs[i][:BLOCK]) for i in (0, 1, 2, 3, 5, 6, 7)] == [
            value(16 + i) for i in (0, 1, 2, 3, 5, 6, 7)
        ]
        assert_damaged_miss(engine, bufs[4], 20)
        stats = engine.stats()
        assert stats.staged_gets > 0 and stats.tiers[1].corrupt_blocks == 1
        for view in held:
            assert view is not None
            view.release()
        assert engine.stats().tiers[0].pinned == 0


@pytest.mark.parametrize("io_engine", ENGINES)
def test_a_wrong_slot_header_is_a_counted_miss_before_any_byte_is_copied(
    tmp_path: Path, io_engine: str
) -> None:
    # The header is checked with the read, before the fused copy: the buffer stays as it was.
    with cold(tmp_path, io_engine, 3, damaged=(1,), at=40) as engine:
        bufs = buffers(3)
        assert engine.get_many_into([key(i) for i in range(3)], bufs) == [BLOCK, None, BLOCK]
        assert bytes(bufs[1]) == b"\xab" * (BLOCK + SPARE)
        assert engine.stats().tiers[1].corrupt_blocks == 1 and not engine.contains(key(1))
        assert [bytes(bufs[i][:BLOCK]) for i in (0, 2)] == [value(0), value(2)]


def test_an_io_error_is_a_counted_miss_that_keeps_the_block_and_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tmp_path / "faults.json"
    monkeypatch.setenv(faults.ENV, str(plan))
    with cold(tmp_path, "threads", 2) as engine:
        plan.write_text(json.dumps({"slot.read": "EIO"}))
        buf = buffers(1)[0]
        assert engine.get_into(key(0), buf) is None
        assert bytes(buf) == b"\xab" * (BLOCK + SPARE)
        ssd = engine.stats().tiers[1]
        assert ssd.io_errors == 1 and ssd.corrupt_blocks == 0
        plan.unlink()
        assert engine.get_into(key(0), buf) == BLOCK and bytes(buf[:BLOCK]) == value(0)
