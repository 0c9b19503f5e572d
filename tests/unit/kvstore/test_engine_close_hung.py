"""close() with an SSD read that never finishes: bounded by `ssd.close_wait_s`, and the memory
the hung read writes into stays mapped. The read is held in the slot file's preadv seam (the
one the fault tests use), so the engine's own read path runs up to the device; on NIXL's
POSIX backend the transfer is posted to the kernel and its completion is held back instead."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvoffload.errors import KVOffloadError, StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig

BLOCK = 200_000
needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
    reason="NIXL not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)",
)


def key(i: int) -> bytes:
    return (1000 + i).to_bytes(16, "little")


class HungRead:
    """Every slot read blocks (before it reaches the device) until `release()`."""

    def __init__(self, engine: Engine) -> None:
        slots = engine._ssd.slots  # type: ignore[union-attr]
        self._preadv: Callable[[int, Sequence[memoryview], int], int] = slots._preadv
        self.started = threading.Event()
        self._go = threading.Event()
        slots._preadv = self

    def __call__(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self.started.set()
        self._go.wait(120)  # bounded: a failing test still ends
        return self._preadv(fd, buffers, offset)

    def release(self) -> None:
        self._go.set()


@pytest.mark.parametrize("batched", [False, True])
def test_close_gives_up_on_a_hung_read_and_leaves_its_memory_mapped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, batched: bool
) -> None:
    engine = Engine(EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        # The thread path's preadv seam; test_uring.py holds the ring's completions instead.
        SsdConfig(capacity_bytes=64 << 20, close_wait_s=0.2, read_depth=4, io_engine="threads"),
        data_dir=str(tmp_path),
    ))  # fmt: skip
    for i in range(30):  # 6 MB into 4 MiB of DRAM: the first blocks are on the SSD only
        engine.put(key(i), bytes([i]) * BLOCK)
    # Batched: 6 reads, 4 at a time (read_depth): 4 hang, 2 wait in the pool's queue.
    wanted = [key(i) for i in range(6)] if batched else [key(0)]
    assert engine.stats().tiers[0].entries < 30 and engine.lookup(wanted) == len(wanted)
    hung = HungRead(engine)
    errors: list[BaseException] = []

    def get() -> None:
        try:
            engine.get_many_into(wanted, [bytearray(BLOCK) for _ in wanted])
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=get)
    reader.start()
    arena = engine._dram.arena
    closer = threading.Thread(target=lambda: errors.append(_close(engine)))
    try:
        assert hung.started.wait(60)
        with caplog.at_level(logging.ERROR):
            closer.start()
            closer.join(60)
            assert not closer.is_alive()  # waited for ever before
        (closed,) = [e for e in errors if isinstance(e, StorageIOError)]
        assert "close_wait_s" in str(closed) and key(0).hex() in str(closed)
        assert key(0).hex() in caplog.text and "leaked" in caplog.text
        # Still mapped: the hung read may write here yet.
        assert not arena._map.closed
        arena.array[:1] = 1
    finally:
        hung.release()
        reader.join(60)
    assert not reader.is_alive()
    (late,) = [e for e in errors if not isinstance(e, StorageIOError)]
    assert isinstance(late, KVOffloadError) and "closed" in str(late)
    with pytest.raises(KVOffloadError):
        engine.get(key(5))
    assert os.listdir(tmp_path)  # the store's files are all there for the next open
    reopened = Engine(EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20), data_dir=str(tmp_path),
    ))  # fmt: skip
    with reopened:
        buf = bytearray(BLOCK)
        assert reopened.get_into(key(0), buf) == BLOCK and buf == bytes([0]) * BLOCK


@needs_nixl
def test_close_gives_up_on_a_nixl_read_that_never_completes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.kvstore.ssd import nixl_io
    from tests.unit.kvstore.ssd.test_ssd_nixl import HeldReads

    engine = Engine(EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False),
        SsdConfig(capacity_bytes=64 << 20, close_wait_s=0.2, read_depth=4,
                  io_backend="nixl-posix"),
        data_dir=str(tmp_path),
    ))  # fmt: skip
    for i in range(30):  # 6 MB into 4 MiB of DRAM: the first blocks are on the SSD only
        engine.put(key(i), bytes([i]) * BLOCK)
    assert engine.stats().tiers[0].entries < 30 and engine.lookup([key(0)]) == 1
    held = HeldReads(monkeypatch)  # the read's transfer is posted, its completion held back
    leaked = len(nixl_io._LEAKED)
    errors: list[BaseException] = []

    def get() -> None:
        try:
            engine.get_into(key(0), bytearray(BLOCK))
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=get)
    reader.start()
    closer = threading.Thread(target=lambda: errors.append(_close(engine)))  # type: ignore[arg-type]
    try:
        assert held.started.wait(60)
        with caplog.at_level(logging.ERROR):
            closer.start()
            closer.join(30)
            assert not closer.is_alive()  # waited on the NIXL transfer for ever before
        (closed,) = [e for e in errors if isinstance(e, StorageIOError)]
        assert "close_wait_s" in str(closed) and key(0).hex() in str(closed)
        assert "NIXL" in caplog.text and "leaked" in caplog.text
        assert len(nixl_io._LEAKED) == leaked + 1  # the agent and its buffers outlive close
    finally:
        held.release()  # the device answers at last: the read finishes into leaked memory
        reader.join(60)
        closer.join(60)
    assert not reader.is_alive()
    (late,) = [e for e in errors if e is not None and not isinstance(e, StorageIOError)]
    assert isinstance(late, KVOffloadError) and "closed" in str(late)


def _close(engine: Engine) -> BaseException | None:
    try:
        engine.close()
    except BaseException as exc:
        return exc
    return None
