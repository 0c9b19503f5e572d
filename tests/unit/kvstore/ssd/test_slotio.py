from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvoffload.errors import StorageIOError
from kvoffload.kvstore.config import PAGE
from kvoffload.kvstore.ssd.slotio import (
    AlignedBuffer,
    SlotFile,
    SlotHeader,
    pack_header,
    unpack_header,
)


def test_header_round_trip_and_damage() -> None:
    buf = bytearray(PAGE)
    h = SlotHeader(seq=9, key=bytes(range(16)), parent=bytes(16), length=123_456, crc=77,
                   tenant=3, tenant_name="acme")  # fmt: skip
    pack_header(memoryview(buf), h)
    assert unpack_header(buf) == h
    no_parent = SlotHeader(1, bytes(16), None, 0, 0, 0, "")
    pack_header(memoryview(buf), no_parent)
    assert unpack_header(buf) == no_parent
    buf[20] ^= 1
    assert unpack_header(buf) is None
    assert unpack_header(bytes(PAGE)) is None


def test_direct_io_round_trip_and_short_transfers(tmp_path: Path) -> None:
    slots = SlotFile(str(tmp_path / "slots"), 1 << 20)
    src, dst = AlignedBuffer(3 * PAGE), AlignedBuffer(3 * PAGE)
    src.view[:] = os.urandom(3 * PAGE)
    real_pwritev, real_preadv = slots._pwritev, slots._preadv

    def short_write(fd: int, bufs: list[memoryview], offset: int) -> int:
        # The kernel may move fewer bytes than asked; one page at a time here.
        return real_pwritev(fd, [bufs[0][:PAGE]], offset)

    def short_read(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [bufs[0][:PAGE]], offset)

    slots._pwritev, slots._preadv = short_write, short_read
    slots.write(PAGE, [src.view[:PAGE], src.view[PAGE:]])
    slots.read(PAGE, [dst.view])
    assert bytes(dst.view) == bytes(src.view)
    slots.close()


def test_device_errors_become_storage_io_errors(tmp_path: Path) -> None:
    slots = SlotFile(str(tmp_path / "slots"), 1 << 20)
    buf = AlignedBuffer(PAGE)

    def eio(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    slots._pwritev = eio
    with pytest.raises(StorageIOError, match="Input/output error"):
        slots.write(0, [buf.view])
    with pytest.raises(StorageIOError, match="ended"):
        slots.read(1 << 20, [buf.view])
    slots.close()


def test_backend_selection_falls_back_to_the_host_path(tmp_path: Path) -> None:
    from kvoffload.errors import ConfigError
    from kvoffload.kvstore.ssd.slotio import gds_available, select_slot_file

    slots = select_slot_file("auto", str(tmp_path / "a"), 1 << 20)
    assert isinstance(slots, SlotFile)
    assert (slots.device is not None) == gds_available()
    slots.close()
    if not gds_available():
        with pytest.raises(ConfigError, match="kvikio"):
            select_slot_file("kvikio", str(tmp_path / "b"), 1 << 20)
