"""`kvstore.ssd.nixl_io`: slot I/O through NIXL's POSIX backend, against a real slot file.

Runs where NIXL is installed; skipped otherwise, unless KVOFFLOAD_REQUIRE_NIXL=1 (CI), which
makes a missing NIXL fail these tests instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest

from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.ssd.catalog import WritePlan
from kvoffload.kvstore.ssd.slotio import AlignedBuffer, BlockIO, SlotFile

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
    reason="NIXL not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1; "
    "CI sets KVOFFLOAD_REQUIRE_NIXL=1)",
)
SIZE = 4 << 20


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[SlotFile]:
    f = SlotFile(str(tmp_path / "slots"), SIZE)
    yield f
    f.close()


def plan(seq: int, offset: int, length: int) -> WritePlan:
    return WritePlan(key=seq.to_bytes(16, "little"), parent=None, tenant=0, length=length,
                     size=PAGE + -(-length // PAGE) * PAGE, offset=offset, seq=seq)  # fmt: skip


def filled(pages: int, seed: int) -> AlignedBuffer:
    buf = AlignedBuffer(pages * PAGE)
    buf.view[:] = bytes([seed % 251]) * len(buf.view)
    buf.view[:8] = seed.to_bytes(8, "little")
    return buf


class HeldReads:
    """NIXL read completions held back until `release()` (a hung device): the transfer is
    posted to the kernel, its checks answer "in progress". Writes complete as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvoffload.kvstore.ssd import nixl_io

        poll = nixl_io.NixlFileIO._poll
        self.started, self._go = threading.Event(), threading.Event()

        def held(io: nixl_io.NixlFileIO, batch: nixl_io._Batch) -> bool:
            if batch.write or self._go.is_set():
                return poll(io, batch)
            self.started.set()
            return False

        monkeypatch.setattr(nixl_io.NixlFileIO, "_poll", held)

    def release(self) -> None:
        self._go.set()


