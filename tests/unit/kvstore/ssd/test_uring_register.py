"""Registered files and memory on the io_uring path (issue 30): the ring sends entries on its
registered slot file with IOSQE_FIXED_FILE and entries inside the registered arena as
READ_FIXED / WRITE_FIXED, with the same results and bytes as plain entries; it holds the
arena's memory exported while its table points at it; an engine's rings register the slot
file and the arena (pinned once on a thread of its own, cloned by every ring);
`ssd.ring_register = false` and a registration the kernel refuses (no CAP_IPC_LOCK, a tiny
RLIMIT_MEMLOCK) run unregistered, counted."""

from __future__ import annotations

import errno
import gc
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvoffload.core as core
from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.engine import arena_of
from kvoffload.kvstore.ssd.ringpages import RingPages
from kvoffload.kvstore.ssd.slotio import AlignedBuffer, SlotFile

BLOCK = 200_000
RING = core.slot_ring_type()
UNAVAILABLE = core.io_uring_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no io_uring: {UNAVAILABLE}")


def key(i: int) -> bytes:
    return (5100 + i).to_bytes(16, "little")


def value(i: int) -> bytes:
    return np.random.default_rng(5100 + i).bytes(BLOCK)


def config(path: Path, register: bool = True) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=256 << 10, prefault=False,
                   demote_background=False),
        SsdConfig(capacity_bytes=64 << 20, admission_min_uses=1, read_depth=4,
                  io_engine="io_uring", ring_register=register),
        data_dir=str(path),
    )  # fmt: skip


@pytest.fixture
def slot_fd(tmp_path: Path) -> Iterator[int]:
    """An O_DIRECT file of 16 pages, page i filled with byte i."""
    path = tmp_path / "slots"
    path.write_bytes(b"".join(bytes([i]) * PAGE for i in range(16)))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    yield fd
    os.close(fd)


def test_fixed_entries_move_the_same_bytes_as_plain_ones(slot_fd: int) -> None:
    assert RING is not None
    arena = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(arena)
    outside = AlignedBuffer(2 * PAGE)
    ring = RING(8)
    ring.register_files([slot_fd])
    ring.register_memory(memoryview(view))
    assert ring.registered == (1, 1)
    view[7 * PAGE :] = b"w" * PAGE
    got = ring.submit([
        (slot_fd, 2 * PAGE, view[0:PAGE], False),  # inside the arena: READ_FIXED
        (slot_fd, 3 * PAGE, view[PAGE : 3 * PAGE], False),
        (slot_fd, 9 * PAGE, view[7 * PAGE :], True),  # WRITE_FIXED
        (slot_fd, 5 * PAGE, outside.view, False),  # outside: a plain read on the fixed file
    ])  # fmt: skip
    assert got == [PAGE, 2 * PAGE, PAGE, 2 * PAGE]
    assert ring.fixed == (4, 3)
    assert bytes(view[:PAGE]) == bytes([2]) * PAGE
    assert bytes(view[PAGE : 3 * PAGE]) == bytes([3]) * PAGE + bytes([4]) * PAGE
    assert bytes(outside.view) == bytes([5]) * PAGE + bytes([6]) * PAGE
    # The same entries on a plain ring: the same answers and bytes.
    plain = RING(8)
    again = AlignedBuffer(PAGE)
    assert plain.submit([(slot_fd, 9 * PAGE, again.view, False)]) == [PAGE]
    assert bytes(again.view) == b"w" * PAGE and plain.fixed == (0, 0)
    # A second ring clones the table: no new pin, the same fixed entries.
    clone = RING(4)
    clone.clone_memory(ring)
    assert clone.registered == (0, 1)
    assert clone.submit([(slot_fd, 0, view[4 * PAGE : 5 * PAGE], False)]) == [PAGE]
    assert clone.fixed == (0, 1) and bytes(view[4 * PAGE : 5 * PAGE]) == bytes([0]) * PAGE
    # Registered memory stays exported while a ring's table points at it.
    view.release()
    with pytest.raises(BufferError):
        arena.close()
    assert ring.close() is True and clone.close() is True
    arena.close()
    plain.close()


def test_an_entry_larger_than_the_registered_memory_goes_plain(slot_fd: int) -> None:
    # Its start inside the registered page, its end past it: not a fixed entry (once it was,
    # for a length past the registered one wrapped the bound), a plain read of the same bytes.
    assert RING is not None
    arena = mmap.mmap(-1, 3 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(arena)
    ring = RING(4)
    ring.register_memory(view[:PAGE])
    assert ring.submit([(slot_fd, 6 * PAGE, view[: 2 * PAGE], False)]) == [2 * PAGE]
    assert ring.fixed == (0, 0)
    assert bytes(view[: 2 * PAGE]) == bytes([6]) * PAGE + bytes([7]) * PAGE
    assert ring.close() is True
    view.release()
    arena.close()


class _Pre612Ring:
    """A real ring whose `clone_memory` answers as a kernel before Linux 6.12 does."""

    def __init__(self, depth: int) -> None:
        assert RING is not None
        self._ring = RING(depth)

    def clone_memory(self, source: object) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    def __getattr__(self, name: str) -> object:
        return getattr(self._ring, name)


def test_a_kernel_that_cannot_clone_leaves_one_ring_with_the_arena(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Not a refusal (the pin holds): the other rings run on plain addresses, said once, at
    # info, and no ring tries to clone again.
    slots = SlotFile(str(tmp_path / "slots"), 16 * PAGE)
    pages = RingPages(slots, _Pre612Ring, 2)
    arena = AlignedBuffer(4 * PAGE)
    caplog.set_level(logging.INFO, logger="kvoffload")
    pages.register_memory(arena.view)
    assert pages.pinned.wait(30)  # a hang guard: the pin runs on its thread
    with pages.lease() as a, pages.lease() as b, pages.lease() as c:
        assert [x.ring.registered[1] for x in (a, b, c)].count(1) == 1
    pages.transfer(True, 0, [arena.view[:PAGE]])
    reg = pages.registration()
    assert reg["rings"] == 3 and reg["rings_with_memory"] == 1
    assert reg["clone_unsupported"] == 1 and reg["memory_refused"] == 0
    notes = [r for r in caplog.records if "share registered buffers" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    pages.close()
    arena.close()
    slots.close()


def test_registration_is_checked(slot_fd: int) -> None:
    assert RING is not None
    ring = RING(4)
    with pytest.raises(ValueError, match="descriptors"):
        ring.register_files([])
    with pytest.raises(ValueError, match="bad file descriptor"):
        ring.register_files([-1])
    with pytest.raises(OSError):  # not a file the kernel can register
        ring.register_files([1 << 20])
    with pytest.raises(BufferError):
        ring.register_memory(b"read-only")
    with pytest.raises(ValueError, match="memory"):
        ring.register_memory(bytearray())
    with pytest.raises(ValueError, match="clone_memory"):
        ring.clone_memory(RING(4))  # the source has none
    with pytest.raises(TypeError):
        ring.clone_memory(object())
    ring.register_files([slot_fd])
    with pytest.raises(ValueError, match="already"):
        ring.register_files([slot_fd])
    ring.close()
    with pytest.raises(ValueError, match="closed"):
        ring.register_files([slot_fd])


def test_an_engines_rings_register_the_slot_file_and_the_arena(tmp_path: Path) -> None:
    answers = {}
    for register in (True, False):
        store = tmp_path / str(register)
        with Engine(config(store, register)) as engine:
            ssd = engine._ssd
            assert ssd is not None and isinstance(ssd.io.pages, RingPages)
            assert ssd.io.pages.pinned.wait(30)  # a hang guard: the pin runs on its thread
            for i in range(40):  # DRAM holds ~20: the others are demoted on the puts
                engine.put(key(i), value(i))
            buf = bytearray(BLOCK)
            answers[register] = [engine.get_into(key(i), buf) == BLOCK and buf == value(i)
                                 for i in range(40)]  # fmt: skip
            got = engine.get_many_into([key(i) for i in range(8)],
                                       [bytearray(BLOCK) for _ in range(8)])  # fmt: skip
            assert got == [BLOCK] * 8
            reg = ssd.io.pages.registration()
            assert ssd.stats(engine._m.n).demotions > 0
        assert reg["rings"] >= 1 and reg["files_refused"] == reg["memory_refused"] == 0
        if register:
            # Every ring: the slot file and the arena (pinned by one, cloned by the others);
            # slot writes from DRAM and reads into it went as fixed buffers, every entry on
            # the fixed file.
            # (Before Linux 6.12 no ring can clone: only the pinning one has the arena.)
            with_memory = 1 if reg["clone_unsupported"] else reg["rings"]
            assert reg["rings_with_file"] == reg["rings"]
            assert reg["rings_with_memory"] == with_memory
            assert reg["fixed_file_entries"] > reg["fixed_memory_entries"] > 0
        else:
            assert reg["rings_with_file"] == reg["rings_with_memory"] == 0
            assert reg["fixed_file_entries"] == reg["fixed_memory_entries"] == 0
    assert answers[True] == answers[False] == [True] * 40


def test_the_rings_registrations_reach_the_engines_stats(tmp_path: Path) -> None:
    with Engine(config(tmp_path)) as engine:
        ssd = engine._ssd
        assert ssd is not None and isinstance(ssd.io.pages, RingPages)
        assert ssd.io.pages.pinned.wait(30)  # a hang guard: the pin runs on its thread
        for i in range(40):  # DRAM holds ~20: the others are demoted through the rings
            engine.put(key(i), value(i))
        got = engine.get_many_into([key(i) for i in range(8)],
                                   [bytearray(BLOCK) for _ in range(8)])  # fmt: skip
        assert got == [BLOCK] * 8
        stats = engine.stats()
        reg = ssd.io.pages.registration()
        submissions, entries = ssd.io.pages.counts()
    (tier,) = [t for t in stats.tiers if t.name == "ssd"]
    assert tier.io_engine == "io_uring"
    assert tier.io_rings == reg["rings"] >= 1
    assert tier.io_rings_with_file == tier.io_rings
    assert tier.io_rings_with_memory == (1 if reg["clone_unsupported"] else tier.io_rings)
    assert tier.io_clone_unsupported == reg["clone_unsupported"]
    assert tier.io_files_refused == tier.io_memory_refused == 0
    assert tier.io_fixed_file_entries == reg["fixed_file_entries"] > 0
    assert tier.io_fixed_memory_entries == reg["fixed_memory_entries"] > 0
    assert (tier.io_submissions, tier.io_entries) == (submissions, entries)
    assert 0 < tier.io_submissions < tier.io_entries
    # The DRAM tier has no rings; its counters stay 0.
    assert [t.io_rings for t in stats.tiers if t.name == "dram"] == [0]


def _mapped(address: int) -> bool:
    """Whether a mapping of this process starts at `address` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return any(int(line.split("-", 1)[0], 16) == address for line in maps)


def test_close_unmaps_the_arena_the_rings_held_registered(tmp_path: Path) -> None:
    # The rings hold the arena exported while it is in their buffer tables; close unmaps it
    # once they are closed, not some later GC pass on whatever thread runs then.
    gc.disable()  # a GC pass must not do the unmapping this test is about
    try:
        engine = Engine(config(tmp_path))
        ssd = engine._ssd
        assert ssd is not None and isinstance(ssd.io.pages, RingPages)
        assert ssd.io.pages.pinned.wait(30)
        for i in range(40):
            engine.put(key(i), value(i))
        got = engine.get_many_into([key(i) for i in range(4)], [bytearray(BLOCK)] * 4)
        assert got == [BLOCK] * 4
        assert engine.stats().tiers[1].io_rings_with_memory >= 1
        address = np.frombuffer(arena_of(engine), dtype=np.uint8).ctypes.data
        assert _mapped(address)
        engine.close()
        assert not _mapped(address)
    finally:
        gc.enable()


_REFUSED = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_uring_register import BLOCK, config, key, value
from kvoffload.kvstore import Engine
with Engine(config(Path(sys.argv[1]))) as engine:
    assert engine._ssd.io.pages.pinned.wait(30)
    for i in range(40):
        engine.put(key(i), value(i))
    buf = bytearray(BLOCK)
    ok = [engine.get_into(key(i), buf) == BLOCK and buf == value(i) for i in range(40)]
    print(json.dumps([ok, engine._ssd.io.pages.registration()]))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None or shutil.which("prlimit") is None,
                    reason="needs setpriv and prlimit (util-linux)")  # fmt: skip
def test_memory_the_kernel_refuses_to_pin_runs_unregistered_and_counted(tmp_path: Path) -> None:
    # No CAP_IPC_LOCK and 64 KiB of RLIMIT_MEMLOCK: pinning the 4 MiB arena fails (ENOMEM);
    # the slot file still registers, and every block reads back.
    if os.geteuid() != 0:
        pytest.skip("drops CAP_IPC_LOCK from root's bounding set")
    proc = subprocess.run(
        ["prlimit", "--memlock=65536", "setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-all",
         sys.executable, "-c", _REFUSED, str(tmp_path / "d"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ok, reg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ok == [True] * 40
    # Pinned once (refused once); no ring clones a table that is not there.
    assert reg["memory_refused"] == 1 and reg["rings"] >= 1 and reg["rings_with_memory"] == 0
    assert reg["rings_with_file"] == reg["rings"] and reg["fixed_memory_entries"] == 0
    assert "cannot register the DRAM arena" in proc.stderr


def test_ring_register_is_a_bool() -> None:
    with pytest.raises(ConfigError, match="ring_register"):
        SsdConfig(ring_register="yes")  # type: ignore[arg-type]