def process_cpu_ticks() -> int:
    """utime + stime of this process and its threads, in clock ticks (Linux /proc)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@needs_nixl
def test_blocks_round_trip_verified_and_wiped(slots: SlotFile) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlPages

    pages = NixlPages(slots, "nixl-posix")
    io = BlockIO(slots, pages)
    try:
        arena = AlignedBuffer(8 * PAGE)
        io.register_memory(arena.view)
        src = filled(3, 7)
        arena.view[: 3 * PAGE] = src.view
        p = plan(5, 16 * PAGE, 3 * PAGE - 100)
        io.write(p, "acme", arena.view[: 3 * PAGE])
        assert p.crc == crc32c.crc32c(src.view[: p.length])
        dst = arena.view[4 * PAGE : 7 * PAGE]
        dst[:] = bytes(len(dst))
        snap = (p.key, p.offset // PAGE, p.length, p.seq, p.crc)
        assert io.read(snap, dst) is True
        assert dst[: p.length] == src.view[: p.length]
        assert io.read((p.key, p.offset // PAGE, p.length, p.seq + 1, p.crc), dst) is False
        io.wipe(p.offset)
        assert io.read(snap, dst) is False  # no header any more
        # Everything landed in registered memory: no per-transfer registration.
        stats = pages.files.stats()
        assert stats.temp_registrations == 0 and stats.requests == stats.transfers == 5
    finally:
        io.close()
        io.close()  # idempotent


@needs_nixl
def test_a_buffer_outside_registered_memory_is_registered_for_its_transfer(
    slots: SlotFile,
) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlFileIO

    io = NixlFileIO(slots, "nixl-posix")
    try:
        src, dst = filled(2, 3), AlignedBuffer(2 * PAGE)
        io.transfer(True, [(src.view, 0)])
        io.transfer(False, [(dst.view, 0)])
        assert dst.view == src.view
        assert io.stats().temp_registrations == 2
    finally:
        io.close()


@needs_nixl
def test_queued_slots_share_one_transfer(slots: SlotFile) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlFileIO

    io = NixlFileIO(slots, "nixl-posix", start=False)  # requests queue until start()
    bufs = [filled(2, i) for i in range(6)]
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            io.transfer(True, [(bufs[i].view[:PAGE], 2 * i * PAGE),
                               (bufs[i].view[PAGE:], (2 * i + 1) * PAGE)])  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while io.stats().requests < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    io.start()
    for t in threads:
        t.join()
    try:
        stats = io.stats()
        assert not errors and stats.requests == 6
        assert stats.transfers == 1 and stats.descriptors == 12  # one submission for six slots
        back = AlignedBuffer(12 * PAGE)
        io.transfer(False, [(back.view, 0)])
        assert all(back.view[2 * i * PAGE : 2 * (i + 1) * PAGE] == bufs[i].view for i in range(6))
    finally:
        io.close()


@needs_nixl
def test_a_failing_transfer_is_a_storage_error_and_the_next_one_works(
    slots: SlotFile, tmp_path: Path
) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlFileIO

    io = NixlFileIO(slots, "nixl-posix")
    data = filled(1, 9)
    try:
        # A real kernel error: the slot file's descriptor number now names a read-only file,
        # so the submitted write fails with EBADF inside NIXL.
        saved = os.dup(slots.fd)
        readonly = os.open(tmp_path / "slots", os.O_RDONLY)
        os.dup2(readonly, slots.fd)
        try:
            with pytest.raises(StorageIOError, match=r"write to .*slots at 8192 failed: NIXL"):
                io.transfer(True, [(data.view, 2 * PAGE)])
        finally:
            os.dup2(saved, slots.fd)
            os.close(saved)
            os.close(readonly)
        io.transfer(True, [(data.view, 2 * PAGE)])  # on a rebuilt agent
        back = AlignedBuffer(PAGE)
        io.transfer(False, [(back.view, 2 * PAGE)])
        assert back.view == data.view
        stats = io.stats()
        assert stats.failed_transfers == 1 and stats.rebuilds == 1
        # Outside the registered file: refused by NIXL, reported the same way.
        with pytest.raises(StorageIOError, match="read of"):
            io.transfer(False, [(back.view, SIZE)])
    finally:
        io.close()
    with pytest.raises(StorageIOError, match="closed"):
        io.transfer(False, [(data.view, 0)])


@needs_nixl
def test_io_uring_queue_round_trip(slots: SlotFile) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlFileIO

    io = NixlFileIO(slots, "nixl-posix", "uring")
    try:
        src, dst = filled(4, 11), AlignedBuffer(4 * PAGE)
        io.transfer(True, [(src.view, PAGE)])
        io.transfer(False, [(dst.view, PAGE)])
        assert dst.view == src.view
    finally:
        io.close()


@needs_nixl
def test_idle_nixl_io_does_not_poll_or_burn_cpu(slots: SlotFile) -> None:
    from kvoffload.kvstore.ssd.nixl_io import NixlFileIO

    threads = threading.active_count()
    io = NixlFileIO(slots, "nixl-posix")
    try:
        buf = filled(1, 1)
        io.transfer(True, [(buf.view, 0)])
        assert threading.active_count() == threads  # the callers drive NIXL: no thread of ours
        polls, cpu = io.stats().polls, process_cpu_ticks()
        time.sleep(0.5)  # idle: a spinning thread would use ~50 ticks of CPU meanwhile
        assert io.stats().polls == polls
        assert process_cpu_ticks() - cpu <= 5
    finally:
        io.close()


def engine_config(path: Path, io_backend: str) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=2 << 20, max_value_bytes=128 << 10, prefault=False),
        SsdConfig(capacity_bytes=16 << 20, io_backend=io_backend),
        data_dir=str(path),
    )


def test_config_names_the_valid_backends_and_queues() -> None:
    with pytest.raises(ConfigError, match="'nixl-posix'"):
        SsdConfig(io_backend="nixl")
    with pytest.raises(ConfigError, match="nixl_queue"):
        SsdConfig(io_backend="nixl-posix", nixl_queue="epoll")
    assert SsdConfig(io_backend="nixl-gds").io_backend == "nixl-gds"


def test_missing_nixl_is_a_config_error_and_leaves_no_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # what an install without NIXL sees
    with pytest.raises(ConfigError, match="needs NIXL.*pip install --no-deps nixl-cu12"):
        Engine(engine_config(tmp_path / "store", "nixl-posix"))
    assert not (tmp_path / "store").exists()


@needs_nixl
def test_gds_without_a_gpu_is_a_config_error(tmp_path: Path) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("a GPU is present: GDS may work here")
    with pytest.raises(ConfigError, match="GDS backend cannot be created here .*GPU"):
        Engine(engine_config(tmp_path / "store", "nixl-gds"))
    assert not (tmp_path / "store").exists()


@needs_nixl
def test_bench_ssd_nixl_rows(tmp_path: Path) -> None:
    from kvoffload.cli import main

    out = tmp_path / "ssd.json"
    # One round of 16 blocks (the least the rows use) per arm: shape, not numbers.
    argv = ["bench", "ssd", "--dir", str(tmp_path), "--size", "8", "--nixl", "only"]
    assert main([*argv, "--rounds", "1", "--json", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    for op in ("read", "write"):
        for arm in ("nixl", "nixl_uring"):
            rate, cpu = rows[f"ssd_{op}_{arm}/2MiB"], rows[f"cpu_us/ssd_{op}_{arm}/2MiB"]
            assert rate["ref"] == cpu["ref"] == "threads"
            assert rate["value"] > 0 and rate["ref_value"] > 0 and rate["unit"] == "GB/s"
            assert cpu["unit"] == "us" and cpu["ratio"] == round(cpu["ref_value"] / cpu["value"], 3)
            assert "O_DIRECT" in rate["note"]
    assert not list(tmp_path.glob("kvoffload-bench-ssd-*"))  # cleaned up


@needs_nixl
def test_close_gives_up_on_a_hung_transfer_and_fails_what_was_queued_behind_it(
    slots: SlotFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read whose completion never comes fills the in-flight room (128 descriptors); a second
    # read queues behind it. close() waits close_wait_s, leaks the agent, and fails the queued
    # read at once: never posted later on a slot file the store has closed by then.
    from kvoffload.kvstore.ssd import nixl_io

    held = HeldReads(monkeypatch)
    io = nixl_io.NixlFileIO(slots, "nixl-posix", close_wait_s=0.2)
    big, small = AlignedBuffer(128 * PAGE), AlignedBuffer(PAGE)
    errors: dict[str, BaseException | None] = {}

    def read(name: str, pieces: list[tuple[memoryview, int]]) -> None:
        try:
            io.transfer(False, pieces)
            errors[name] = None
        except BaseException as exc:
            errors[name] = exc

    hung = threading.Thread(target=read, args=("hung", [
        (big.view[i * PAGE : (i + 1) * PAGE], i * PAGE) for i in range(128)]))  # fmt: skip
    queued = threading.Thread(target=read, args=("queued", [(small.view, 0)]))
    leaked = len(nixl_io._LEAKED)
    hung.start()
    try:
        assert held.started.wait(30)
        queued.start()
        for _ in range(30_000):  # until it is queued (a hang guard, bounded)
            if io._pending:
                break
            time.sleep(0.001)
        assert io._pending
        closer = threading.Thread(target=io.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        queued.join(30)
        assert isinstance(errors.get("queued"), StorageIOError)
        assert "hung" in str(errors["queued"]) and hung.is_alive()
        assert len(nixl_io._LEAKED) == leaked + 1
    finally:
        held.release()  # the device answers: the hung read ends into memory still registered
        hung.join(30)
        queued.join(30)
    assert not hung.is_alive() and errors["hung"] is None
